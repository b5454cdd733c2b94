"""DAPO's data-side techniques (common/rl/dapo.py) against hand computations, and the flags of
train_grpo.py end to end on the CPU.

    .venv/bin/python -m pytest -q tests/test_dapo.py
"""

import types

import pytest
import torch

from common.rl.dapo import dynamic_sampling, overlong_penalty
from tests.conftest import read_metrics, run_script


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 4: free up to 16, then -1/4 per token, -1 at 20 (DAPO eq. 13)
    got = overlong_penalty([0, 16, 17, 18, 20, 21], max_len=20, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty([18], max_len=20, buffer=4, factor=0.5).tolist() == [-0.25]


def batch(rewards):
    """(samples, rewards) for prompt-major groups: sample i of the batch is named by its reward row."""
    flat = [r for group in rewards for r in group]
    return [types.SimpleNamespace(tag=(tuple(g), j)) for g in rewards for j in range(len(g))], torch.tensor(flat)


def test_dynamic_sampling_keeps_informative_groups_then_fills():
    calls = []

    def more(round_):
        calls.append(round_)
        return batch({1: [[1, 1], [0, 1], [2, 2]], 2: [[0, 0], [0, 0], [0, 0]], 3: [[3, 4], [4, 4], [5, 6]]}[round_])

    # 3 groups wanted; round 0 has one with a signal ([0, 1]), round 1 one more, round 2 none, round 3 two
    samples, rewards, metrics = dynamic_sampling(*batch([[1, 1], [0, 1], [2, 2]]), group=2, more=more, max_rounds=5)
    assert calls == [1, 2, 3]  # stopped as soon as the batch was full
    assert rewards.tolist() == [0, 1, 0, 1, 3, 4] and len(samples) == 6
    assert metrics == {
        "sampling_rounds": 4,
        "informative_groups": 3,
        "filler_groups": 0,
        "first_round_informative_frac": pytest.approx(1 / 3),
    }
    # capped at one extra round: 2 informative groups, the first zero-signal group fills the batch
    calls.clear()
    samples, rewards, metrics = dynamic_sampling(*batch([[1, 1], [0, 1], [2, 2]]), group=2, more=more, max_rounds=1)
    assert calls == [1] and rewards.tolist() == [0, 1, 0, 1, 1, 1]
    assert metrics["informative_groups"] == 2 and metrics["filler_groups"] == 1 and metrics["sampling_rounds"] == 2
    # already full: no extra round
    calls.clear()
    _, rewards, metrics = dynamic_sampling(*batch([[0, 1], [1, 0]]), group=2, more=more, max_rounds=3)
    assert calls == [] and metrics["sampling_rounds"] == 1 and rewards.tolist() == [0, 1, 1, 0]


def test_train_grpo_dapo_flags(tmp_path):
    """All of DAPO's switches at once: every step trains on a full batch of groups, logs its
    rounds, and the overlong penalty shows in the rewards (responses of 4 tokens with a
    buffer of 2 tokens: 3 tokens cost 0.5, 4 cost 1)."""
    run_script(
        "train_grpo.py",
        "--prompts-per-step",
        8,
        "--samples-per-prompt",
        4,
        "--micro-batch-size",
        4,
        "--mini-batch-size",
        32,
        "--max-new-tokens",
        4,
        "--steps",
        3,
        "--out",
        tmp_path,
        "--dynamic-sampling",
        "--max-sampling-rounds",
        2,
        "--overlong-buffer",
        2,
        "--mask-truncated",
        "--clip-high",
        0.28,
        "--loss-agg",
        "token_mean",
        "--kl-coef",
        0,
    )
    for m in read_metrics(tmp_path):
        assert 1 <= m["sampling_rounds"] <= 3
        assert m["informative_groups"] + m["filler_groups"] == 8
        assert m["reward_mean"] < 0  # almost every response is cut at 4 tokens: -1 each
