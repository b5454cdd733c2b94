"""common/rl/batch.py: packing samples into (B, T) tensors and splitting micro-batches.

    .venv/bin/python -m pytest -q tests/test_batch.py

The layout is checked by hand: logits at position t predict token t+1, so a response token
j of a prompt of length p is predicted at position p + j - 1; the mask, the targets and the
rollout logprobs must sit there. A sample whose engine returned no logprobs (NaN, vLLM with
--rollout-logprobs one-per-prompt) is excluded by rollout_mask, and no NaN reaches a tensor.
micro_batches orders rows by length and cuts each micro-batch's padding (checked by hand), and
a tiny Qwen2 gives the same logprobs and gradients on cut micro-batches as at full width
(worker: tests/batch_worker.py).
"""

import json
import math

import torch

from common.rl.batch import micro_batches, pack_sequences, split_micro_batches
from common.rollout.engine import Sample
from tests.conftest import run_script


def test_pack_sequences_layout_by_hand():
    samples = [Sample([5, 6], [7, 8, 9], [-0.5, -1.0, -2.0], "stop"), Sample([4], [3], [-0.25], "length")]
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


def test_micro_batches_sort_and_cut_by_hand():
    # ends (position after the last predicted token): row0 5, row1 2, row2 13, row3 9
    samples = [
        Sample([1, 2], [3, 4, 5, 6], [0.0] * 4, "stop"),
        Sample([1, 2], [3], [0.0], "stop"),
        Sample([1, 2], [3] * 12, [0.0] * 12, "length"),
        Sample([1, 2], [3] * 8, [0.0] * 8, "stop"),
    ]
    b = pack_sequences(samples, pad_id=0, length_multiple=4)  # width 16
    b["row"] = torch.arange(4)
    mbs = micro_batches(b, torch.tensor([0, 1, 2, 3]), micro_batch_size=2, length_multiple=4)
    assert [mb["row"].tolist() for mb in mbs] == [[1, 0], [3, 2]]  # sorted by length
    assert [mb["tokens"].shape[1] for mb in mbs] == [8, 16]  # 5 -> 8, 13 -> 16
    assert torch.equal(mbs[0]["mask"], b["mask"][[1, 0], :8]) and mbs[0]["mask"][:, 8:].numel() == 0
    assert torch.equal(mbs[1]["targets"], b["targets"][[3, 2]])
    assert mbs[0]["response_len"].tolist() == [1, 4]  # (B,) tensors follow the rows
    same = micro_batches(b, torch.tensor([0, 1, 2, 3]), micro_batch_size=2, length_multiple=4, same_length=True)
    assert [mb["tokens"].shape[1] for mb in same] == [16, 16]  # a pipeline needs one shape


def test_micro_batches_token_budget_by_hand():
    # ends 2, 5, 9, 13 (rows 1, 0, 3, 2 ascending), length_multiple 4 -> cuts 4, 8, 12, 16
    samples = [
        Sample([1, 2], [3, 4, 5, 6], [0.0] * 4, "stop"),
        Sample([1, 2], [3], [0.0], "stop"),
        Sample([1, 2], [3] * 12, [0.0] * 12, "length"),
        Sample([1, 2], [3] * 8, [0.0] * 8, "stop"),
    ]
    b = pack_sequences(samples, pad_id=0, length_multiple=4)
    b["row"] = torch.arange(4)
    rows = torch.tensor([0, 1, 2, 3])

    def layout(**kw):
        mbs = micro_batches(b, rows, micro_batch_size=99, length_multiple=4, **kw)
        return [(mb["row"].tolist(), mb["tokens"].shape[1]) for mb in mbs]

    # budget 16: [1] cut 4, + row 0 -> 2 x 8 = 16 fits; + row 3 -> 3 x 12 = 36 no;
    # [3] 12, + row 2 -> 2 x 16 = 32 no; [2] 16
    assert layout(max_tokens=16) == [([1, 0], 8), ([3], 12), ([2], 16)]
    assert layout(max_tokens=24) == [([1, 0], 8), ([3], 12), ([2], 16)]  # 3 x 12 = 36 > 24
    assert layout(max_tokens=36) == [([1, 0, 3], 12), ([2], 16)]
    assert layout(max_tokens=64) == [([1, 0, 3, 2], 16)]
    assert layout(max_tokens=1) == [([1], 4), ([0], 8), ([3], 12), ([2], 16)]  # a row never waits
    # with one length for all (a pipeline), every row costs the longest cut, 16: 2 rows per 32
    assert layout(max_tokens=32, same_length=True) == [([1, 0], 16), ([3, 2], 16)]
    # every row lands exactly once, whatever the budget
    for budget in range(1, 70, 3):
        assert sorted(r for rs, _ in layout(max_tokens=budget) for r in rs) == [0, 1, 2, 3]


def test_cut_padding_same_logprobs_and_grads(tmp_path):
    """A tiny Qwen2 forward/backward on cut micro-batches equals the full-width one."""
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model("qwen2", str(tmp_path / "qwen2"))
    proc = run_script("tests/batch_worker.py", tmp_path / "qwen2", timeout=300)
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(r)
    assert r["logprob_diff"] < 1e-5
    assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_max"])
    assert r["cut_tokens"] < 0.7 * r["full_tokens"]  # the padding was really skipped
