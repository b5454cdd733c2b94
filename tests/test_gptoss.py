"""gpt-oss (attention sinks, sliding windows on alternate layers, YaRN, biased experts with a clamped
SwiGLU, MXFP4 expert weights) in the bridge.

    .venv/bin/python -m pytest -x -q tests/test_gptoss.py

The tiny gpt-oss of tests/tiny_models.py (GPTOSS_CONFIGS "gpt_oss": windows of 6 keys on layers 0
and 2, batches of 24 tokens) against transformers (fp32): YaRN's frequencies, the MXFP4
dequantisation bit for bit against transformers' own, one expert's clamped SwiGLU with the clamps
active; the whole model's logits (tests/gptoss_worker.py, one launch) at TP=1 (two data-parallel ranks),
TP=2, TP=2+SP, EP=2 and PP=2 (the experts as grouped GEMMs, and as the per-expert loop), packed rows,
the export bit-identical, the expert weights loaded from MXFP4 blocks, controls (sinks zeroed, windows
off, experts exchanged) far off; the memory plan's parameter count; every gradient at TP=2+SP against
one rank's; convert_hf_to_mcore.py --verify and merge_to_hf.py bit-exact round trips (also from MXFP4);
an MXFP4 --model refused; GRPO learning the embedded task with `--embedded-model gpt_oss`.
"""

import json
import shutil

import pytest
import torch

from tests.conftest import LayoutLaunches, embedded_grpo_run, run_script
from tests.tiny_models import GPTOSS_CONFIGS, save_tiny_hf_model


def _config(**changes):
    arch, kwargs = GPTOSS_CONFIGS["gpt_oss"]
    return dict(kwargs, architectures=[arch], **changes)


def _random_mxfp4(shape, generator):
    """MXFP4 blocks (shape + (16,)) and scales (shape) of weights ~0.01-0.1 (scales 2^-8 .. 2^-5)."""
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(119, 123, shape, dtype=torch.uint8, generator=generator)
    return blocks, scales


