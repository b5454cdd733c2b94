"""Qwen3.5 (gated delta nets mixed with gated full attention) in the bridge.

    .venv/bin/python -m pytest -x -q tests/test_qwen35.py

The tiny Qwen3.5 of tests/tiny_models.py (GDN_CONFIGS "qwen3_5": layers linear, full, linear,
full; 2 key heads shared by 4 value heads; partial RoPE; zero-centred norms) against transformers
(fp32): the recurrence alone against transformers' token-by-token one, including restarts at
packed samples; the whole model's logits at TP=1, TP=2, TP=2+SP and PP=2 on uneven stages (3
layers: linear + full on the first stage, linear on the second), the export back to HF names
bit-identical, and a deliberately wrong mapping (k/v swapped in the gated attention) far off; every
tensor's gradient at TP=2+SP against one rank's (tests/gdn_grad_worker.py);
packed passes equal to padded ones (tests/packing_worker.py); convert_hf_to_mcore.py --verify and
merge_to_hf.py round trips. Qwen3.5-MoE (GDN_CONFIGS "qwen3_5_moe", 3 layers) in the same parity
launches, with EP=2; the vision-language checkpoints (dense and MoE, experts per expert and fused)
read as their text model, and converted (--verify at EP=2) and merged back as the text CausalLM;
GRPO learning the embedded task with the embedded tiny Qwen3.5-MoE.
"""

import shutil

import pytest
import torch

from tests.conftest import LayoutLaunches, embedded_grpo_run, run_script, run_torchrun
from tests.tiny_models import GDN_CONFIGS, make_tiny_hf_model, save_tiny_hf_model


def _config(moe=False, **changes):
    arch, kwargs = GDN_CONFIGS["qwen3_5_moe" if moe else "qwen3_5"]
    return dict(kwargs, architectures=[arch], **changes)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    """qwen3_5 (4 layers) and qwen3_5_3layers (linear, full, linear: PP=2 stages of 2 + 1)."""
    root = tmp_path_factory.mktemp("qwen35")
    save_tiny_hf_model("qwen3_5", str(root / "qwen3_5"))
    save_tiny_hf_model("qwen3_5", str(root / "qwen3_5_3layers"), layers=3)
    return root


@pytest.fixture(scope="module")
def qwen35_moe_dir(tmp_path_factory):
    """qwen3_5_moe: the MoE variant, 3 layers (linear, full, linear)."""
    root = tmp_path_factory.mktemp("qwen35_moe")
    save_tiny_hf_model("qwen3_5_moe", str(root / "qwen3_5_moe"), layers=3)
    return root


def test_the_config_maps_to_megatron():
    from common.model.bridge import gpt_model_kwargs, parse_hf_config, transformer_config

    spec = parse_hf_config(_config())
    assert spec.gdn.linear_layers == [True, False, True, False]
    assert (spec.gdn.key_dim, spec.gdn.value_dim, spec.gdn.conv_dim, spec.gdn.rotary_fraction) == (32, 32, 96, 0.25)
    assert transformer_config(spec).attention_output_gate and spec.qk_norm
    assert gpt_model_kwargs(spec)["rotary_percent"] == 0.25
    # without layer_types: every full_attention_interval-th layer is full attention, as transformers does
    kwargs = {k: v for k, v in _config(num_hidden_layers=8).items() if k != "layer_types"}
    assert parse_hf_config(kwargs).gdn.linear_layers == [True, True, True, False] * 2


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(attn_output_gate=False), "attn_output_gate"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unrepresentable_configs_are_refused(changes, message):
    from common.model.bridge import parse_hf_config
    from common.model.unsupported import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**changes))


def test_tensor_parallel_must_divide_the_delta_net_heads_and_cp_is_refused():
    from common.model.bridge import check_parallel_layout, parse_hf_config, transformer_config

    spec = parse_hf_config(_config(linear_num_key_heads=1, linear_num_value_heads=4))
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        check_parallel_layout(spec, tp=2)
    with pytest.raises(ValueError, match="context parallelism"):
        transformer_config(spec, cp=2)


