"""Tests of common/rollout/engine.py (HFEngine) against plain no-cache forwards of the same HF model.

.venv/bin/python -m pytest -q tests/test_rollout.py
"""

import math

import pytest
import torch

from common.rollout.engine import Sample, generate_checked, rollout_logprobs_mode
from common.rollout.hf_engine import HFEngine
from tests.tiny_models import make_tiny_hf_model

# Variable lengths on purpose: left padding must not change any row.
PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13, 200], [299], [1, 2, 3, 4, 5]]


def full_logits(model, ids):
    """(len(ids), V) float32 logits of one unpadded sequence, no KV cache."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def greedy_reference(model, prompt, max_tokens):
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def recomputed_logprobs(model, sample, temperature):
    """log_softmax(logits / T) of each response token from one forward over prompt + response."""
    ids = sample.prompt_ids + sample.response_ids
    logits = full_logits(model, ids)[len(sample.prompt_ids) - 1 : -1]  # (R, V): predicts response
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_tied", "llama", "qwen3", "mistral"])
def test_greedy_matches_no_cache_argmax(tiny_models_dir, arch):
    engine = HFEngine(str(tiny_models_dir / arch))
    samples = engine.generate(PROMPTS, n=2, temperature=0.0, top_p=1.0, max_tokens=10, seed=0)
    assert len(samples) == len(PROMPTS) * 2
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_reference(engine.model, prompt, 10)
        for s in samples[2 * i : 2 * i + 2]:  # prompt-major order
            assert s.prompt_ids == prompt
            assert s.response_ids == expected
            assert s.finish_reason == "length"
            # greedy returns log_softmax(logits) at T = 1
            torch.testing.assert_close(
                torch.tensor(s.response_logprobs), recomputed_logprobs(engine.model, s, 1.0), rtol=0, atol=1e-5
            )


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_logprobs_match_full_forward(tiny_models_dir, temperature, top_p):
    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    samples = engine.generate(PROMPTS, n=4, temperature=temperature, top_p=top_p, max_tokens=12, seed=3)
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(4)]
    for s in samples:
        assert len(s.response_ids) == len(s.response_logprobs) == 12
        expected = recomputed_logprobs(engine.model, s, temperature)
        torch.testing.assert_close(torch.tensor(s.response_logprobs), expected, rtol=0, atol=1e-5)
    if top_p < 1.0:
        # every sampled token lies in the nucleus of its step's distribution
        for s in samples:
            ids = s.prompt_ids + s.response_ids
            probs = torch.softmax(full_logits(engine.model, ids)[len(s.prompt_ids) - 1 : -1] / temperature, -1)
            for t, tok in enumerate(s.response_ids):
                mass_before = probs[t][probs[t] > probs[t, tok]].sum()
                assert mass_before < top_p


def test_score_and_the_prefill_check(tiny_models_dir):
    """engine.score: the T=1 logprobs of one forward over prompt + response (what vLLM's prompt
    logprobs give); --rollout-logprobs prefill: the same samples as without the check, the first
    scored that way and the others NaN (excluded from logprob_mismatch)."""
    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    samples = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    for s, scored in zip(samples, engine.score(samples)):
        torch.testing.assert_close(torch.tensor(scored), recomputed_logprobs(engine.model, s, 1.0), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(scored), torch.tensor(s.response_logprobs), rtol=0, atol=1e-5)
    checked = generate_checked(engine, PROMPTS, "prefill", n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    assert [s.response_ids for s in checked] == [s.response_ids for s in samples]
    assert checked[0].response_logprobs == engine.score(samples[:1])[0]  # none ended on EOS: the first
    assert all(math.isnan(x) for s in checked[1:] for x in s.response_logprobs)
    one = generate_checked(engine, PROMPTS, "one-per-prompt", n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    assert [s.response_logprobs for s in one] == [s.response_logprobs for s in samples]  # HFEngine: all, by-product
    # the first sample that ended on EOS is the one scored (--mask-truncated keeps only those)
    engine.eos_token_ids = [samples[3].response_ids[2]]
    checked = generate_checked(engine, PROMPTS, "prefill", n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    pick = next(i for i, s in enumerate(checked) if s.finish_reason == "stop")
    assert pick <= 3 and checked[pick].response_logprobs == engine.score(checked[pick : pick + 1])[0]
    assert all(math.isnan(x) for i, s in enumerate(checked) if i != pick for x in s.response_logprobs)


def test_prefill_check_scores_a_bounded_prefix(tiny_models_dir, monkeypatch):
    """A long sample is scored on its first PREFILL_CHECK_TOKENS tokens (vLLM's prompt
    logprobs materialise the request's logits), the rest NaN; a prompt that fills the bound
    leaves nothing to score (the step logs no mismatch) instead of a huge request."""
    import common.rollout.engine as rollout

    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    full = generate_checked(engine, PROMPTS, "prefill", n=1, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    monkeypatch.setattr(rollout, "PREFILL_CHECK_TOKENS", len(PROMPTS[0]) + 2)
    cut = generate_checked(engine, PROMPTS, "prefill", n=1, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    assert cut[0].response_logprobs[:2] == pytest.approx(full[0].response_logprobs[:2], abs=1e-6)
    assert all(math.isnan(x) for x in cut[0].response_logprobs[2:]) and len(cut[0].response_logprobs) == 6
    monkeypatch.setattr(rollout, "PREFILL_CHECK_TOKENS", len(PROMPTS[0]))
    none = generate_checked(engine, PROMPTS, "prefill", n=1, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    assert all(math.isnan(x) for s in none for x in s.response_logprobs)


def test_rollout_logprobs_defaults():
    assert rollout_logprobs_mode(None, 1.0) == "prefill"
    assert rollout_logprobs_mode(None, 0.7, "none") == "one-per-prompt"  # vLLM's prompt logprobs are at T=1
    assert rollout_logprobs_mode(None, 1.0, "tis") == "all"  # a correction's weights need every sample's
    assert rollout_logprobs_mode(None, 1.0, "seq-offpolicy-mask") == "all"
    assert rollout_logprobs_mode("none", 0.7) == "none"
    with pytest.raises(ValueError, match="at temperature 1, not --temperature 0.7"):
        rollout_logprobs_mode("prefill", 0.7)
    with pytest.raises(ValueError, match="--rollout-correction icepop .or --tis-cap. needs"):
        rollout_logprobs_mode("one-per-prompt", 1.0, "icepop")


def test_seed_determinism(tiny_models_dir):
    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    kwargs = dict(n=4, temperature=1.0, top_p=0.95, max_tokens=8)
    a = engine.generate(PROMPTS, seed=1, **kwargs)
    b = engine.generate(PROMPTS, seed=1, **kwargs)
    c = engine.generate(PROMPTS, seed=2, **kwargs)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_logprobs for s in a] == [s.response_logprobs for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    # n samples of one prompt differ from each other (not one sample repeated)
    assert len({tuple(s.response_ids) for s in a[:4]}) > 1


def test_eos_stops_sample(tiny_models_dir):
    hf_dir = str(tiny_models_dir / "qwen2")
    greedy = [greedy_reference(make_tiny_hf_model("qwen2"), p, 8) for p in PROMPTS]
    # an eos that some prompt first emits mid-response (greedy outputs repeat tokens)
    i, eos = next((i, tok) for i, ref in enumerate(greedy) for k, tok in enumerate(ref) if ref.index(tok) >= 2)
    engine = HFEngine(hf_dir, eos_token_ids=[eos])
    samples = engine.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, max_tokens=8, seed=0)
    for s, ref in zip(samples, greedy):
        if eos in ref:
            cut = ref.index(eos) + 1
            assert s.response_ids == ref[:cut] and s.finish_reason == "stop"
            assert len(s.response_logprobs) == cut
        else:
            assert s.response_ids == ref and s.finish_reason == "length"
    assert 3 <= len(samples[i].response_ids) < 8 and samples[i].finish_reason == "stop"

    # sampling: a sample either ends at its first eos ("stop") or runs to max_tokens ("length")
    engine = HFEngine(hf_dir, eos_token_ids=list(range(0, 300, 7)))  # ~1/7 of the vocab stops
    samples = engine.generate(PROMPTS, n=8, temperature=1.0, top_p=1.0, max_tokens=8, seed=0)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    for s in samples:
        assert all(t % 7 != 0 for t in s.response_ids[:-1])
        if s.finish_reason == "stop":
            assert s.response_ids[-1] % 7 == 0 and len(s.response_ids) <= 8
        else:
            assert len(s.response_ids) == 8 and s.response_ids[-1] % 7 != 0
        assert len(s.response_logprobs) == len(s.response_ids)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_tied"])
def test_update_weights(tiny_models_dir, tmp_path, arch):
    engine = HFEngine(str(tiny_models_dir / arch))
    other = make_tiny_hf_model(arch, seed=1)
    other.save_pretrained(tmp_path / "other")
    reference = HFEngine(str(tmp_path / "other"))
    kwargs = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=8, seed=5)
    before = engine.generate(PROMPTS, **kwargs)
    expected = reference.generate(PROMPTS, **kwargs)
    assert [s.response_ids for s in before] != [s.response_ids for s in expected]

    # HF names as export_hf_weights yields them: tied models have no lm_head.weight; the
    # source tensor is a reused buffer (the engine must copy, not alias).
    names = [n for n, _ in other.named_parameters()]
    assert ("lm_head.weight" in names) == (arch == "qwen2")
    buffer = torch.empty(max(p.numel() for p in other.parameters()))

    def stream():
        for name, p in other.named_parameters():
            buffer[: p.numel()].copy_(p.detach().reshape(-1))
            yield name, buffer[: p.numel()].view(p.shape)

    engine.update_weights(stream())
    after = engine.generate(PROMPTS, **kwargs)
    assert [s.response_ids for s in after] == [s.response_ids for s in expected]
    torch.testing.assert_close(
        [s.response_logprobs for s in after], [s.response_logprobs for s in expected], rtol=0, atol=1e-6
    )


def test_update_weights_errors_consume_iterator(tiny_models_dir):
    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    params = list(engine.model.named_parameters())
    consumed = []

    def stream(items):
        for name, t in items:
            consumed.append(name)
            yield name, t.detach().clone()

    bad = params[:3] + [("model.layers.0.mlp.bogus.weight", torch.zeros(3))] + params[3:]
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.bogus.weight'"):
        engine.update_weights(stream(bad))
    assert len(consumed) == len(bad)  # whole iterator consumed before raising
    with pytest.raises(ValueError, match="not updated"):
        engine.update_weights(stream(params[:-1]))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(stream([(params[0][0], torch.zeros(2, 2))] + params[1:]))


def test_max_model_len_ends_responses_at_the_models_positions(tiny_models_dir, capsys):
    """As vLLM: max_model_len beyond max_position_embeddings (256 here) is capped, with the same
    message; each response ends where its prompt + response reach the cap ("length"), a prompt
    that leaves no room is refused. Greedy, no EOS: the tokens are those of an uncapped run."""
    hf_dir = str(tiny_models_dir / "qwen2")
    engine = HFEngine(hf_dir, eos_token_ids=[], max_model_len=1024 + 300)
    assert engine.max_model_len == 256
    assert (
        "max_model_len 1324 (the longest prompt + --max-new-tokens) capped at the model's " in capsys.readouterr().out
    )
    long_prompts = [[3] * 250, [4] * 253, [5, 6]]
    samples = engine.generate(long_prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=12, seed=0)
    assert [len(s.response_ids) for s in samples] == [6, 3, 12]
    assert [s.finish_reason for s in samples] == ["length"] * 3
    assert all(len(s.response_logprobs) == len(s.response_ids) for s in samples)
    uncapped = HFEngine(hf_dir, eos_token_ids=[], max_model_len=100)  # within the positions: kept, no message
    assert uncapped.max_model_len == 100 and "capped" not in capsys.readouterr().out
    assert samples[2].response_ids == uncapped.generate([[5, 6]], 1, 0.0, 1.0, 12, 0)[0].response_ids
    with pytest.raises(ValueError, match="no room for a response within max_model_len 256"):
        engine.generate([[3] * 256], n=1, temperature=0.0, top_p=1.0, max_tokens=4, seed=0)


def test_variable_length_batch_equals_alone(tiny_models_dir):
    engine = HFEngine(str(tiny_models_dir / "llama"))
    kwargs = dict(n=1, temperature=0.0, top_p=1.0, max_tokens=10, seed=0)
    batched = engine.generate(PROMPTS, **kwargs)
    for prompt, s in zip(PROMPTS, batched):
        alone = engine.generate([prompt], **kwargs)[0]
        assert alone.response_ids == s.response_ids
        torch.testing.assert_close(alone.response_logprobs, s.response_logprobs, rtol=0, atol=1e-5)


def test_generation_is_one_batched_cached_pass_per_token(tiny_models_dir):
    """What keeps the CPU rollout fast (its speed is bench/rollout.py's): 128 samples share every forward pass,
    the prompt is fed once and each later pass feeds one new token per row from the KV cache."""
    engine = HFEngine(str(tiny_models_dir / "qwen2"))
    prompts = [[(7 * i + j) % 300 for j in range(10 + i % 5)] for i in range(16)]
    fed = []
    forward = engine.model.forward
    engine.model.forward = lambda *a, **kw: fed.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)
    samples = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=16, seed=0)
    assert len(samples) == 128 and all(isinstance(s, Sample) for s in samples)
    longest = max(len(s.response_ids) for s in samples)
    assert fed == [(128, 14)] + [(128, 1)] * (longest - 1)