@pytest.fixture(scope="module")
def gptoss_dirs(tmp_path_factory):
    """plain/: the tiny gpt-oss with expert weights that MXFP4 holds exactly; mxfp4/: the same model
    as the hub stores it (the expert weights as `_blocks` and `_scales`, quantization_config mxfp4)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gptoss")
    plain, mxfp4 = root / "plain", root / "mxfp4"
    save_tiny_hf_model("gpt_oss", str(plain))
    tensors = load_file(plain / "model.safetensors")
    quantized = dict(tensors)
    g = torch.Generator().manual_seed(3)
    _, kwargs = GPTOSS_CONFIGS["gpt_oss"]
    e, h, f = kwargs["num_local_experts"], kwargs["hidden_size"], kwargs["intermediate_size"]
    for layer in range(kwargs["num_hidden_layers"]):
        for name, rows, cols in (("gate_up_proj", 2 * f, h), ("down_proj", h, f)):
            full = f"model.layers.{layer}.mlp.experts.{name}"
            blocks, scales = _random_mxfp4((e, rows, cols // 32), g)
            tensors[full] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, cols, rows)
            del quantized[full]
            quantized[full + "_blocks"], quantized[full + "_scales"] = blocks, scales
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(plain, mxfp4)
    save_file(quantized, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return root


def test_the_config_maps_to_megatron():
    from common.model.bridge import expected_hf_names, parse_hf_config, transformer_config

    spec = parse_hf_config(_config())
    assert spec.gptoss.window_layers == [True, False, True, False] and spec.gptoss.sliding_window == 6
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size, spec.moe.normalize_topk) == (8, 2, 32, True)
    config = transformer_config(spec)
    assert config.add_bias_linear and config.add_qkv_bias and not config.moe_router_pre_softmax
    names = expected_hf_names(spec)
    assert "model.layers.3.self_attn.sinks" in names and "model.layers.0.mlp.experts.gate_up_proj" in names
    quantized = parse_hf_config(_config(quantization_config={"quant_method": "mxfp4"}))
    assert "model.layers.0.mlp.experts.down_proj_blocks" in expected_hf_names(quantized)
    # FLOPs (MFU): the windowed layers' attention over at most 6 keys, the full layers' over seq/2
    from common.model.flops import forward_flops_per_token

    per_key = 2 * (64 + 64)  # QK^T and (softmax)V per key and layer, 4 heads of 16
    # 100 tokens vs 2: the 2 full layers attend 50 keys instead of 1, the 2 windowed ones 6 instead of 1
    assert forward_flops_per_token(spec, 100) - forward_flops_per_token(spec, 2) == per_key * 2 * (49 + 5)
    # without layer_types: sliding windows on even layers, as transformers' GptOssConfig
    kwargs = {k: v for k, v in _config().items() if k != "layer_types"}
    assert parse_hf_config(kwargs).gptoss.window_layers == [True, False, True, False]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(layer_types=["sliding_attention", "linear_attention"] * 2), "layer_types"),
        (dict(swiglu_limit=8.0), "swiglu_limit"),
        (dict(quantization_config={"quant_method": "fp8"}), "quant_method"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(attention_bias=False), "attention_bias"),
    ],
)
def test_unrepresentable_configs_are_refused(changes, message):
    from common.model.bridge import parse_hf_config
    from common.model.unsupported import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**changes))


def test_context_and_expert_tensor_parallelism_and_other_attention_are_refused():
    from common.model.bridge import parse_hf_config, transformer_config
    from common.model.gpt import layer_spec

    spec = parse_hf_config(_config())
    with pytest.raises(ValueError, match="context-parallel"):
        transformer_config(spec, cp=2)
    with pytest.raises(ValueError, match="--etp 2"):
        transformer_config(spec, etp=2)
    with pytest.raises(ValueError, match="runs on 'sdpa'"):
        layer_spec(spec, "local")


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_equal_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from common.model.bridge import parse_hf_config

    cfg = _config()
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], truncate=truncate)
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**cfg), "cpu")
    ours = parse_hf_config(cfg).gptoss
    assert torch.equal(torch.tensor(ours.inv_freq), theirs) and ours.attention_factor == factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(dtype):
    """Every nibble and every scale exponent of 0..255 against transformers' convert_moe_packed_tensors
    (its (E, in, rows) layout is ours transposed)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from common.model.bridge_gptoss import mxfp4_dequantize

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles through all 16 codes
    scales = torch.randint(0, 256, (3, 40, 2), dtype=torch.uint8, generator=g)
    scales[1].view(-1)[:80] = torch.arange(80, 160, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = mxfp4_dequantize(blocks, scales, dtype)
    assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)


