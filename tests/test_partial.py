"""Tests of common/rollout/partial.py (--off-policy-steps' carry-over store) with a fake engine whose samples end when
the test says, and of the flags' checks (common/run/flags_async.py) through train_grpo.py's parser.

    .venv/bin/python -m pytest -q tests/test_partial.py

- a hand-checked schedule (K = 1, 2 prompts per step, G = 2, chunks of 2 tokens): which groups are trained at which
  step, each token's version and engine logprob, the staleness bound, a stale group dropped and its prompt sampled
  afresh, the metrics;
- the state saved mid-run (through JSON, as in a checkpoint) continues exactly as the uninterrupted store;
- the flags: the defaults K > 0 implies, and one-line refusals of what it does not support;
- spread_generate: with two replicas each row runs on its replica (its seed) and comes back in row order.
"""

import json

import pytest

from common.rollout.engine import Sample
from common.rollout.partial import PartialRollouts

EOS = 0


class FakeEngine:
    """generate(rows, max_tokens, seed) of PartialRollouts. A sample's length is drawn when it starts, from the
    queue of its prompt (prompt ids [p]), and written as its first token (100 + length); then 1s, EOS last. Every
    token's logprob is -(version + 1): the weights that sampled it."""

    def __init__(self, lengths):
        self.lengths = {p: list(ls) for p, ls in lengths.items()}
        self.version, self.calls = None, []

    def generate(self, rows, max_tokens, seed):
        self.calls.append((len(rows), max_tokens))
        out = []
        for row in rows:
            prompt, response = row[:1], row[1:]
            length = response[0] - 100 if response else self.lengths[prompt[0]].pop(0)
            full = [100 + length] + [1] * (length - 2) + [EOS] if length > 1 else [EOS]
            new = full[len(response) :][:max_tokens]
            reason = "stop" if len(response) + len(new) == length else "length"
            out.append(Sample(row, new, [-(self.version + 1.0)] * len(new), reason))
        return out


# sample lengths per prompt, in the order its samples start (prompt 1 twice: dropped at step 2, then afresh)
LENGTHS = {0: [2, 2], 1: [6, 1, 2, 2], 2: [1, 1], 3: [4, 4], 4: [2, 6], 5: [2, 2], 6: [2, 2], 7: [6, 6]}
BATCHES = [[0, 1], [2, 3], [4, 5], [6, 7]]  # the prompt sampler's batches, in order
PROMPT_IDS = [[p] for p in range(8)]


def run_steps(store, engine, steps, batches):
    out = []
    for step in steps:
        engine.version = step  # this step's weights
        samples, prompts, metrics = store.rollout(
            step, batches.pop(0), lambda: batches.pop(0), PROMPT_IDS, engine.generate
        )
        out.append((samples, prompts, metrics))
    return out


def new_store():
    return PartialRollouts(off_policy_steps=1, prompts_per_step=2, group=2, max_tokens=6, chunk_tokens=2)


def test_hand_checked_schedule():
    store, engine = new_store(), FakeEngine(LENGTHS)
    (s0, p0, m0), (s1, p1, m1), (s2, p2, m2) = run_steps(store, engine, range(3), list(BATCHES))
    # step 0: prompts 0, 1 + (filling K + 1 = 2 steps' worth) 2, 3; one chunk completes prompts 0 and 2
    assert p0 == [0, 2] and m0["rollout_chunks"] == 1 and engine.calls[0] == (8, 2)
    assert [s.response_ids for s in s0] == [[102, EOS], [102, EOS], [EOS], [EOS]]
    assert all(s.versions == [0] * len(s.response_ids) for s in s0)
    # step 1: prompt 3 (started at step 0) ends under step 1's weights; prompt 5 starts and ends
    assert p1 == [3, 5]
    assert [s.versions for s in s1] == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1], [1, 1]]
    assert [s.response_logprobs for s in s1[:2]] == [[-1.0, -1.0, -2.0, -2.0]] * 2  # the engine's, per version
    assert [s.finish_reason for s in s1] == ["stop"] * 4
    assert m1 == dict(
        staleness_share_0=0.5,
        staleness_share_1=0.5,
        staleness_mean=0.5,
        partial_frac=0.5,
        dropped_samples=0,
        carried_samples=4,  # prompt 1 (a sample at 4 of 6 tokens, one done) and prompt 4 (at 2 of 6, one done)
        rollout_chunks=1,
        generated_tokens=14,  # 7 running samples, 2 tokens each
    )
    # step 2: prompt 1 started at step 0 is 2 versions old: dropped, sampled afresh (lengths 2, 2) with 6 and 7
    assert p2 == [1, 6] and m2["dropped_samples"] == 2 and m2["staleness_share_0"] == 1.0
    assert [s.versions for s in s2[:2]] == [[2, 2], [2, 2]]
    assert [g.prompt for g in store.groups] == [4, 7] and [g.version for g in store.groups] == [1, 2]
    # prompt 4's long sample: 2 tokens at step 1, 2 at step 2; at step 3 it is too old, dropped again
    assert store.groups[0].samples[1].versions == [1, 1, 2, 2]
    engine.lengths.update({4: [2, 2], 2: [1, 1], 3: [1, 1]})
    s3, p3, m3 = run_steps(store, engine, [3], [[2, 3]])[0]
    assert p3 == [4, 2] and m3["dropped_samples"] == 2 and [g.prompt for g in store.groups] == [7, 3]
    for step, samples in enumerate([s0, s1, s2, s3]):
        assert all(0 <= step - s.versions[0] <= 1 for s in samples)  # the staleness bound


