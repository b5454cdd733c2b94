"""--rollout-gpus (common/rollout/remote.py, docs/async.md): engines on ranks of their own, on the CPU (gloo).

    .venv/bin/python -m pytest -q tests/test_rollout_gpus.py

- one trainer rank + one engine rank, synchronous: every metric of every step equals the colocated run's of one
  rank (the same engine, seeds and weights: the weights went over the link bit for bit, sent behind the step's
  passes: --sync-overlap auto at --tp 1);
- --off-policy-steps 1: every step after the first trains samples of the previous step's weights (staleness 1);
  stopped by SIGTERM during step 1 (the engine generating step 2's request meanwhile: the trainer finishes the
  step, saves, tells the engine to stop, every rank exits 0) and resumed to 4, every step equals the
  uninterrupted run's (the request in flight was saved with the checkpoint); PPO with two trainer ranks (TP 2)
  and two engine replicas runs the same way;
- streaming partial rollouts (--off-policy-steps 2 --partial-chunk-tokens 1): every trained sample within the bound,
  stopped by SIGTERM in step 1 and resumed, the carried groups trained;
- learning: one step off-policy on engines of their own reaches the synchronous run's reward in 50 steps; streaming
  partial rollouts one step off-policy learn (their timing makes a run unrepeatable: a lower bar);
- the flags it refuses, in one line each; a silent engine rank stops the trainer's wait with its rank named.
"""

import concurrent.futures
import time

import pytest

from tests.conftest import read_metrics, run_script, run_torchrun
from tests.test_async import REWARD  # --reward: the embedded task's, and one that sends SIGTERM in step 1

SMALL = ["--prompts-per-step", 8, "--samples-per-prompt", 4, "--micro-batch-size", 4, "--mini-batch-size", 16]
FLAGS = [*SMALL, "--max-new-tokens", 4, "--eval-every", 2]
SKIP = ("_s", "_sec", "tokens_per_s", "mem_", "mfu")  # times, throughputs, memory: not what a step computes


def numbers(record):
    return {k: v for k, v in record.items() if not any(part in k for part in SKIP)}