def test_one_expert_with_its_clamps_equals_transformers():
    """One expert of transformers' GptOssExperts (weights large enough that gate and up pass the
    clamp at 7 both ways) against the bridge's megatron tensors through common/model/gptoss.py's
    activation: the de-interleaved [gate; up] rows, the biases, fc2's transpose."""
    import torch.nn.functional as F
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from common.model.bridge_gptoss import ALPHA, LIMIT, gptoss_shard
    from common.model.gptoss import clamped_swiglu

    torch.manual_seed(0)
    experts = GptOssExperts(GptOssConfig(**_config()))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 1.0)
    x = torch.randn(50, 64)
    e = 5
    gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()  # the clamps act
    theirs = experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
    on_disk = {k: v.detach() for k, v in experts.state_dict().items()}

    def read(name, row_slice=None):
        return on_disk[name.split(".")[-1]][row_slice]

    fc1, fc1_bias, fc2, fc2_bias = (
        gptoss_shard(kind, [f"model.layers.0.mlp.experts.{name}#{e}"], read)
        for kind, name in (
            ("gptoss_fc1", "gate_up_proj"),
            ("gptoss_fc1_bias", "gate_up_proj_bias"),
            ("gptoss_fc2", "down_proj"),
            ("gptoss_fc2_bias", "down_proj_bias"),
        )
    )
    ours = F.linear(clamped_swiglu(F.linear(x, fc1, fc1_bias), ALPHA, LIMIT), fc2, fc2_bias)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_sink_attention_and_its_gradients_equal_transformers():
    """common/model/gptoss.py's sink_attention (the sink as one more key of value 0, torch SDPA with a
    window mask) against transformers' eager_attention_forward for gpt-oss (the sink as an extra
    softmax column): outputs, and the gradients of q, k, v and the sinks (which transformers' sees
    only through its softmax)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from common.model.gptoss import sink_attention

    torch.manual_seed(0)
    b, h, s, d, window, scale = 2, 4, 20, 16, 5, 0.3
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, requires_grad=True)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (i - j < window)
    ours = sink_attention(q, k, v, sinks, allowed, scale)  # (b, h, s, d)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=1, training=False)
    additive = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))[None, None]
    theirs = eager_attention_forward(module, q, k, v, additive, scale)[0].transpose(1, 2)
    assert (ours - theirs).abs().max() <= 1e-6
    weights = torch.randn(b, h, s, d)
    grads = [torch.autograd.grad((out * weights).sum(), (q, k, v, sinks)) for out in (ours, theirs)]
    for name, a, c in zip("qkv", grads[0][:3], grads[1][:3]):
        assert (a - c).abs().max() <= 1e-5, name
    assert (grads[0][3] - grads[1][3]).abs().max() <= 1e-5 and grads[1][3].abs().max() > 1e-2  # the sinks


PARITY_LAYOUTS = {
    "tp1": (2, []),  # two data-parallel ranks of one TP=1 model each; also loaded from MXFP4
    "tp2": (2, ["--tp", 2]),
    "tp2_sp": (2, ["--tp", 2, "--sp"]),
    "ep2": (2, ["--ep", 2]),
    "pp2": (2, ["--pp", 2]),
}


@pytest.fixture(scope="module")
def parity(gptoss_dirs, tmp_path_factory):
    layouts = dict(PARITY_LAYOUTS, tp1=(2, ["--mxfp4", gptoss_dirs / "mxfp4"]))
    return LayoutLaunches(
        "tests/gptoss_worker.py", layouts, ["--hf", gptoss_dirs / "plain"], tmp_path_factory.mktemp("parity")
    )


@pytest.mark.parametrize("layout", list(PARITY_LAYOUTS))
def test_logits_match_transformers(layout, parity):
    from common.model.bridge import parse_hf_config
    from common.model.sizes import count_parameters

    for rank, row in enumerate(parity[layout]):
        where = f"{layout} rank {rank}"
        print(where, {k: v for k, v in row.items() if "diff" in k or "control" in k})
        assert row["max_abs_diff"] <= 1e-5, where  # measured 1.5e-7 to 2.7e-7
        assert row.get("packed_max_abs_diff", 0.0) <= 1e-5, where
        assert row.get("mxfp4_max_abs_diff_to_plain", 0.0) <= 1e-5, where
        assert row["experts_grouped"] and row["loop_max_abs_diff"] <= 1e-5, where  # grouped GEMMs, and the loop
        assert row["export_missing"] == row["export_extra"] == row["export_mismatch"] == [], where
        for control in ("control_no_sinks", "control_no_windows", "control_experts_swapped"):
            assert row[control] > 1e-2, (where, control)  # measured 0.24, 0.24, 0.33
        spec = parse_hf_config(_config())
        tp, ep, pp = (
            (2 if layout.startswith("tp2") else 1),
            (2 if layout == "ep2" else 1),
            (2 if layout == "pp2" else 1),
        )
        counted = count_parameters(
            spec, row["layers"], tp=tp, ep=ep, pp=pp, first_stage=rank == 0 or pp == 1, last_stage=rank == 1 or pp == 1
        )
        assert counted.total == row["param_count"], where
    if layout == "tp1":
        assert "packed_max_abs_diff" in row and "mxfp4_max_abs_diff_to_plain" in row
    if layout == "pp2":
        assert [r["layers"] for r in parity[layout]] == [[0, 1], [2, 3]]


def test_gradients_at_tp2_sp_equal_one_rank(gptoss_dirs, tmp_path):
    """Every HF tensor's gradient (tests/gdn_grad_worker.py) at TP=2+SP equals one rank's: the sinks
    split over TP, the router's and o_proj's biases summed over TP under SP, the experts' weights
    and biases summed over the expert-data-parallel ranks (fc2's bias once: megatron tags it
    sequence-parallel too, which counted it twice, relative error 1.0)."""
    from tests.conftest import run_torchrun

    hf = gptoss_dirs / "plain"
    run_torchrun("tests/gdn_grad_worker.py", 1, "--hf", hf, "--out", tmp_path / "tp1.pt")
    run_torchrun("tests/gdn_grad_worker.py", 2, "--hf", hf, "--tp", 2, "--sp", "--out", tmp_path / "tp2.pt")
    one, two = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert sorted(one) == sorted(two)
    worst = max((one[n] - two[n]).abs().max().item() / (one[n].abs().max().item() + 1e-6) for n in one)
    print(f"largest relative gradient difference {worst:.1e}")  # measured 1.8e-6
    assert worst < 1e-3


def test_convert_verify_and_merge_round_trips(gptoss_dirs, tmp_path):
    """convert_hf_to_mcore.py of the plain checkpoint, --verify against transformers at TP=2 (the
    sinks resharded from the TP=1 checkpoint by their sharded_state_dict), and of the MXFP4 one
    (dequantised as it is read; transformers needs accelerate to load MXFP4, so no --verify there);
    then merge_to_hf.py of both: each merged safetensors equals the plain model bit for bit, and
    the MXFP4 one's config.json has no quantization_config left."""
    from tests.conftest import run_scripts, run_torchrun
    from tests.test_convert import hf_tensors

    convert = ["--out", tmp_path / "ckpt_plain", "--dtype", "fp32", "--tp", 2, "--verify"]
    run_torchrun("convert_hf_to_mcore.py", 2, "--hf", gptoss_dirs / "plain", *convert)
    mxfp4 = ["--out", tmp_path / "ckpt_mxfp4", "--dtype", "fp32"]
    run_script("convert_hf_to_mcore.py", "--hf", gptoss_dirs / "mxfp4", *mxfp4)
    run_scripts(
        *(
            ("merge_to_hf.py", "--ckpt", tmp_path / f"ckpt_{n}", "--out", tmp_path / f"hf_{n}", "--dtype", "fp32")
            for n in ("plain", "mxfp4")
        )
    )
    original = hf_tensors(gptoss_dirs / "plain")
    for name in ("plain", "mxfp4"):
        merged = hf_tensors(tmp_path / f"hf_{name}")
        assert sorted(original) == sorted(merged), name
        assert all(torch.equal(original[n], merged[n]) for n in original), name
        assert "quantization_config" not in json.loads((tmp_path / f"hf_{name}" / "config.json").read_text())


