"""--rollout-gpus on two GPUs (docs/async.md): the trainer on one, vLLM on the other, weights over NCCL.

    python -m pytest -q -s tests/gpu/test_rollout_gpus_gpu.py     (GPU machine with 2 GPUs, stack of shared/device)

The embedded tiny model, 3 steps of 16-token responses each run. Checked: exit 0 of a colocated run on one GPU and
of the split run (rank 0 trains, rank 1 runs vLLM) in both modes; in every split run the engine's logprobs of
step 0 agree with the trainer's (logprob_mismatch < 0.05: the weights crossed the NCCL link intact; random weights
would be far off); synchronous, the split run samples what the colocated one samples (the same response lengths
and rewards: one vLLM engine, seeds and weights); one step ahead (--off-policy-steps 1), every later step trains
samples of the previous step's weights, with the IcePop correction's metrics; streaming partial rollouts
(--off-policy-steps 2 --partial-chunk-tokens 4, 5 steps), every trained sample within the bound, step 0's samples
(all of step 0's weights) agreeing with the trainer; a random Qwen3-MoE (tests/gpu/test_moe_gpu.py) streaming on
an engine of its own, its experts sent as per-expert tensors: step 0's samples agreeing with the trainer. Printed:
each step's sync, rollout and train seconds.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import run_script  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

FLAGS = ["--steps", "3", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--mini-batch-size", "32"]
FLAGS += ["--max-new-tokens", "16", "--eval-every", "0", "--rollout", "vllm"]
KEYS = ["sync_s", "rollout_s", "train_s", "step_s", "logprob_mismatch", "reward_mean", "response_len_mean"]
MORE = ["staleness_mean", "engine_busy_sec", "partial_frac", "dropped_samples", "rollout_chunks"]


def show(name, rows):
    for r in rows:
        print(name, {k: r.get(k) for k in KEYS + MORE if k in r})


def test_split_samples_as_the_colocated_engine(tmp_path):
    colocated, _ = run_script("train_grpo.py", tmp_path / "colocated", *FLAGS, timeout=300)
    split, _ = run_script("train_grpo.py", tmp_path / "split", *FLAGS, "--rollout-gpus", "1", ranks=2, timeout=300)
    show("colocated", colocated)
    show("split", split)
    assert split[0]["logprob_mismatch"] < 0.05
    for a, b in zip(colocated, split, strict=True):
        assert (a["response_len_mean"], a["reward_mean"]) == (b["response_len_mean"], b["reward_mean"])


def test_one_step_ahead(tmp_path):
    rows, _ = run_script(
        "train_grpo.py", tmp_path, *FLAGS, "--rollout-gpus", "1", "--off-policy-steps", "1", ranks=2, timeout=300
    )
    show("ahead", rows)
    assert rows[0]["logprob_mismatch"] < 0.05 and rows[0]["staleness_share_0"] == 1.0
    assert all(r["staleness_share_1"] == 1.0 for r in rows[1:])
    assert all("correction_masked_frac" in r for r in rows)


def test_streaming_partial_rollouts(tmp_path):
    flags = [*FLAGS, "--steps", "5", "--rollout-gpus", "1", "--off-policy-steps", "2", "--partial-chunk-tokens", "4"]
    rows, _ = run_script("train_grpo.py", tmp_path, *flags, ranks=2, timeout=300)
    show("streaming", rows)
    assert len(rows) == 5 and rows[0]["logprob_mismatch"] < 0.05 and rows[0]["staleness_share_0"] == 1.0
    for r in rows:
        assert sum(r[f"staleness_share_{a}"] for a in range(3)) == pytest.approx(1.0)
        assert "correction_masked_frac" in r and "partial_frac" in r
        assert r["sync_wait_sec"] >= 0  # --tp 1: each sync sent behind the next step's passes


def test_moe_streaming(tmp_path):
    from common.run.embedded import build_tokenizer
    from tests.gpu import test_moe_gpu as moe

    model = tmp_path / "qwen3moe"
    moe.write_model(str(model), "Qwen3MoeForCausalLM", moe.MODEL)
    build_tokenizer().save_pretrained(model)
    flags = [*FLAGS, "--model", model, "--steps", "2", "--rollout-gpus", "1", "--off-policy-steps", "1"]
    flags += ["--partial-chunk-tokens", "8", "--rollout-eager", "--save-every", "0"]
    rows, _ = run_script("train_grpo.py", tmp_path / "run", *flags, ranks=2, timeout=300)
    show("moe streaming", rows)
    assert len(rows) == 2 and rows[0]["logprob_mismatch"] < 0.05 and rows[0]["staleness_share_0"] == 1.0
