"""common/training.py: setup_training's optimizer (torch's fused AdamW in megatron's wrapper)
steps as Adam written out by hand from the same gradients (worker: tests/batch_worker.py adam).

    .venv/bin/python -m pytest -q tests/test_training.py
"""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, run_batch_worker


def test_train_step_is_adamw_by_hand(tmp_path):
    """Two optimizer steps of setup_training's (fused) AdamW equal the formula applied here to
    the same gradients, and the gradient norm it reports (common/training.py's foreach norm,
    not megatron's fallback) equals the one computed here."""
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model("qwen2", str(tmp_path / "qwen2"))
    proc = subprocess.run([sys.executable, "tests/batch_worker.py", str(tmp_path / "qwen2"), "adam"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(r)
    assert r["fused"]
    assert r["max_err"] < 1e-6  # the step itself is lr = 1e-2 per element
    assert r["optimizer"] == "ForeachNormOptimizer"
    assert r["grad_norm_rel_err"] < 1e-6


def test_fused_wgrad_accumulation_equals_megatrons(tmp_path):
    """Weight gradients accumulated inside the GEMM (common/training.py, with
    common/cpu_compat.py's stand-in for apex's kernel) equal megatron's own path over three
    micro-batches: every parameter's main_grad, with untied and tied embeddings (the tied
    weight gets the LM head's gradient in the GEMM and the embedding's through DDP's hook), and
    an MoE model's grouped experts (their gradients added per layer, common/moe.py)."""
    names = ("qwen2", "qwen2_tied", "qwen3_moe")
    for name, r in zip(names, run_batch_worker(tmp_path, "wgrad", names)):
        print(name, r)
        assert r["float32"]["tied"] == (name == "qwen2_tied")
        assert r["float32"]["layers"] >= 4 * 2 + 1  # qkv, proj, fc1, fc2 per layer (2 layers) + the LM head
        assert r["float32"]["max_rel_err"] < 1e-6, r  # a doubled or a lost gradient would be >= 1
        # bf16: megatron's path rounds each micro-batch's gradient to bf16 first, the fused one does not
        assert r["bfloat16"]["max_rel_err"] < 1e-2, r
        if name == "qwen3_moe":  # grouped experts: the same bf16 gradient cast and added, per layer: equal bits
            for dtype in ("float32", "bfloat16"):
                assert r[dtype]["expert_params"] >= 8 * 2 * 2, r  # 8 experts x fc1/fc2 in >= 2 MoE layers
                assert r[dtype]["experts_nonzero"] == r[dtype]["expert_params"], r  # every expert got tokens
                assert r[dtype]["experts_max_abs_diff"] == 0.0, r
