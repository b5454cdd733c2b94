"""HF <-> Megatron-Core parity at every parallel layout, against transformers.

    .venv/bin/python -m pytest -q tests/test_model_parity.py

For each layout, tests/parity_worker.py runs under torchrun (gloo; the layouts of one process
count share a launch, conftest.LayoutLaunches) over every tiny model
of tests/tiny_models.py (Llama with llama3 rope + tied embeddings, Qwen2 tied and untied,
Qwen3 with q/k norm and head_dim != hidden/heads, Mistral; Qwen3 as a sharded checkpoint):
  - fp32 logits of the sharded megatron model vs transformers: max |diff| <= 1e-4;
  - export back to HF names: every tensor bit-identical, nothing missing or extra;
  - two deliberately wrong mappings (k/v swapped; fc1 as a plain chunk of [gate; up] at
    TP>1) are far above the tolerance, so the comparison can fail.
The PP=2 and PP=2 x VPP=2 launches add a model whose layers do not divide by the stages
(megatron's uneven stages, common/model/bridge.py:pipeline_layout): each rank holds the layers the
automatic split assigns it, the logits match, and the same layers loaded one layer off (as an
even split's offset would) do not.
build_model's GPTModel returns its logits as a view (no transposing copy) holding exactly
megatron's own forward's values.
"""

import pytest

from tests.conftest import LayoutLaunches

TOLERANCE = 1e-4
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tp", 2]),
    "tp2_sp": (2, ["--tp", 2, "--sp"]),
    "pp2": (2, ["--pp", 2]),
    "pp2_vpp2": (2, ["--pp", 2, "--vpp", 2]),
    "tp2_pp2": (4, ["--tp", 2, "--pp", 2]),
}
# the uneven model of a launch (tests/conftest.py:uneven_models_dir) and the global layers of each pipeline
# rank, in megatron's order: interleaved, virtual stage 0 of every rank first ([0, 1], [2], [3, 4], [5])
UNEVEN = {"pp2": ("llama_3layers", [[0, 1], [2]]), "pp2_vpp2": ("qwen2_6layers", [[0, 1, 3, 4], [2, 5]])}


@pytest.fixture(scope="module")
def parity(tiny_models_dir, uneven_models_dir, tmp_path_factory):
    layouts = {
        name: (nproc, flags + (["--model", uneven_models_dir / UNEVEN[name][0]] if name in UNEVEN else []))
        for name, (nproc, flags) in LAYOUTS.items()
    }
    return LayoutLaunches(
        "tests/parity_worker.py", layouts, ["--models-dir", tiny_models_dir], tmp_path_factory.mktemp("parity")
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity(layout, parity, tiny_models_dir, uneven_models_dir):
    nproc, flags = LAYOUTS[layout]
    uneven, placement = UNEVEN.get(layout, (None, None))
    results = parity[layout]
    for name, ranks in results.items():  # the memory plan's arithmetic against what megatron built
        check_memory_plan(name, ranks, flags, (uneven_models_dir if name == uneven else tiny_models_dir) / name)
    assert sorted(results) == sorted(
        ["llama", "mistral", "qwen2", "qwen2_tied", "qwen3"] + ([uneven] if uneven else [])
    )
    for name, ranks in results.items():
        assert len(ranks) == nproc
        for rank, row in enumerate(ranks):
            where = f"{name} {layout} rank {rank}"
            print(
                f"{where}: max_abs_diff={row['max_abs_diff']:.2e}",
                *(f"{k}={v:.2e}" for k, v in row.items() if k.startswith("control")),
            )
            assert row["max_abs_diff"] <= TOLERANCE, where
            assert row["export_missing"] == [] and row["export_extra"] == [], where
            assert row["export_mismatch"] == [], where
            # each rank's own TP pieces (export_hf_weights(local_reads=)): boxes of the HF tensors
            assert row["pieces_mismatch"] == [], where
            assert (row["pieces"] > 0) == ("--tp" in flags and "--pp" not in flags), where
            assert row["blocks_mismatch"] == [] and row["expert_blocks"] == 0, where  # dense: nothing to stack
            assert row["control_kv_swapped"] > 100 * TOLERANCE, where
            if "--tp" in flags:
                assert row["control_naive_fc1"] > 100 * TOLERANCE, where
            if name == uneven:
                assert row["layers"] == placement[rank], where
                assert row["control_shifted_layers"] > 100 * TOLERANCE, where


def check_memory_plan(name, ranks, flags, hf_dir):
    """The memory plan's arithmetic (common/model/sizes.py) at this layout: each rank's decoder
    layers and parameter count exactly as megatron built them, and (without a pipeline) the
    activation bytes its forward saved within 10% of the formula (fp32 on a CPU)."""
    from common.model import sizes as S
    from common.model.gpt import load_hf_spec

    spec = load_hf_spec(hf_dir)
    size = {f: flags[flags.index(f) + 1] if f in flags else 1 for f in ("--tp", "--pp")}
    tp, pp = size["--tp"], size["--pp"]
    vpp, sp = (2 if "--vpp" in flags else None), "--sp" in flags
    stages = S.stage_layer_indices(spec.num_layers, pp, vpp)
    for rank, row in enumerate(ranks):
        where, stage = f"{name} rank {rank}", row["pp_rank"]
        assert row["layers"] == stages[stage], where
        count = S.count_parameters(
            spec, stages[stage], tp=tp, first_stage=stage == 0, last_stage=stage == pp - 1, pp=pp
        )
        assert row["param_count"] == count.total, where
        if "saved_bytes_per_token" in row:
            seq = tp if sp and tp > 1 else 1
            saved, _ = S.stage_activation_bytes(spec, stages[stage], tp=tp, sp=sp, dtype_bytes=4, device="cpu")
            saved += (3 * spec.hidden_size * 4 + 4) / seq + 8  # the final norm, the output layer's input, the ids
            print(f"{where}: saved {row['saved_bytes_per_token']:.0f} B/token, plan {saved:.0f}")
            assert abs(saved / row["saved_bytes_per_token"] - 1) < 0.1, where


def test_logits_are_a_view_of_megatrons_values(tiny_models_dir):
    """common/model/gpt.py's GPTModel gives the (B, T, V) logits as a view of the output layer's
    (T, B, V) tensor; megatron's own forward (the base class's) copies them into (B, T, V)
    memory. Same numbers, bit for bit, and no copy."""
    import torch
    from megatron.core.models.gpt import GPTModel

    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import destroy_distributed, init_distributed

    hf_dir = str(tiny_models_dir / "qwen2")
    init_distributed()
    try:
        spec = load_hf_spec(hf_dir)
        (model,) = build_model(spec)
        load_hf_weights([model], spec, hf_dir)
        tokens = torch.randint(0, spec.vocab_size, (3, 11))
        positions = torch.arange(11).expand(3, 11)
        with torch.no_grad():
            ours = model(tokens, positions, None)
            megatrons = GPTModel.forward(model, tokens, positions, None)
    finally:
        destroy_distributed()
    assert ours.shape == megatrons.shape == (3, 11, model.output_layer.weight.shape[0])
    assert megatrons.is_contiguous() and ours.transpose(0, 1).is_contiguous()  # (T, B, V) memory
    assert torch.equal(ours, megatrons)
