"""Model FLOPs and the step throughput metrics (common/model/flops.py) against hand counts.

.venv/bin/python -m pytest -q tests/test_flops.py
"""

import types

import pytest
import torch

from common.model.flops import forward_flops_per_token, peak_tflops, step_throughput


def tiny_spec():
    return types.SimpleNamespace(
        num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, ffn_hidden_size=64, num_layers=2, vocab_size=100
    )


def test_forward_flops_per_token_by_hand():
    # per layer: q 32x32, k and v 32x16 each, o 32x32, gate+up+down 3 x 32x64 -> 1024+1024+1024+6144 = 9216
    # weights: 2 layers * 9216 + LM head 100*32 = 21632; 2 FLOPs each -> 43264
    # attention at T=10: 2 matmuls * 2 FLOPs * 2 layers * 10 * (4*8) = 2560 full, 1280 causal
    assert forward_flops_per_token(tiny_spec(), 10, causal=False) == 43264 + 2560
    assert forward_flops_per_token(tiny_spec(), 10) == 43264 + 1280


def test_moe_flops_count_active_weights_by_hand():
    # layer 0 MoE: router 32x8 = 256, top-2 experts of 3 x 32x16 = 2 x 1536, shared 3 x 32x24 = 2304
    # -> 256 + 3072 + 2304 = 5632 instead of the dense 6144; layer 1 dense. Weights: 21632 - 6144 + 5632
    from common.model.bridge_moe import MoESpec

    moe = MoESpec(
        num_experts=8,
        topk=2,
        ffn_hidden_size=16,
        moe_layers=[True, False],
        normalize_topk=True,
        shared_expert_size=24,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        layout="qwen",
    )
    spec = types.SimpleNamespace(**vars(tiny_spec()), moe=moe)
    assert forward_flops_per_token(spec, 10) == 2 * (21632 - 6144 + 5632) + 1280


def test_step_throughput_by_hand(monkeypatch):
    samples = [
        types.SimpleNamespace(prompt_ids=[1] * 6, response_ids=[2] * 4),  # 10 tokens, 4 generated
        types.SimpleNamespace(prompt_ids=[1] * 2, response_ids=[2] * 8),
    ]  # 10 tokens, 8 generated
    times = {"rollout_s": 0.5, "old_logprob_s": 0.25, "ref_s": 0.25, "train_s": 1.5, "save_s": 9.0, "step_s": 12.5}
    cpu = step_throughput(tiny_spec(), samples, times, forward_passes=5, world_size=2, device=torch.device("cpu"))
    assert cpu == {  # no MFU on a CPU
        "tokens": 20,
        "response_tokens": 12,
        "step_tokens_per_s_per_gpu": 20 / 12.5 / 2,  # the whole step's seconds
        "gen_tokens_per_s": 12 / 0.5,
        "train_tokens_per_s_per_gpu": 20 / 2.0 / 2,  # the trainer's passes only
    }
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = step_throughput(
        tiny_spec(), samples, times, forward_passes=5, world_size=2, device=types.SimpleNamespace(type="cuda")
    )
    flops = 5 * 20 * (43264 + 1280)  # 5 passes over 20 tokens of 10-token sequences
    assert gpu["train_mfu"] == pytest.approx(flops / 2.0 / (2 * 989e12), rel=1e-12)
    untimed = step_throughput(tiny_spec(), samples, {}, forward_passes=5, world_size=1, device=torch.device("cpu"))
    assert untimed == {"tokens": 20, "response_tokens": 12}  # no rates without seconds


def test_peak_tflops_names():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A10") is None
