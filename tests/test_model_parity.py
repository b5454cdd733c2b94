"""HF <-> Megatron-Core parity at every parallel layout, against transformers.

    .venv/bin/python -m pytest -q tests/test_model_parity.py

For each layout, tests/parity_worker.py runs under torchrun (gloo) over every tiny model
of tests/tiny_models.py (Llama with llama3 rope + tied embeddings, Qwen2 tied and untied,
Qwen3 with q/k norm and head_dim != hidden/heads, Mistral; Qwen3 as a sharded checkpoint):
  - fp32 logits of the sharded megatron model vs transformers: max |diff| <= 1e-4;
  - export back to HF names: every tensor bit-identical, nothing missing or extra;
  - two deliberately wrong mappings (k/v swapped; fc1 as a plain chunk of [gate; up] at
    TP>1) are far above the tolerance, so the comparison can fail.
"""
import json

import pytest

from tests.conftest import run_torchrun

TOLERANCE = 1e-4
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tp", 2]),
    "tp2_sp": (2, ["--tp", 2, "--sp"]),
    "pp2": (2, ["--pp", 2]),
    "pp2_vpp2": (2, ["--pp", 2, "--vpp", 2]),
    "tp2_pp2": (4, ["--tp", 2, "--pp", 2]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity(layout, tiny_models_dir, tmp_path):
    nproc, flags = LAYOUTS[layout]
    out = tmp_path / "result.json"
    run_torchrun("tests/parity_worker.py", nproc, "--models-dir", tiny_models_dir, *flags, "--out", out)
    results = json.loads(out.read_text())
    assert sorted(results) == ["llama", "mistral", "qwen2", "qwen2_tied", "qwen3"]
    for name, ranks in results.items():
        assert len(ranks) == nproc
        for rank, row in enumerate(ranks):
            where = f"{name} {layout} rank {rank}"
            print(f"{where}: max_abs_diff={row['max_abs_diff']:.2e}")
            assert row["max_abs_diff"] <= TOLERANCE, where
            assert row["export_missing"] == [] and row["export_extra"] == [], where
            assert row["export_mismatch"] == [], where
            assert row["control_kv_swapped"] > 100 * TOLERANCE, where
            if "--tp" in flags:
                assert row["control_naive_fc1"] > 100 * TOLERANCE, where