def test_saved_state_continues_exactly():
    straight, engine = new_store(), FakeEngine(LENGTHS)
    expected = run_steps(straight, engine, range(3), list(BATCHES))
    store, engine, batches = new_store(), FakeEngine(LENGTHS), list(BATCHES)
    run_steps(store, engine, [0], batches)
    resumed = new_store()
    resumed.load_state_dict(json.loads(json.dumps(store.state_dict())))  # as train_state.json holds it
    assert run_steps(resumed, engine, [1, 2], batches) == expected[1:]  # samples, versions, logprobs, metrics


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--off-policy-steps", "-1"], "--off-policy-steps must be >= 0"),
        (["--partial-chunk-tokens", "4"], "add --off-policy-steps K"),
        (["--off-policy-steps", "1", "--rollout-logprobs", "prefill"], "--rollout-logprobs all, not prefill"),
        (["--off-policy-steps", "1", "--dynamic-sampling"], "not supported with --dynamic-sampling"),
        (["--off-policy-steps", "1", "--env", "game"], "not supported with --env"),
        (["--off-policy-steps", "1", "--partial-chunk-tokens", "0"], "--partial-chunk-tokens must be >= 1"),
    ],
)
def test_flags_refused(flags, error, capsys, tmp_path):
    from train_grpo import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args([*flags, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and error in capsys.readouterr().err


def test_flags_defaults(tmp_path):
    from train_grpo import parse_args

    args = parse_args(["--off-policy-steps", "2", "--max-new-tokens", "10", "--out", str(tmp_path)])
    assert (args.rollout_logprobs, args.rollout_correction, args.partial_chunk_tokens) == ("all", "icepop", 3)
    args = parse_args(["--off-policy-steps", "1", "--rollout-correction", "tis", "--out", str(tmp_path)])
    assert args.rollout_correction == "tis" and args.correction_high == 2.0
    args = parse_args(["--out", str(tmp_path)])  # synchronous: nothing changes
    assert (args.off_policy_steps, args.partial_chunk_tokens, args.rollout_correction) == (0, None, "none")


def test_spread_generate_puts_every_replica_row_back_in_place(monkeypatch):
    """Two replicas: replica r runs rows r, r + 2, ... (its own seed); the all-gather brings them replica-major; every
    rank gets them back in row order."""
    import common.rollout.partial as P

    asked = []

    class Echo:  # answers each row with its own last id and the seed it was given
        def generate(self, prompts, n, temperature, top_p, max_tokens, seed, logprob_samples=None, **kwargs):
            assert n == 1 and logprob_samples is None  # every token's logprob
            asked.append(kwargs.get("response_lengths"))
            return [Sample(p, [p[-1]], [float(seed)], "length") for p in prompts]

    rows = [[10 + i] for i in range(5)]
    mine = Echo().generate(rows[1::2], 1, 1.0, 1.0, 2, seed=7 + 1)  # what replica 1 contributes
    monkeypatch.setattr(P, "gather_samples", lambda local: local + mine)
    out = P.spread_generate(Echo(), 0, 2, True, 1.0, 1.0)(rows, 2, 7)
    assert [s.response_ids for s in out] == [[10], [11], [12], [13], [14]]
    assert [s.response_logprobs for s in out] == [[7.0], [8.0], [7.0], [8.0], [7.0]]
    assert asked[-1] is None  # no drawn lengths: the engine stops where it stops
    P.spread_generate(Echo(), 0, 2, True, 1.0, 1.0)(rows, 5, 7, lengths=[1, 2, 3, 4, 5])
    assert asked[-1] == [1, 3, 5]  # replica 0's rows, each its own exact length


def test_bench_lengths_every_trained_sample_gets_its_drawn_length_chunk_by_chunk():
    """lengths (a --bench-response-lengths spec): each new group draws its samples' lengths, every chunk asks the
    engine for exact tokens (EOS ignored) up to them, and every trained sample has exactly its draw, also when the
    store continues from its saved state; the n-th group's draw is the same in every run."""
    from common.rollout.lengths import draw_lengths

    asked = []

    def generate(rows, max_tokens, seed, lengths=None):  # an engine honouring exact lengths: token 7 each
        asked.append(lengths)
        assert lengths is not None and len(lengths) == len(rows) and max_tokens == max(lengths)
        return [Sample(row, [7] * k, [-1.0] * k, "length") for row, k in zip(rows, lengths)]

    def store():
        return PartialRollouts(1, 2, 2, max_tokens=9, chunk_tokens=3, seed=5, lengths="uniform:min=1,max=9")

    first, batches = store(), [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]
    trained, chunks = [], 0
    for step in range(3):
        samples, prompts, metrics = first.rollout(step, batches.pop(0), lambda: batches.pop(0), PROMPT_IDS, generate)
        trained.append([len(s.response_ids) for s in samples])
        chunks += metrics["rollout_chunks"]
        if step == 1:
            state = json.loads(json.dumps(first.state_dict()))
    draws = [draw_lengths("uniform:min=1,max=9", 1, 2, seed=5, step=n, round_=-1)[0] for n in range(8)]
    assert trained[0] == draws[0] + draws[1]  # step 0: the first two groups, each sample its own draw
    assert all(1 <= tokens <= 3 for lengths in asked for tokens in lengths)
    assert len(asked) == chunks  # one engine call a chunk, each row its own budget (not a call per distinct budget)
    assert any(len(set(lengths)) > 1 for lengths in asked)
    assert all(len(s.response_ids) == t for g in first.groups for s, t in zip(g.samples, g.targets) if s.finish_reason)
    resumed, batches = store(), [[0, 1], [2, 3]]
    resumed.load_state_dict(state)
    again, _, _ = resumed.rollout(2, batches.pop(0), lambda: batches.pop(0), PROMPT_IDS, generate)
    assert [len(s.response_ids) for s in again] == trained[2] and resumed.draws == first.draws