def test_the_recurrence_kernel_on_a_cpu(tmp_path):
    """--gdn-kernel: torch runs here; fla (CUDA-only Triton kernels) is refused by train_grpo.py in one line
    before anything is built. The fused kernel's own test is on a GPU (tests/gpu/test_gdn_kernel_gpu.py)."""
    from common.model.gdn_kernels import resolve_gdn_kernel

    assert resolve_gdn_kernel() == resolve_gdn_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="choose one of"):
        resolve_gdn_kernel("triton")
    proc = run_script(
        "train_grpo.py", "--embedded-model", "qwen3_5", "--gdn-kernel", "fla", "--out", tmp_path, check=False
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "--gdn-kernel fla: fla runs on CUDA GPUs only" in err[-1], proc.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_chunked_recurrence_equals_transformers_token_by_token():
    """common/model/gdn.py's chunked gated delta rule against transformers' recurrent form (a loop
    over tokens), chunks of 64, 16 and 7 over 150 tokens; and packed: two samples run separately
    are not the same as one run over both (the state must restart)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from common.model.gdn import chunk_gated_delta_rule, l2norm

    torch.manual_seed(0)
    b, s, h, dk, dv = 2, 150, 3, 16, 8
    q, k = l2norm(torch.randn(b, s, h, dk)), l2norm(torch.randn(b, s, h, dk))
    v, g, beta = torch.randn(b, s, h, dv), -torch.rand(b, s, h) * 2, torch.rand(b, s, h)
    reference, _ = torch_recurrent_gated_delta_rule(q, k, v, g, beta)
    for chunk in (64, 16, 7):
        err = (chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk) - reference).abs().max().item()
        print(f"chunk {chunk}: max |diff| {err:.1e}")  # measured 3.1e-7, 2.1e-7, 6.0e-8
        assert err < 1e-5
    second, _ = torch_recurrent_gated_delta_rule(*(x[:, 100:] for x in (q, k, v, g, beta)))
    assert (second - reference[:, 100:]).abs().max() > 1e-2  # the state carried over matters


# the MoE variant joins the layouts it runs in (megatron's MoE layers need SP with TP), and has EP=2 alone
MOE = ["--model", "{moe}"]
PARITY_LAYOUTS = {
    "tp1": (1, MOE),
    "tp2": (2, ["--tp", 2]),
    "tp2_sp": (2, ["--tp", 2, "--sp", *MOE]),
    "pp2": (2, ["--pp", 2, *MOE]),
    "ep2": (2, ["--ep", 2, "--models-dir", "{moe_only}"]),
}


@pytest.fixture(scope="module")
def parity(qwen35_dir, qwen35_moe_dir, tmp_path_factory):
    paths = dict(moe=qwen35_moe_dir / "qwen3_5_moe", moe_only=qwen35_moe_dir)
    layouts = {k: (n, [str(f).format(**paths) for f in flags]) for k, (n, flags) in PARITY_LAYOUTS.items()}
    base = ["--models-dir", qwen35_dir]
    return LayoutLaunches("tests/parity_worker.py", layouts, base, tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("layout", list(PARITY_LAYOUTS))
def test_logits_match_transformers(layout, parity):
    from common.model.bridge import parse_hf_config
    from common.model.sizes import count_parameters

    results = parity[layout]
    expected = {"ep2": ["qwen3_5_moe"], "tp2": ["qwen3_5", "qwen3_5_3layers"]}
    assert sorted(results) == expected.get(layout, ["qwen3_5", "qwen3_5_3layers", "qwen3_5_moe"])
    for name, ranks in results.items():
        for rank, row in enumerate(ranks):
            where = f"{name} {layout} rank {rank}"
            print(f"{where}: max_abs_diff={row['max_abs_diff']:.2e} kv_swapped={row['control_kv_swapped']:.2e}")
            assert row["max_abs_diff"] <= 1e-5, where
            assert row["control_kv_swapped"] > 1e-3, where
            assert row["export_missing"] == row["export_extra"] == row["export_mismatch"] == [], where
            assert row["pieces_mismatch"] == [] and row["blocks_mismatch"] == [], where
            if name == "qwen3_5_moe":  # two experts exchanged; the routers' statistics equal transformers'
                assert row["control_experts_swapped"] > 1e-3, where
                for case, (ours, theirs) in row["routing_statistics"].items():
                    assert all(abs(ours[k] - v) <= 1e-5 * abs(v) for k, v in theirs.items()), f"{where} {case}"
                assert row["expert_blocks"] > 0, where
            if layout in ("tp1", "tp2", "tp2_sp", "ep2") and rank == 0:  # the memory plan's parameter count
                tp, ep = (2 if layout.startswith("tp2") else 1), (2 if layout == "ep2" else 1)
                n = len(row["layers"])
                config = _config(moe=name.endswith("moe"), num_hidden_layers=n)
                spec = parse_hf_config(dict(config, layer_types=config["layer_types"][:n]))
                counted = count_parameters(spec, row["layers"], tp=tp, ep=ep)
                assert counted.total == row["param_count"], where
        if layout == "pp2" and name != "qwen3_5":  # (the MoE model has 3 layers too)
            assert [r["layers"] for r in ranks] == [[0, 1], [2]]  # linear + full | linear
            assert all(r["control_shifted_layers"] > 1e-3 for r in ranks)


def test_gradients_at_tp2_sp_equal_one_rank(qwen35_dir, tmp_path):
    """Every HF tensor's gradient (tests/gdn_grad_worker.py) at TP=2+SP equals one rank's: the
    delta net's TP-split conv, dt_bias and A_log, and its gated norm's weight, which serves each
    rank's heads and is summed over TP once (a second, sequence-parallel sum doubled it)."""
    hf = qwen35_dir / "qwen3_5"
    run_torchrun("tests/gdn_grad_worker.py", 1, "--hf", hf, "--out", tmp_path / "tp1.pt")
    run_torchrun("tests/gdn_grad_worker.py", 2, "--hf", hf, "--tp", 2, "--sp", "--out", tmp_path / "tp2.pt")
    one, two = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert sorted(one) == sorted(two)
    # each tensor's difference against its own largest gradient (+1e-6: the fp32 noise of tiny ones)
    worst = max((one[n] - two[n]).abs().max().item() / (one[n].abs().max().item() + 1e-6) for n in one)
    print(f"largest relative gradient difference {worst:.1e}")  # measured 7.8e-5; the norm summed twice: 1.0
    assert worst < 1e-3


def test_packed_passes_equal_padded_ones(qwen35_dir, tmp_path):
    """tests/packing_worker.py: 24 samples packed into rows of 64 tokens (the conv and the
    recurrence restart at every sample) against padded micro-batches: logprobs and the gradient
    of a loss; the control (each packed row scored as one sequence) differs."""
    import json

    out = tmp_path / "packing.json"
    run_script("tests/packing_worker.py", "--models-dir", qwen35_dir, "--models", "qwen3_5", "--out", out)
    r = json.loads(out.read_text())["qwen3_5"]
    print(r)
    assert r["logprob_diff"] <= 1e-5 and r["control_diff"] > 1e-2
    assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_max"])


def test_convert_verify_and_merge_round_trip(qwen35_dir, tmp_path):
    """convert_hf_to_mcore.py --verify (the checkpoint loads at TP=2 and gives transformers' logits)
    and merge_to_hf.py: the merged safetensors equal the original bit for bit."""
    from tests.test_convert import hf_tensors

    hf_dir = qwen35_dir / "qwen3_5"
    run_torchrun(
        "convert_hf_to_mcore.py",
        2,
        "--hf",
        hf_dir,
        "--out",
        tmp_path / "ckpt",
        "--dtype",
        "fp32",
        "--tp",
        2,
        "--verify",
    )
    run_script("merge_to_hf.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--dtype", "fp32")
    original, merged = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(merged)
    assert all(torch.equal(original[n], merged[n]) for n in original)


def test_vision_language_checkpoints_read_as_their_text_model(qwen35_dir, qwen35_moe_dir, tmp_path):
    """The vision-language checkpoints (tests/tiny_models.py save_tiny_vl_model: transformers'
    ForConditionalGeneration saved, + an mtp.* tensor), dense and MoE, the MoE one with per-expert
    and with fused (released) expert tensors: both readers (the trainer's HFCheckpointReader,
    convert_hf_to_mcore.py's SafetensorsDir) give every tensor of the text model bit for bit, as the
    text CausalLM's own save_pretrained holds it, whole and as row slices; the vision tower and MTP
    head are named in one notice (a text checkpoint's MTP head too); a config.json without text_config is refused
    with one line."""
    from safetensors.torch import save_file

    from common.model.bridge import expected_hf_names, parse_hf_config
    from common.model.gpt import load_hf_spec
    from common.model.unsupported import UnsupportedModelError
    from common.model.weights_load import HFCheckpointReader
    from common.run.convert_io import SafetensorsDir
    from tests.test_convert import hf_tensors
    from tests.tiny_models import save_tiny_vl_model

    cases = [("qwen3_5", None, False), ("qwen3_5_moe", 3, False), ("qwen3_5_moe", 3, True)]
    for name, layers, fused in cases:
        vl_dir = tmp_path / f"{name}_{fused}"
        save_tiny_vl_model(name, str(vl_dir), layers=layers, fused_experts=fused)
        text = hf_tensors((qwen35_moe_dir if layers else qwen35_dir) / name)  # the same weights, text layout
        spec = load_hf_spec(vl_dir)
        assert spec.vision_language and spec.architecture == parse_hf_config(_config(moe=bool(layers))).architecture
        assert sorted(expected_hf_names(spec)) == sorted(text)
        reader, files = HFCheckpointReader(vl_dir, spec), SafetensorsDir(vl_dir)
        assert "model.visual.*" in reader.notice and "mtp.*" in files.as_text_model(spec)
        for read in (reader.read, files.read):
            for n, t in text.items():
                assert torch.equal(read(n), t), (name, fused, n)
                if t.dim() == 2 and t.shape[0] > 3:
                    assert torch.equal(read(n, row_slice=slice(1, 3)), t[1:3]), (name, fused, n)
    # a text checkpoint holding the MTP block: read as the text model, the block named in the notice
    text_dir = tmp_path / "text_mtp"
    text_dir.mkdir()
    shutil.copy(qwen35_dir / "qwen3_5" / "config.json", text_dir)
    tensors = hf_tensors(qwen35_dir / "qwen3_5")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(4, 8)}, str(text_dir / "model.safetensors"))
    spec = load_hf_spec(text_dir)
    assert HFCheckpointReader(qwen35_dir / "qwen3_5", spec).notice is None
    reader = HFCheckpointReader(text_dir, spec)
    assert reader.notice.startswith("note: the multi-token-prediction head (mtp.*) is not loaded")
    assert all(torch.equal(reader.read(n), t) for n, t in tensors.items())
    with pytest.raises(UnsupportedModelError, match="text_config"):
        parse_hf_config({"architectures": ["Qwen3_5MoeForConditionalGeneration"]})


