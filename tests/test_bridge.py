"""Unit tests of common/model/bridge.py and the single-process paths of common/model/gpt.py.

    .venv/bin/python -m pytest -q tests/test_bridge.py

Config validation (every unsupported case is a clear error naming the field), the
TP shard/unshard functions (round trip at TP=1,2,4), pipeline stage splits (pipeline_layout,
against megatron-core's own layer placement and validation), llama3 rope scaling (the mcore model
with scaling matches transformers; without it, it does not), and checkpoint-reading errors.
"""

import json
import os

import pytest
import torch
import transformers

from common.model import bridge
from common.model.bridge import parse_hf_config
from common.model.unsupported import UnsupportedModelError
from tests.tiny_models import ARCH_CONFIGS, make_tiny_hf_model, save_tiny_hf_model

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config_dict(name):
    return make_tiny_hf_model(name).config.to_dict()


@pytest.mark.parametrize("name", list(ARCH_CONFIGS))
def test_parse_supported(name):
    spec = parse_hf_config(config_dict(name))
    arch, kwargs = ARCH_CONFIGS[name]
    assert spec.architecture == arch
    assert spec.tie_word_embeddings == kwargs["tie_word_embeddings"]
    assert spec.head_dim == kwargs.get("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    assert spec.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert spec.qk_norm == (arch == "Qwen3ForCausalLM")
    assert spec.rope_scaling_factor == (32.0 if name == "llama" else None)


def test_parse_transformers4_style_rope():
    cfg = config_dict("llama")
    del cfg["rope_parameters"]
    cfg.update(rope_theta=500000.0, rope_scaling=LLAMA3)
    spec = parse_hf_config(cfg)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 1e6},  # transformers 4
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 1e6},  # both: 1e4
        {"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5, "rope_scaling": LLAMA3},
    ],
)
def test_rope_theta_read_as_transformers_reads_it(rope):
    """A config.json with both the transformers-4 and -5 rope keys (one written by setting config.rope_theta
    on a transformers-5 config): the theta and scaling transformers itself builds the model with."""
    cfg = config_dict("llama")
    cfg.pop("rope_parameters")
    cfg.update(rope, max_position_embeddings=16384)
    spec = parse_hf_config(cfg)
    expected = transformers.LlamaConfig.from_dict(cfg).rope_parameters
    assert spec.rope_theta == expected["rope_theta"]
    assert spec.rope_scaling_factor == (8.0 if expected["rope_type"] == "llama3" else None)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "rope_theta": 1e4,
                }
            },
            "low_freq_factor",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_parse_rejects(change, field):
    cfg = config_dict("llama")
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=field) as err:
        parse_hf_config(cfg)
    assert "supported" in str(err.value)