def test_an_mxfp4_policy_is_refused_with_the_way_out_and_counted_dequantised(gptoss_dirs):
    """The training scripts' --model check: an MXFP4 checkpoint is refused (the rollout engines would
    build MXFP4 experts the bf16 sync cannot fill) with the commands that write a bf16 copy; the
    memory plan counts its parameters as the dequantised model's."""
    from common.model.gpt import load_hf_spec
    from common.model.sizes import hf_parameter_count
    from common.run.model_checks import check_model_dir
    from common.train.guard import UsageError

    with pytest.raises(UsageError, match="MXFP4 expert weights.*merge_to_hf.py"):
        check_model_dir(str(gptoss_dirs / "mxfp4"), "--model", need_weights=False, need_tokenizer=False)
    plain, mxfp4 = (load_hf_spec(gptoss_dirs / name) for name in ("plain", "mxfp4"))
    assert hf_parameter_count(mxfp4) == hf_parameter_count(plain)


def test_grpo_learns_with_the_embedded_gptoss(tmp_path):
    """train_grpo.py --embedded-model gpt_oss: the embedded task is being learned (measured: reward
    0.005 over the first 10 steps, 0.118 over the last 10), and the trainer's logprobs equal the CPU
    engine's (transformers)."""
    rows = embedded_grpo_run("gpt_oss", 40, tmp_path)
    reward = [m["reward_mean"] for m in rows]
    assert rows[0]["logprob_mismatch"] < 1e-5
    assert sum(reward[-10:]) / 10 >= sum(reward[:10]) / 10 + 0.1