@pytest.mark.parametrize("name", list(GDN_CONFIGS))
def test_a_text_config_wrapped_as_the_vision_language_one(name):
    """vision_language_config (how a text Qwen3.5 starts vLLM 0.26): transformers reads the wrapped
    config.json as the vision-language model with the same text fields, and the bridge reads the same
    language model from it as from the text config."""
    import dataclasses

    import transformers

    from common.model.bridge import parse_hf_config
    from common.model.bridge_vl import vision_language_config

    text = make_tiny_hf_model(name).config.to_dict()
    wrapped = vision_language_config(text)
    vl_class = getattr(transformers, wrapped["architectures"][0].replace("ForConditionalGeneration", "Config"))
    read = vl_class.from_dict(wrapped)
    expected = dict(transformers.AutoConfig.for_model(**text).to_dict(), architectures=None)  # the wrapper's
    assert read.text_config.to_dict() == expected
    assert read.vision_config.out_hidden_size == text["hidden_size"]
    mine, theirs = parse_hf_config(text), parse_hf_config(wrapped)
    differ = {f.name for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)}
    assert differ == {"vision_language"} and theirs.vision_language  # hf_config too: the text fields back
    assert vision_language_config(make_tiny_hf_model("qwen3").config.to_dict()) is None  # other models: as they are


