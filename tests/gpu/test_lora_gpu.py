"""GPU: LoRA (--lora-rank, common/model/lora.py) through train_grpo.py on the vLLM engine, paired with full
fine-tuning on the same GPU kind.

    python -m pytest -q -s tests/gpu/test_lora_gpu.py     (GPU machine, stack of shared/device)

A random-weight model of Qwen2-0.5B's shape with the byte-level tokenizer (tests/gpu/make_random_model.py),
bf16, three GRPO steps each of: full fine-tuning, --lora-rank 16 on one GPU, and (with two GPUs)
--lora-rank 16 at TP=2. Read from metrics.jsonl: logprob_mismatch (|engine - trainer| over the sampled
tokens: the engine samples with the merged weights W + s B A, so LoRA's must be as small as full
fine-tuning's), sync_s, train_s, step_s and the memory phases (mem_*_gb). Checked: every run trains
(finite), LoRA's mismatch is within 2x full fine-tuning's (+ 0.005), and LoRA's update phase takes less
GPU memory than full fine-tuning's (no fp32 master, no Adam state, no gradients for the base, no reference
copy). Results (the paired step times and memory, for docs/lora.md): $OUT/lora.json.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import kept, run_script, save_results  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ARGS = [
    "--steps", "3", "--prompts-per-step", "32", "--samples-per-prompt", "8", "--max-new-tokens", "128",
    "--rollout-logprobs", "all", "--save-every", "0", "--eval-every", "0", "--lr", "1e-5",
]  # fmt: skip
KEEP = ("logprob_mismatch", "kl", "grad_norm", "sync_s", "train_s", "step_s", "mem_train_gb", "mem_logprob_gb")
RESULTS = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2-0.5b-shape")
    subprocess.run(
        [sys.executable, "tests/gpu/make_random_model.py", str(out), "--shape", "0.5b"], cwd=ROOT, check=True
    )
    return str(out)


def train(model, out, ranks, *extra):
    rows, _ = run_script("train_grpo.py", out, "--model", model, *ARGS, *extra, ranks=ranks, timeout=500)
    return kept(rows, KEEP)


def test_lora_against_full_fine_tuning(model, tmp_path):
    runs = {"full": train(model, tmp_path / "full", 1), "lora": train(model, tmp_path / "lora", 1, "--lora-rank", "16")}
    if torch.cuda.device_count() >= 2:
        runs["lora_tp2"] = train(model, tmp_path / "lora_tp2", 2, "--tp", "2", "--lora-rank", "16")
    RESULTS.update(runs)
    print("RESULT", json.dumps(runs), flush=True)
    save_results("lora.json", RESULTS)
    full_mismatch = max(r["logprob_mismatch"] for r in runs["full"])
    for name in runs:
        assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in runs[name]), name
        if name != "full":
            assert max(r["logprob_mismatch"] for r in runs[name]) <= 2 * full_mismatch + 0.005, (name, runs)
    assert runs["lora"][-1]["mem_train_gb"] < runs["full"][-1]["mem_train_gb"], runs
