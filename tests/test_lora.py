"""common/model/lora.py: LoRA adapters on megatron's tensor-parallel linears (worker: tests/lora_worker.py).

.venv/bin/python -m pytest -x -q tests/test_lora.py
"""

import json

import pytest
import torch

from common.model import lora
from common.model import sizes as S
from common.model.gpt import load_hf_spec
from tests.conftest import run_torchrun


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tests.tiny_models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("lora") / "qwen2"
    save_tiny_hf_model("qwen2", str(path))
    return path


# r x (in + out) per adapted linear of tests/tiny_models.py's qwen2 at r = 4, by hand: qkv 4 x (64 + 128),
# proj 4 x (64 + 64), fc1 4 x (64 + 192), fc2 4 x (96 + 64): 2944 per layer, 4 layers
ADAPTERS = 4 * 2944


def test_b0_is_the_base_and_gradients_are_the_chain_rule(qwen2_dir, tmp_path):
    """B = 0: the logits equal the base model's bit for bit (and with the adapters disabled, too); the
    adapters' gradients equal autograd through an explicit fp32 W + s B A (dB = s dW A^T, dA = s B^T dW);
    only adapters train; with bf16 weights the optimizer holds fp32 grads, main params and two moments
    of the adapters alone: 16 bytes per adapter parameter, nothing for the frozen base."""
    out = tmp_path / "r.json"
    run_torchrun("tests/lora_worker.py", 1, qwen2_dir, "--mode", "grads", "--out", out)
    r = json.loads(out.read_text())
    print(r)
    assert r["adapted"] == 16  # qkv, proj, fc1, fc2 of 4 layers
    assert r["b0_equal"] and r["disabled_equal"] and r["trainable_only_adapters"]
    assert r["grad_tensors"] == 32 and r["grad_max_rel_err"] < 1e-5
    assert r["merged_logits_err"] < 1e-5
    n = ADAPTERS
    assert r["adapter_numel"] == n  # and the memory plan's count (common/model/sizes.py)
    spec = load_hf_spec(qwen2_dir)
    assert S.count_lora_parameters(spec, range(4), rank=4, targets=("attention", "mlp")) == n
    assert r["lora"] == dict(grad=4 * n, main=4 * n, moments=8 * n)  # no padding at this size
    assert r["full"]["main"] == 4 * r["model_numel"] and r["full"]["moments"] == 8 * r["model_numel"]
    assert r["full"]["grad"] >= 4 * r["model_numel"]  # (megatron pads its buffer)


def test_tp2_equals_tp1(qwen2_dir, tmp_path):
    """Two Adam steps on the adapters at TP=1 (DP=2), TP=2 and TP=2 with sequence parallelism: the same
    gradient norms, logits and merged export (fp32 rounding apart); B = 0 is the base at each layout."""
    layouts = {"tp1": [], "tp2": ["--tp", "2"], "tp2sp": ["--tp", "2", "--sp"]}
    out = tmp_path / "r.json"
    run_torchrun("tests/lora_worker.py", 2, qwen2_dir, "--layouts", json.dumps(layouts), "--out", out)
    r = json.loads(out.read_text())
    saved = {name: torch.load(tmp_path / f"tp{2 if 'tp2' in name else 1}-sp{name == 'tp2sp'}.pt") for name in layouts}
    one = saved["tp1"]
    assert (one["after"] - one["base"]).abs().max() > 0.1  # the steps changed the model
    for name in layouts:
        print(name, r[name])
        assert r[name]["b0_equal"]
        assert r[name]["grad_norms"] == pytest.approx(r["tp1"]["grad_norms"], rel=1e-5)
        assert (saved[name]["after"] - one["after"]).abs().max() < 1e-5
        assert saved[name]["exported"].keys() == one["exported"].keys()
        for key, tensor in one["exported"].items():
            assert (saved[name]["exported"][key] - tensor).abs().max() < 1e-5, key


def test_targets_are_checked():
    assert lora.parse_targets("attention, mlp") == ("attention", "mlp")
    assert lora.parse_targets("mlp") == ("mlp",)
    with pytest.raises(ValueError, match="comma-separated subset"):
        lora.parse_targets("attn")
    with pytest.raises(ValueError, match="routed experts"):
        lora.parse_targets("attention,experts")
    assert lora.is_adapter("decoder.layers.0.mlp.linear_fc1.lora_a") and not lora.is_adapter("x.weight")