def test_vision_language_moe_convert_verify_at_ep2_and_merge(qwen35_moe_dir, tmp_path):
    """convert_hf_to_mcore.py --verify at EP=2 from the MoE vision-language checkpoint with fused
    experts (transformers' logits), then merge_to_hf.py: the text model as a Qwen3_5MoeForCausalLM
    checkpoint, bit for bit what the text model's save_pretrained holds, its config.json saying no MTP layers
    (the source's mtp.* are not written); with --vision-from the source, the
    vision-language checkpoint, every parameter of transformers' model equal to the source's (a text
    checkpoint as --vision-from refused)."""
    import json
    import re

    import transformers

    from tests.test_convert import hf_tensors
    from tests.tiny_models import save_tiny_vl_model

    vl_dir = tmp_path / "vl"
    save_tiny_vl_model("qwen3_5_moe", str(vl_dir), layers=3, fused_experts=True)
    source_config = json.loads((vl_dir / "config.json").read_text())
    source_config["text_config"]["mtp_num_hidden_layers"] = 1  # as released: one MTP layer (mtp.*), not trained
    (vl_dir / "config.json").write_text(json.dumps(source_config))
    args = ["--hf", vl_dir, "--out", tmp_path / "ckpt", "--dtype", "fp32", "--ep", 2, "--verify"]
    convert = run_torchrun("convert_hf_to_mcore.py", 2, *args)
    output = convert.stdout + convert.stderr
    assert "the vision tower (model.visual.*)" in output
    assert float(re.search(r"max_abs_diff=(\S+)", output)[1]) <= 1e-5  # (the script's own bound: 1e-4)
    out = run_script("merge_to_hf.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--dtype", "fp32").stdout
    assert "1 multi-token-prediction layer(s) (mtp.*)" in out
    original, merged = hf_tensors(qwen35_moe_dir / "qwen3_5_moe"), hf_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(merged)
    assert all(torch.equal(original[n], merged[n]) for n in original)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and "text_config" not in config
    assert config["mtp_num_hidden_layers"] == 0  # the MTP tensors are not written: the config says none
    # --vision-from: the vision-language checkpoint again, which transformers loads as the source's model
    merge = ["merge_to_hf.py", "--ckpt", tmp_path / "ckpt", "--dtype", "fp32", "--vision-from"]
    out = run_script(*merge, vl_dir, "--out", tmp_path / "hf_vl").stdout
    assert "the vision tower (" in out and "copied from" in out and out.count("multi-token-prediction") == 1
    source, merged = (
        transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(d).state_dict()
        for d in (vl_dir, tmp_path / "hf_vl")
    )
    assert sorted(source) == sorted(merged) and all(torch.equal(source[n], merged[n]) for n in source)
    config = json.loads((tmp_path / "hf_vl" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "vision_config" in config
    assert config["text_config"]["mtp_num_hidden_layers"] == 0
    refused = run_script(*merge, qwen35_moe_dir / "qwen3_5_moe", "--out", tmp_path / "no", check=False)
    assert refused.returncode == 2 and "is not a vision-language checkpoint" in refused.stdout + refused.stderr


def test_grpo_learns_with_the_embedded_qwen35_moe(tmp_path):
    """train_grpo.py --embedded-model qwen3_5_moe (the Qwen3.5 layers of --embedded-model qwen3_5, each
    with an MoE MLP: one run covers both): the embedded task is being learned (measured: reward 0.007
    over the first 10 steps, 0.29 over the last 10), and the trainer's logprobs equal the CPU
    engine's (transformers)."""
    rows = embedded_grpo_run("qwen3_5_moe", 30, tmp_path)
    reward = [m["reward_mean"] for m in rows]
    assert rows[0]["logprob_mismatch"] < 1e-5 and "moe_load_max" in rows[0]
    assert sum(reward[-10:]) / 10 >= sum(reward[:10]) / 10 + 0.1
