"""End-to-end tests of --off-policy-steps (docs/async.md) through train_grpo.py and train_ppo.py on the CPU.

    .venv/bin/python -m pytest -q tests/test_async.py

- --off-policy-steps 0 is the synchronous loop to the bit (every metric of a GRPO step equal);
- resume: GRPO stopped by SIGTERM during step 1's rollout of partial rollouts (one-token chunks, responses of up to
  4; it finishes the step, saves, exits 0), resumed to 4 == 4 steps in one go (every step equal: the carried
  samples, their versions and logprobs came back); PPO resumed after 2 steps trains the carried samples (age 1);
  the staleness metrics show partial samples;
- --bench-response-lengths reaches the partial rollouts: every trained response has its drawn length;
- data parallel 2: the replicas' samples come together with their own logprobs, the same staleness schedule;
- learning: K = 1 and K = 2 on the embedded task (its default settings, IcePop the default correction) reach the
  synchronous run's reward in the same 50 steps (the same samples per step).
"""

import pytest

from tests.conftest import read_metrics, run_scripts, run_torchrun

SMALL = ["--prompts-per-step", 8, "--samples-per-prompt", 4, "--micro-batch-size", 4, "--mini-batch-size", 16]
PARTIAL = [*SMALL, "--max-new-tokens", 4, "--off-policy-steps", 1, "--partial-chunk-tokens", 1, "--eval-every", 0]
# what a step computes (the times, throughputs and memory are not): the keys compared
SKIP = ("_s", "_sec", "tokens_per_s", "mem_", "mfu")


def numbers(record):
    return {k: v for k, v in record.items() if not any(part in k for part in SKIP)}


# --reward FILE.py:NAME: the embedded task's own reward; the second sends this process SIGTERM during step 1's rollout
# (32 samples a step), as a preemption would: the run finishes the step, saves what is in flight, exits 0
REWARD = """
import os, signal
from common.rl.rewards import synthetic_reward
calls = 0
def reward(response, answer):
    return synthetic_reward(response, answer, format_credit=0.0)
def stop_in_step_1(response, answer):
    global calls
    calls += 1
    if calls == 40:
        os.kill(os.getpid(), signal.SIGTERM)
    return reward(response, answer)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """At once: GRPO 1 step without the flag and with --off-policy-steps 0; GRPO 4 steps of partial rollouts, and
    the same stopped by SIGTERM in step 1; PPO's first 2 steps. Then the last two resumed to 4."""
    root = tmp_path_factory.mktemp("async")
    (root / "reward.py").write_text(REWARD)
    plain, stopping = f"{root / 'reward.py'}:reward", f"{root / 'reward.py'}:stop_in_step_1"
    sync = [*SMALL, "--max-new-tokens", 4, "--steps", 1]
    outputs = run_scripts(
        ("train_grpo.py", *sync, "--out", root / "plain"),
        ("train_grpo.py", *sync, "--off-policy-steps", 0, "--out", root / "k0"),
        ("train_grpo.py", *PARTIAL, "--steps", 4, "--reward", plain, "--out", root / "grpo_straight"),
        ("train_grpo.py", *PARTIAL, "--steps", 4, "--reward", stopping, "--out", root / "grpo_resumed"),
        ("train_ppo.py", *PARTIAL, "--steps", 2, "--reward", plain, "--out", root / "ppo_resumed"),
        ("train_grpo.py", *PARTIAL, "--steps", 3, "--bench-response-lengths", "fixed:3", "--out", root / "lengths"),
    )
    assert "SIGTERM received" in outputs[3] and len(read_metrics(root / "grpo_resumed")) == 2
    run_scripts(
        *[
            (f"train_{s}.py", *PARTIAL, "--steps", 4, "--reward", plain, "--out", root / f"{s}_resumed", "--resume")
            for s in ("grpo", "ppo")
        ]
    )
    return root


def test_bench_response_lengths_reach_the_partial_rollouts(runs):
    """--bench-response-lengths fixed:3 with --off-policy-steps 1 (one-token chunks, --max-new-tokens 4): every
    trained response has exactly 3 tokens, written over several steps' weights, none ending early on EOS."""
    rows = read_metrics(runs / "lengths")
    assert [r["response_len_mean"] for r in rows] == [3.0] * 3 and all(r["truncated_frac"] == 1.0 for r in rows)
    assert all(r["staleness_share_1"] == 1.0 for r in rows[1:]) and any(r["partial_frac"] > 0 for r in rows)


def test_zero_is_the_synchronous_loop(runs):
    plain, k0 = read_metrics(runs / "plain"), read_metrics(runs / "k0")
    assert len(plain) == 1 and [numbers(m) for m in plain] == [numbers(m) for m in k0]
    assert "staleness_mean" not in plain[-1]


def test_resume_continues_the_carried_samples(runs):
    straight, resumed = read_metrics(runs / "grpo_straight"), read_metrics(runs / "grpo_resumed")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):  # the steps before and after the SIGTERM
        for key, value in numbers(a).items():
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (a["step"], key)
    assert_partial_rollouts(straight)


def test_ppo_resumes_the_carried_samples(runs):
    """Without the carried samples a resumed step 2 would train fresh ones (age 0)."""
    ppo = read_metrics(runs / "ppo_resumed")
    assert [m["step"] for m in ppo] == [0, 1, 2, 3]
    assert_partial_rollouts(ppo)


def assert_partial_rollouts(steps):
    # every step after the first trains groups begun a step earlier, some of them continued under newer weights
    assert all(m["staleness_share_1"] == 1.0 and m["dropped_samples"] == 0 for m in steps[1:])
    assert any(m["partial_frac"] > 0 for m in steps) and all(m["carried_samples"] == 32 for m in steps)
    assert all("correction_masked_frac" in m for m in steps)  # IcePop, the default with K > 0


def test_two_replicas_carry_their_samples(tmp_path):
    """Data parallel 2 (two rollout replicas, gloo): each replica continues its share of the groups in flight and
    every rank trains all of them in one order; the engine logprobs of step 0 (fresh samples) equal the trainer's,
    so no sample was paired with another's logprobs when the replicas' samples came together."""
    run_torchrun("train_grpo.py", 2, *PARTIAL, "--steps", 3, "--out", tmp_path)
    steps = read_metrics(tmp_path)
    assert steps[0]["logprob_mismatch"] < 1e-5 and steps[0]["staleness_share_0"] == 1.0
    assert_partial_rollouts(steps)


# the synchronous embedded run's mean reward over steps 40-49 (measured, --seed 1234: 0.656; K = 1: 0.703, K = 2: 0.690)
SYNC_REWARD = 0.66


@pytest.mark.parametrize("k", [1, 2])
def test_async_learns_as_the_synchronous_run(learning, k):
    rewards = [m["reward_mean"] for m in learning[k]]
    last = sum(rewards[-10:]) / 10
    print(f"--off-policy-steps {k}: reward of steps 40-49 {last:.3f} (synchronous {SYNC_REWARD})")
    assert last >= SYNC_REWARD - 0.05
    assert all(m["staleness_share_" + str(k)] == 1.0 for m in learning[k][k:])  # K steps off-policy throughout


@pytest.fixture(scope="module")
def learning(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_learning")
    run_scripts(
        *[
            ("train_grpo.py", "--steps", 50, "--eval-every", 0, "--off-policy-steps", k, "--out", root / f"k{k}")
            for k in (1, 2)
        ]
    )
    return {k: read_metrics(root / f"k{k}") for k in (1, 2)}
