"""GPU: Qwen3.5 (gated delta nets + gated full attention) through train_grpo.py on the vLLM engine.

    python -m pytest -q -s tests/gpu/test_qwen35_gpu.py     (GPU machine, stack of shared/device)

vLLM 0.26 serves Qwen3.5 as released, the vision-language architectures (its registry has no text-only
Qwen3_5ForCausalLM), so the model here is a vision-language checkpoint as released, dense and MoE: a random
Qwen3.5 (hidden 512, 4 layers of which 3 gated delta nets, head size 128 with a quarter rotated; the MLP 1024
wide, or in the MoE 16 experts of 256, top-4, a shared expert) with a one-block vision tower, bf16, the
embedded byte-level tokenizer. The trainer takes its language model (common/model/bridge_vl.py); vLLM starts
with dummy weights and language_model_only, and every tensor of the language model comes through the sync
under model.language_model.*. Two GRPO steps, every sample's engine logprobs requested, a reward that varies
within each group on random text (the task's reward is 0 for every sample of a random model: no gradient,
weights that never move). Checked: the run trains (grad norm > 0), and the engine agrees with the trainer
(logprob_mismatch <= 0.05 at both steps: the second after a sync of updated weights); the MoE variant replays
vLLM's routes (--routing-replay rollout), and the trainer's own top-k agrees with vLLM's on most (token, layer)
pairs at the sampling weights (route_mismatch_update < 0.25 at step 0: bf16 flips a few). Results:
$OUT/qwen35_dense.json and $OUT/qwen35_moe.json. vLLM's Qwen3.5 module imports compressed-tensors (a vLLM
requirement, installed with it by pip; an offline stack without it needs the wheels of compressed-tensors
0.17.0 and loguru carried and installed beside it).
"""

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import kept, run_script, save_results  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
TEXT = dict(
    vocab_size=320,
    hidden_size=512,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
)
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512)
VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=512)
ARGS = [
    "--steps", "2", "--prompts-per-step", "16", "--samples-per-prompt", "4", "--max-new-tokens", "64",
    "--rollout", "vllm", "--rollout-logprobs", "all", "--save-every", "0", "--eval-every", "0", "--lr", "1e-5",
]  # fmt: skip
KEEP = ("logprob_mismatch", "grad_norm", "sync_s", "rollout_s", "step_s", "mem_rollout_gb", "mem_train_gb")
ROUTES = ("route_mismatch", "route_mismatch_update")


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, tmp_path_factory):
    """A random vision-language Qwen3.5 (dense or MoE): embeddings std 1, the LM head 0.1, the other matrices
    0.035, routers 0.1 (routing decided by the input), norms their init (0 where the model adds 1) + 0.1 noise.
    -> (variant, directory)."""
    import transformers

    from common.run.embedded import build_tokenizer

    variant = request.param
    out = tmp_path_factory.mktemp(f"qwen35{variant}-vl")
    if variant == "moe":
        config = transformers.Qwen3_5MoeConfig(text_config=TEXT | MOE, vision_config=VISION, tie_word_embeddings=False)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        text = TEXT | dict(intermediate_size=1024)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=False)
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in f".{name}" or name.endswith(("A_log", "dt_bias")):
                continue  # the vision tower is never run; the decay and step biases keep transformers' init
            if "norm" in name:  # the gated delta net's output norm multiplies by its weight (init 1)
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = (
                    0.1
                    if name == "lm_head.weight" or name.endswith(("mlp.gate.weight", "expert_gate.weight"))
                    else 0.035
                )
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=256, eos_token_id=257).save_pretrained(out)
    return variant, str(out)


REWARD = """
def reward(response, answer):  # varies within a group on random text: non-zero advantages, weights that move
    return sum(map(ord, response)) % 7 / 7
"""


def test_grpo_on_vllm(model, tmp_path):
    from common.model.gdn_kernels import fla_unavailable

    variant, directory = model
    kernel = "torch" if fla_unavailable() else "fla"  # fla's fused kernels where they train, passed by the flag
    reward_file = tmp_path.parent / f"{tmp_path.name}_reward.py"  # beside --out: a file in it would look like a run
    reward_file.write_text(REWARD)
    reward = ["--reward", f"{reward_file}:reward"]
    replay = ["--routing-replay", "rollout"] if variant == "moe" else []
    flags = [*ARGS, *reward, *replay, "--gdn-kernel", kernel]
    rows, output = run_script("train_grpo.py", tmp_path, "--model", directory, *flags, timeout=500)
    steps = kept([r for r in rows if "logprob_mismatch" in r], KEEP + ROUTES)
    print("RESULT", variant, kernel, steps, flush=True)
    save_results(f"qwen35_{variant}.json", {f"qwen3_5_{variant}_vl": steps, "gdn_kernel": kernel})
    assert f"gated delta nets: the {kernel} recurrence" in output, output[-3000:]
    assert len(steps) == 2, rows
    for r in steps:
        assert 0 < r["grad_norm"] < math.inf and r["logprob_mismatch"] <= 0.05, steps
    if replay:
        assert steps[0]["route_mismatch_update"] < 0.25, steps
