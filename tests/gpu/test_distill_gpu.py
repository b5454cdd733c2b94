"""On-policy distillation on a GPU with the colocated vLLM engine: a Qwen2.5-1.5B-shaped student and a
Qwen2.5-7B-shaped teacher (4.9x its parameters; 152064 embedding rows against the student's 151936 for
the same tokenizer: padding only), random weights, both scripts, no task reward.

    python -m pytest -q -s tests/gpu/test_distill_gpu.py     (GPU machine, stack of shared/device)

Checked: exit 0; distill_reverse_kl finite and teacher_s > 0 every step; the engine and the trainer agree
(logprob_mismatch); printed: the phase times (teacher_s against old_logprob_s / ref_s / train_s) and the
peak GPU memory per phase (mem_*_gb) against the memory plan's start-up summary.
"""

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import run_script  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

COMMON = ["--steps", "3", "--prompts-per-step", "16", "--samples-per-prompt", "4", "--max-new-tokens", "64"]
COMMON += ["--rule-reward-weight", "0", "--eval-every", "0", "--lr", "1e-6"]


def random_model(path, shape, seed):
    """An HF dir of a Qwen2 of this shape with the embedded byte-level tokenizer, random bf16 weights made
    on the GPU (a 7B in fp32 from the CPU would take minutes and 30 GB of disk)."""
    import transformers

    from common.run.embedded import write_embedded_model

    write_embedded_model(str(path))  # the tokenizer, chat template and generation config
    os.remove(path / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(path)
    from tests.gpu.make_random_model import FULL_VOCAB, SHAPES  # Qwen2 shapes, vocabulary rows and tying

    for key, value in dict(SHAPES[shape], **FULL_VOCAB[shape], max_position_embeddings=4096).items():
        setattr(config, key, value)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}  # Qwen2.5's (not config.rope_theta)
    config.layer_types = ["full_attention"] * config.num_hidden_layers  # the embedded config's list has 2
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return random_model(root / "student", "1.5b", 0), random_model(root / "teacher", "7b", 1)


def train(script, out, student, teacher):
    rows, output = run_script(script, out, *COMMON, "--model", student, "--teacher", teacher, timeout=540)
    steps = [r for r in rows if "distill_reverse_kl" in r]
    assert len(steps) == 3, rows
    for r in steps:
        assert math.isfinite(r["distill_reverse_kl"]) and r["teacher_s"] > 0 and r["reward_mean"] == 0
    phases = ["rollout_s", "old_logprob_s", "ref_s", "teacher_s", "values_s", "train_s", "step_s"]
    memory = sorted(k for k in steps[-1] if k.startswith("mem_"))
    print(f"{script}: distill_reverse_kl {[round(r['distill_reverse_kl'], 3) for r in steps]}")
    print(f"{script}: last step " + ", ".join(f"{k} {steps[-1][k]:.2f}" for k in phases + memory if k in steps[-1]))
    plan = [line for line in output.splitlines() if "GB per GPU" in line or line.startswith("teacher weights")]
    print(f"{script}: plan: " + " | ".join(plan))
    return steps


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_distill_from_a_larger_teacher(models, script, tmp_path):
    steps = train(script, tmp_path, *models)
    mismatch = [r["logprob_mismatch"] for r in steps if "logprob_mismatch" in r]
    assert mismatch and max(mismatch) < 0.05, mismatch  # the engine samples the trainer's weights
