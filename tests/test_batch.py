"""common/batch.py: packing samples into (B, T) tensors and splitting micro-batches.

    .venv/bin/python -m pytest -q tests/test_batch.py

The layout is checked by hand: logits at position t predict token t+1, so a response token
j of a prompt of length p is predicted at position p + j - 1; the mask, the targets and the
rollout logprobs must sit there. A sample whose engine returned no logprobs (NaN, vLLM with
--rollout-logprobs one-per-prompt) is excluded by rollout_mask, and no NaN reaches a tensor.
"""
import math

import torch

from common.batch import pack_sequences, split_micro_batches
from common.rollout import Sample


def test_pack_sequences_layout_by_hand():
    samples = [Sample([5, 6], [7, 8, 9], [-0.5, -1.0, -2.0], "stop"),
               Sample([4], [3], [-0.25], "length")]
    b = pack_sequences(samples, pad_id=0, length_multiple=4)
    assert b["tokens"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [4, 3, 0, 0, 0, 0, 0, 0]]  # T = 5 -> 8
    assert b["targets"][0, :4].tolist() == [6, 7, 8, 9] and b["targets"][1, 0] == 3
    assert b["mask"].tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert b["rollout_logprobs"].tolist() == [[0, -0.5, -1.0, -2.0, 0, 0, 0, 0], [-0.25, 0, 0, 0, 0, 0, 0, 0]]
    assert torch.equal(b["rollout_mask"], b["mask"])
    assert b["response_len"].tolist() == [3, 1]
    assert b["positions"][1].tolist() == list(range(8))


def test_samples_without_engine_logprobs_are_masked_out():
    samples = [Sample([5, 6], [7, 8], [-0.5, -1.0], "stop"), Sample([5, 6], [9, 1], [math.nan, math.nan], "stop")]
    b = pack_sequences(samples, pad_id=0)
    assert b["mask"][1].sum() == 2 and b["rollout_mask"][1].sum() == 0  # still trained on, not compared
    assert torch.equal(b["rollout_mask"][0], b["mask"][0])
    assert torch.isfinite(b["rollout_logprobs"]).all()
    mismatch = (b["rollout_logprobs"] - torch.full_like(b["rollout_logprobs"], -1.0)).abs()
    assert (mismatch * b["rollout_mask"]).sum() / b["rollout_mask"].sum() == 0.25  # (0.5 + 0) / 2


def test_split_micro_batches():
    batch = {"a": torch.arange(10), "b": torch.arange(20).view(10, 2)}
    mbs = split_micro_batches(batch, 4)
    assert [len(mb["a"]) for mb in mbs] == [4, 4, 2]
    assert torch.equal(torch.cat([mb["b"] for mb in mbs]), batch["b"])
