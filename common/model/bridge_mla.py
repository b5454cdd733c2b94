"""The multi-latent attention (MLA) half of the bridge: DeepSeek-V3 and its relatives
(Moonlight, Kimi-K2, DeepSeek-V3-architecture research models).

Pure functions, like common/model/bridge.py (which calls these for the rows of its table whose
attention is "mla"):
  parse_mla(cfg)              config.json -> MLASpec, or UnsupportedModelError
  mla_config_fields(mla)      the MLATransformerConfig fields of the attention
  mla_param_rule(rest, L)     megatron attention parameter -> (kind, HF names)
  mla_hf_names / mla_hf_shape what the HF checkpoint holds, for checks and export

MLA (megatron-core 0.16.1 MLASelfAttention, local spec) against transformers'
DeepseekV3Attention, checked in tests/test_deepseek.py:
  q      with q LoRA: q_b_proj(q_a_layernorm(q_a_proj(x)))   (linear_q_down_proj, q_layernorm,
         linear_q_up_proj); without (q_lora_rank null, the small variants): q_proj(x) (linear_q_proj)
  kv     kv_a_proj_with_mqa(x) = [latent (kv_lora_rank); shared rope key (qk_rope_head_dim)] rows
         (linear_kv_down_proj), kv_a_layernorm on the latent (kv_layernorm), kv_b_proj = per head
         [k_nope; v] rows (linear_kv_up_proj)
  out    o_proj (linear_proj)
Per-head row blocks split over TP by heads, so the up-projections are plain "column" shards.
The local spec's down-projections are ColumnParallelLinear too: at TP > 1 each rank holds
a row slice and megatron all-gathers their output, so they are "column" shards as well.
RoPE: HF's rope_interleave=True (every released checkpoint) is megatron's MLA rotation (it
de-interleaves x[0::2], x[1::2]); the softmax scale is 1/sqrt(nope + rope) times YaRN's
mscale(factor, mscale_all_dim)^2 in both. megatron applies the rotation itself, so the core
attention (common/model/attention.py) gets rotated q and k.
"""

from dataclasses import dataclass


@dataclass
class MLASpec:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: dict  # MLATransformerConfig rope fields (rope_type "rope" or "yarn", ...)

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _unsupported(field_name, value, supported):
    from common.model.unsupported import UnsupportedModelError

    return UnsupportedModelError(
        f"config.json field {field_name!r} = {value!r} is not supported by the "
        f"HF<->Megatron bridge; supported: {supported}"
    )


# YaRN fields: HF rope_scaling key -> (MLATransformerConfig field, HF default when absent)
_YARN = {
    "factor": ("rotary_scaling_factor", None),
    "original_max_position_embeddings": ("original_max_position_embeddings", None),
    "beta_fast": ("beta_fast", 32.0),
    "beta_slow": ("beta_slow", 1.0),
    "mscale": ("mscale", 1.0),
    "mscale_all_dim": ("mscale_all_dim", 0.0),
}


def parse_mla(cfg: dict, rope_type: str, rope: dict | None) -> MLASpec:
    """The attention part of a DeepSeek-V3-style config.json."""
    if cfg.get("rope_interleave", True) is not True:
        raise _unsupported(
            "rope_interleave",
            cfg["rope_interleave"],
            "true (megatron's MLA rotates interleaved pairs, as every released checkpoint does)",
        )
    if rope_type == "default":
        fields = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    elif rope_type == "yarn":
        fields = dict(rope_type="yarn")
        rope = dict(rope)
        if rope.get("factor") is None and rope.get("original_max_position_embeddings"):  # as transformers does
            rope["factor"] = int(cfg["max_position_embeddings"]) / int(rope["original_max_position_embeddings"])
        for key, (name, default) in _YARN.items():
            value = rope.get(key) if rope.get(key) is not None else default
            if value is None:
                raise _unsupported(f"rope_scaling.{key}", None, "a number (YaRN needs it)")
            fields[name] = float(value) if name != "original_max_position_embeddings" else int(value)
        if not fields["mscale_all_dim"] and fields["mscale"] != 1.0:  # transformers then ignores mscale
            raise _unsupported("rope_scaling.mscale", fields["mscale"], "1.0 when mscale_all_dim is 0 or absent")
        if rope.get("truncate", True) is not True:  # megatron rounds the correction range like HF's default
            raise _unsupported("rope_scaling.truncate", rope["truncate"], "true")
        if rope.get("attention_factor") is not None:
            raise _unsupported(
                "rope_scaling.attention_factor",
                rope["attention_factor"],
                "null (megatron derives it from mscale and mscale_all_dim)",
            )
    else:
        raise _unsupported("rope_scaling.rope_type", rope_type, "'default' or 'yarn' for DeepseekV3ForCausalLM")
    q_lora = cfg.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope=fields,
    )


def mla_config_fields(mla: MLASpec, rope_theta: float):
    """MLATransformerConfig keyword arguments of the attention (megatron-core 0.16.1 names)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,  # builds q_layernorm (with q LoRA) and kv_layernorm: HF has both
        rotary_base=rope_theta,
        **mla.rope,
    )


def check_mla_layout(mla: MLASpec, tp):
    """The down-projections are split by rows over TP (see the module docstring)."""
    if mla.q_lora_rank and mla.q_lora_rank % tp:
        raise ValueError(f"--tp {tp} must divide q_lora_rank={mla.q_lora_rank}")
    rows = mla.kv_lora_rank + mla.qk_rope_head_dim
    if rows % tp:
        raise ValueError(f"--tp {tp} must divide kv_lora_rank + qk_rope_head_dim = {rows}")


_RULES = {  # megatron name (after decoder.layers.L.) -> (kind, HF names after model.layers.L.self_attn.)
    "self_attention.linear_q_proj.weight": ("column", ["q_proj.weight"]),
    "self_attention.linear_q_down_proj.weight": ("column", ["q_a_proj.weight"]),
    "self_attention.q_layernorm.weight": ("replicated", ["q_a_layernorm.weight"]),
    "self_attention.linear_q_up_proj.weight": ("column", ["q_b_proj.weight"]),
    "self_attention.linear_kv_down_proj.weight": ("column", ["kv_a_proj_with_mqa.weight"]),
    "self_attention.kv_layernorm.weight": ("replicated", ["kv_a_layernorm.weight"]),
    "self_attention.linear_kv_up_proj.weight": ("column", ["kv_b_proj.weight"]),
    "self_attention.linear_proj.weight": ("row", ["o_proj.weight"]),
}


def mla_param_rule(rest, layer):
    """(kind, HF names) for the part `rest` of a megatron layer parameter name, or None when it
    is not an attention parameter."""
    rule = _RULES.get(rest)
    if rule is None:
        return None
    kind, names = rule
    return kind, [f"model.layers.{layer}.self_attn.{n}" for n in names]


def mla_hf_names(mla: MLASpec):
    """The attention tensor names of one layer, after `model.layers.L.`."""
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if mla.q_lora_rank else ["q_proj"]
    return [f"self_attn.{n}.weight" for n in q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]]


def mla_hf_shape(suffix, hidden, heads, mla: MLASpec):
    """Shape of an attention tensor from the name's part after `model.layers.L.`, or None."""
    q_rows = heads * mla.qk_head_dim
    return {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.q_a_proj.weight": (mla.q_lora_rank, hidden),
        "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
        "self_attn.q_b_proj.weight": (q_rows, mla.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
        "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim),
    }.get(suffix)