def assert_same_steps(a_steps, b_steps):
    assert [m["step"] for m in a_steps] == [m["step"] for m in b_steps]
    for a, b in zip(a_steps, b_steps, strict=True):
        for key, value in numbers(a).items():
            assert b.get(key) == pytest.approx(value, rel=1e-6, abs=1e-7), (a["step"], key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_gpus")
    (root / "reward.py").write_text(REWARD)
    plain, stopping = f"{root / 'reward.py'}:reward", f"{root / 'reward.py'}:stop_in_step_1"
    ahead = [*FLAGS, "--rollout-gpus", 1, "--off-policy-steps", 1, "--steps", 4, "--eval-every", 0]  # (40: step 1)
    stream = [*FLAGS, "--rollout-gpus", 1, "--off-policy-steps", 2, "--partial-chunk-tokens", 1, "--steps", 4]
    stream_stopping = [*stream, "--eval-every", 0, "--reward", stopping]  # (the resumed run validates at step 2)
    launches = [
        lambda: run_script("train_grpo.py", *FLAGS, "--steps", 3, "--out", root / "colocated"),
        lambda: run_torchrun("train_grpo.py", 2, *FLAGS, "--steps", 3, "--rollout-gpus", 1, "--out", root / "split"),
        lambda: run_torchrun("train_grpo.py", 2, *ahead, "--reward", plain, "--out", root / "ahead"),
        lambda: (
            run_torchrun("train_grpo.py", 2, *ahead, "--reward", stopping, "--out", root / "resumed"),
            (root / "stopped_steps").write_text(str(len(read_metrics(root / "resumed")))),
            run_torchrun("train_grpo.py", 2, *ahead, "--reward", plain, "--resume", "--out", root / "resumed"),
        ),
        lambda: (
            (root / "stream.log").write_text(
                run_torchrun("train_grpo.py", 2, *stream_stopping, "--out", root / "stream").stdout
            ),
            (root / "stream_stopped").write_text(str(len(read_metrics(root / "stream")))),
            run_torchrun("train_grpo.py", 2, *stream, "--reward", plain, "--resume", "--out", root / "stream"),
        ),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(launch) for launch in launches]:
            future.result()
    return root


def test_engines_of_their_own_sample_what_a_colocated_engine_samples(runs):
    assert_same_steps(read_metrics(runs / "colocated"), read_metrics(runs / "split"))


def test_one_step_ahead_trains_the_previous_steps_samples(runs):
    steps = read_metrics(runs / "ahead")
    assert steps[0]["staleness_share_0"] == 1.0  # step 0: both first requests went after the first sync
    assert all(m["staleness_share_1"] == 1.0 and m["staleness_mean"] == 1.0 for m in steps[1:])
    assert all("correction_masked_frac" in m for m in steps)  # IcePop, the default with K > 0
    assert all(m["logprob_mismatch"] > 1e-4 for m in steps[1:])  # engine logprobs of older weights


def test_resume_trains_the_saved_request_in_flight(runs):
    assert (runs / "stopped_steps").read_text() == "2"  # SIGTERM in step 1: that step finished and saved, exit 0
    assert_same_steps(read_metrics(runs / "ahead"), read_metrics(runs / "resumed"))


def test_streaming_partial_rollouts_keep_the_bound_and_resume(runs):
    """--off-policy-steps 2 --partial-chunk-tokens 1: the engine's thread continues the samples in flight across
    weight syncs; every trained sample is 0-2 steps old. Stopped by SIGTERM in step 1 and resumed, the run trains
    the carried groups (older than the resumed step), validates at step 2 while the thread generates, and ends at
    step 4. (How old each step's samples are depends
    on how far the engine got while the trainer trained: which, is not compared.)"""
    assert (runs / "stream_stopped").read_text() == "2"
    start_up = "1 more rank(s) run the rollout engine only: streaming partial rollouts: samples at most 2 steps old"
    assert start_up in (runs / "stream.log").read_text()
    assert "weight syncs sent behind the next step's passes" in (runs / "stream.log").read_text()  # --tp 1
    steps = read_metrics(runs / "stream")
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    for m in steps:
        shares = [m[f"staleness_share_{a}"] for a in range(3)]
        assert sum(shares) == pytest.approx(1.0) and 0 <= m["staleness_mean"] <= 2
        assert "correction_masked_frac" in m and m["engine_busy_sec"] >= 0 and m["sync_wait_sec"] >= 0
    assert steps[0]["staleness_share_0"] == 1.0  # the first step's groups began under its weights
    assert steps[2]["staleness_share_0"] < 1.0  # the resumed step trained groups carried in the checkpoint
    assert "eval_accuracy" in steps[2]
    assert all(m["logprob_mismatch"] > 1e-4 for m in steps[1:] if m["staleness_mean"] > 0)


@pytest.mark.parametrize("streaming", [False, True], ids=["ahead", "streaming"])
def test_ppo_two_trainer_ranks_two_engine_replicas(tmp_path, streaming):
    """PPO at --tp 2 on two trainer ranks, two engine ranks (two replicas, each its share of the prompts): the
    trainer ranks but the first send nothing and train what the first gathered (streaming: the groups the first
    took, and their prompts, sent to the second)."""
    flags = ["--off-policy-steps", 1] + (["--partial-chunk-tokens", 1] if streaming else [])
    run_torchrun("train_ppo.py", 4, *FLAGS, "--tp", 2, "--rollout-gpus", 2, *flags, "--steps", 3, "--out", tmp_path)
    steps = read_metrics(tmp_path)
    assert len(steps) == 3 and all(m["tokens"] > 0 and m["value_loss"] == m["value_loss"] for m in steps)  # not NaN
    assert not any("sync_wait_sec" in m for m in steps)  # at TP 2 the export gathers: the sync is in the step
    if streaming:  # (age 0 where an engine fell behind the trainer: which groups are complete first is timing)
        assert all(m["staleness_mean"] <= 1 and "partial_frac" in m for m in steps)
    else:
        assert all(m["staleness_share_1"] == 1.0 for m in steps[1:])


# the synchronous embedded run's mean reward over steps 40-49 (tests/test_async.py: 0.656 at --seed 1234)
SYNC_REWARD = 0.66


def test_one_step_ahead_learns_as_the_synchronous_run(tmp_path):
    run_torchrun(
        "train_grpo.py", 2, "--steps", 50, "--eval-every", 0, "--rollout-gpus", 1, "--off-policy-steps", 1,
        "--out", tmp_path,
    )  # fmt: skip
    rewards = [m["reward_mean"] for m in read_metrics(tmp_path)]
    last = sum(rewards[-10:]) / 10
    print(f"--rollout-gpus 1 --off-policy-steps 1: reward of steps 40-49 {last:.3f} (synchronous {SYNC_REWARD})")
    assert last >= SYNC_REWARD - 0.05


def test_streaming_partial_rollouts_learn(tmp_path):
    """One step off-policy, streaming: the reward rises from ~0 to at least 0.25 in 50 steps. Which chunk ran under
    which weights depends on timing, so the samples differ from run to run even at one seed (the reward of steps
    40-49 ranges over ~0.4-0.6 at this one): a bar below the synchronous run's."""
    flags = ["--rollout-gpus", 1, "--off-policy-steps", 1, "--partial-chunk-tokens", 1]
    run_torchrun("train_grpo.py", 2, "--steps", 50, "--eval-every", 0, *flags, "--out", tmp_path)
    rewards = [m["reward_mean"] for m in read_metrics(tmp_path)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"streaming: reward of steps 0-9 {first:.3f}, 40-49 {last:.3f} (synchronous {SYNC_REWARD})")
    assert first < 0.05 and last >= 0.25


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollout-gpus", 1], "leaves no rank to train in a world of 1"),
        (["--rollout-gpus", 1, "--off-policy-steps", 2], "add --partial-chunk-tokens N"),
        (["--rollout-gpus", 1, "--env", "game"], "not supported with --env"),
        (["--rollout-gpus", 1, "--partial-chunk-tokens", 2], "add --off-policy-steps K"),
    ],
)
def test_refused_in_one_line(flags, message):
    proc = run_script("train_grpo.py", *flags, "--dry-run", check=False, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_a_silent_engine_rank_is_named(monkeypatch):
    """The trainer waits for samples; engine rank 1's heartbeat is old: the wait stops and names it."""
    import torch.distributed as dist

    from common.rollout import remote

    store = dist.HashStore()
    link = remote.Link.__new__(remote.Link)  # the messages' half only (no weights group, no heartbeat thread)
    link.store, link.trainers, link.rollout_gpus, link.global_rank, link.timeout_s = store, 1, 1, 0, 3600
    store.set("alive/1", repr(time.time() - 100))
    monkeypatch.setattr(remote, "SILENT_LIMIT_S", 50.0)
    monkeypatch.setattr(remote, "WAIT_SLICE_S", 0.1)
    with pytest.raises(RuntimeError, match="engine rank 1 has not answered for 1.. s"):
        link.take("res/0/0", [1], "the samples of request 0")
    store.set("alive/1", repr(time.time()))
    store.set("res/0/0", __import__("pickle").dumps({"samples": []}))
    assert link.take("res/0/0", [1], "the samples") == {"samples": []}
