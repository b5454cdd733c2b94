"""common/training.py: setup_training's optimizer (torch's fused AdamW in megatron's wrapper)
steps as Adam written out by hand from the same gradients (worker: tests/batch_worker.py adam).

    .venv/bin/python -m pytest -q tests/test_training.py
"""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT


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