def test_sliding_window_rejected_only_when_in_use():
    qwen = config_dict("qwen2")
    qwen.update(use_sliding_window=True, sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        parse_hf_config(qwen)
    qwen.update(use_sliding_window=False)  # Qwen2 configs carry a window they do not use
    parse_hf_config(qwen)
    mistral = config_dict("mistral")
    mistral.update(sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        parse_hf_config(mistral)
    mistral.update(sliding_window=mistral["max_position_embeddings"])  # never reached: full attention
    parse_hf_config(mistral)


def test_parallel_layout_errors():
    spec = parse_hf_config(config_dict("qwen2"))  # 2 kv heads, 4 layers
    with pytest.raises(ValueError, match="num_key_value_heads"):
        bridge.check_parallel_layout(spec, tp=4)
    bridge.check_parallel_layout(spec, pp=3)  # uneven stages: 2 + 1 + 1
    with pytest.raises(ValueError, match="num_hidden_layers=4 cannot be split over --pp 5"):
        bridge.check_parallel_layout(spec, pp=5)
    with pytest.raises(ValueError, match="--last-stage-layers 4"):
        bridge.check_parallel_layout(spec, pp=2, last_stage_layers=4)


# --- pipeline stages: bridge.pipeline_layout against megatron's own layer placement --------
def megatron_placement(num_layers, pp, vpp, fields):
    """(global layer indices in pipeline order, layers of each pipeline rank) as megatron-core
    places them (transformer_layer.get_transformer_layer_offset and
    transformer_block.get_num_layers_to_build) for a TransformerConfig with these fields,
    after megatron's own validation. Pipeline order: virtual stage 0 of every rank, then 1, ..."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        **fields,
    )
    order, per_rank = [], [0] * pp
    for vp_stage in range(vpp or 1):
        for rank in range(pp):
            where = dict(vp_stage=vp_stage if vpp else None, pp_rank=rank)
            count = get_num_layers_to_build(config, **where)
            offset = get_transformer_layer_offset(config, **where)
            order += range(offset, offset + count)
            per_rank[rank] += count
    return order, per_rank


@pytest.mark.parametrize(
    "num_layers, pp, vpp, asked, stages",
    [
        (4, 2, None, {}, None),
        (8, 2, 2, {}, None),
        (6, 3, None, {}, None),  # even: megatron's default split
        (3, 2, None, {}, [2, 1]),
        (5, 2, None, {}, [3, 2]),
        (5, 3, None, {}, [2, 2, 1]),
        (7, 4, None, {}, [2, 2, 2, 1]),
        (9, 4, None, {}, [2, 3, 3, 1]),
        (6, 2, 2, {}, [4, 2]),
        (10, 4, 2, {}, [4, 2, 2, 2]),
        (5, 2, None, dict(first=1), [1, 4]),
        (5, 2, None, dict(last=1), [4, 1]),
        (4, 2, None, dict(first=1), [1, 3]),
        (5, 3, None, dict(first=1, last=2), [1, 2, 2]),
        (7, 3, None, dict(last=1), [3, 3, 1]),
        (8, 3, 2, dict(first=2), [2, 4, 2]),
    ],
)
def test_pipeline_layout(num_layers, pp, vpp, asked, stages):
    """The automatic split (the busiest stage smallest, then the last stage) and the asked-for
    one, as megatron builds them: every layer once, in order, on the expected stages."""
    fields = bridge.pipeline_layout(num_layers, pp, vpp, **asked)
    assert (fields == {}) == (stages is None)
    order, per_rank = megatron_placement(num_layers, pp, vpp, fields)
    assert order == list(range(num_layers))
    assert per_rank == (stages or [num_layers // pp] * pp)


def test_pipeline_layout_finds_every_split_megatron_can_build():
    """For 1-12 layers on 2-4 stages (x vpp 2, 3): a split whenever megatron accepts some first/last
    stage sizes that place every layer once, in order; never one that it does not; the automatic
    one gives the last stage (output layer and loss) no more layers than any other stage."""
    for num_layers in range(1, 13):
        for pp in (2, 3, 4):
            for vpp in (None, 2, 3):
                try:
                    fields = bridge.pipeline_layout(num_layers, pp, vpp)
                except ValueError:
                    fields = None
                if fields is not None:
                    order, per_rank = megatron_placement(num_layers, pp, vpp, fields)
                    assert order == list(range(num_layers)), (num_layers, pp, vpp, fields)
                    assert per_rank[-1] == min(per_rank), (num_layers, pp, vpp, per_rank)
                    continue
                for first in range(1, num_layers + 1):
                    for last in range(1, num_layers + 1):
                        try:  # (with pp=2 and vpp megatron's offset divides by zero middle stages: first only)
                            asked = dict(
                                num_layers_in_first_pipeline_stage=first,
                                **(dict(num_layers_in_last_pipeline_stage=last) if pp > 2 or not vpp else {}),
                            )
                            order, _ = megatron_placement(num_layers, pp, vpp, asked)
                        except (ValueError, AssertionError):
                            continue
                        assert order != list(range(num_layers)), (num_layers, pp, vpp, first, last)


@pytest.mark.parametrize(
    "num_layers, pp, vpp, asked, says",
    [
        (
            3,
            2,
            2,
            {},
            (
                "num_hidden_layers=3 cannot be split over --pp 2 x --vpp 2: fewer layers than (virtual) pipeline "
                "stages (4)"
            ),
        ),
        (5, 2, 2, {}, "every stage needs a positive multiple of --vpp 2 layers"),
        (4, 1, None, dict(first=2), "they need --pp > 1"),
        (4, 2, None, dict(first=0), "over --pp 2 with --first-stage-layers 0: every stage needs >= 1 layer"),
        (6, 2, 2, dict(last=1), "with --last-stage-layers 1: every stage needs a positive multiple of --vpp 2 layers"),
        (
            5,
            2,
            None,
            dict(first=2, last=2),
            "over --pp 2 with --first-stage-layers 2 and --last-stage-layers 2: every stage",
        ),
        (5, 3, None, dict(first=3, last=2), "every stage needs >= 1 layer, the 1 middle stage(s) equal shares"),
        (6, 4, None, dict(first=1, last=2), "every stage needs >= 1 layer, the 2 middle stage(s) equal shares"),
    ],
)
def test_pipeline_layout_errors(num_layers, pp, vpp, asked, says):
    with pytest.raises(ValueError) as err:
        bridge.pipeline_layout(num_layers, pp, vpp, **asked)
    assert says in str(err.value)


def test_transformer_config_carries_the_split():
    spec = parse_hf_config(dict(config_dict("llama"), num_hidden_layers=3))
    assert bridge.transformer_config(spec, pp=2).num_layers_in_first_pipeline_stage == 2
    assert bridge.transformer_config(spec, pp=2, first_stage_layers=1).num_layers_in_first_pipeline_stage == 1
    assert bridge.transformer_config(spec).num_layers_in_first_pipeline_stage is None


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_round_trip(name, tp):
    """shard_from_hf then hf_from_shards gives back every HF tensor exactly, and the shards
    have the shapes megatron expects."""
    model = make_tiny_hf_model(name)
    spec = parse_hf_config(model.config.to_dict())
    state = model.state_dict()

    def read(hf_name, row_slice=None, col_slice=None):
        t = state[hf_name]
        t = t[row_slice] if row_slice is not None else t
        return t[:, col_slice] if col_slice is not None else t

    rebuilt = {}
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += ["output_layer.weight"] if not spec.tie_word_embeddings else []
    layer = [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]
    layer += ["self_attention.linear_qkv.bias"] if spec.qkv_bias else []
    layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"] if spec.qk_norm else []
    names += [f"decoder.layers.{i}.{s}" for i in range(spec.num_layers) for s in layer]
    for mcore_name in names:
        kind, hf_names = bridge.param_rule(mcore_name, spec)
        shards = [bridge.shard_from_hf(kind, hf_names, read, spec, r, tp) for r in range(tp)]
        if kind == "vocab":
            assert shards[0].shape[0] * tp == bridge.padded_vocab_size(spec.vocab_size, tp)
        rebuilt.update(bridge.hf_from_shards(kind, hf_names, shards, spec))
    assert sorted(rebuilt) == sorted(bridge.expected_hf_names(spec))
    for hf_name, tensor in rebuilt.items():
        assert torch.equal(tensor, state[hf_name]), hf_name


def test_llama3_rope_scaling_matters(tmp_path):
    """The llama3-scaled model matches transformers; the same weights with unscaled rope do
    not, so the scaling is really exercised by the parity tests."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from common.run.dist import init_distributed

    init_distributed()
    hf = save_tiny_hf_model("llama", str(tmp_path))
    ids = torch.randint(0, 300, (1, 2048), generator=torch.Generator().manual_seed(0))  # long: low frequencies matter
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    spec = load_hf_spec(str(tmp_path))

    def max_diff(spec):
        model = build_model(spec)[0]
        load_hf_weights([model], spec, str(tmp_path))
        with torch.no_grad():
            logits = model(ids, torch.arange(2048).unsqueeze(0), None)[..., : spec.vocab_size]
        return (logits - reference).abs().max().item()

    assert max_diff(spec) <= 1e-4
    spec.rope_scaling_factor = None
    assert max_diff(spec) > 10 * 1e-4


def test_reader_errors(tmp_path):
    from common.model.gpt import load_hf_spec
    from common.model.weights_load import HFCheckpointReader

    save_tiny_hf_model("qwen3", str(tmp_path / "sharded"), max_shard_size="20KB")
    spec = load_hf_spec(str(tmp_path / "sharded"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    os.remove(tmp_path / "sharded" / victim)
    reader = HFCheckpointReader(str(tmp_path / "sharded"), spec)
    with pytest.raises(FileNotFoundError, match=victim):
        reader.read("model.layers.1.mlp.up_proj.weight")

    save_tiny_hf_model("qwen2", str(tmp_path / "single"))
    path = tmp_path / "single" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with pytest.raises(OSError, match="model.safetensors"):
        HFCheckpointReader(str(tmp_path / "single"), None)

    save_tiny_hf_model("qwen2", str(tmp_path / "mismatch"))
    cfg = json.loads((tmp_path / "mismatch" / "config.json").read_text())
    cfg["intermediate_size"] = 128  # weights have 96
    spec = parse_hf_config(cfg)
    reader = HFCheckpointReader(str(tmp_path / "mismatch"), spec)
    with pytest.raises(UnsupportedModelError, match=r"mlp.gate_proj.weight.*\[96, 64\].*\[128, 64\]"):
        reader.read("model.layers.0.mlp.gate_proj.weight")
