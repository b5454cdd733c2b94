"""HF <-> Megatron-Core: config mapping and the tensor mapping, as pure functions.

Two halves:
  1. `parse_hf_config(config.json dict) -> HFModelSpec`, then `transformer_config(...)`
     and `gpt_model_kwargs(...)`. A config the bridge cannot represent exactly is a
     `UnsupportedModelError` naming the field, its value and what is supported:
     never a silently different model.
  2. `param_rule(mcore_name, spec) -> (kind, hf_names)` says which HF tensors make a
     megatron parameter and how it is sharded over tensor parallelism; then
     `shard_from_hf` cuts one TP rank's shard out of (lazily read) HF tensors and
     `hf_from_shards` puts the TP shards back together as HF tensors.
No I/O and no collectives here: common/model/weights.py does those.

Layout facts that the kinds encode (checked against transformers in tests/test_bridge*.py):
  qkv      megatron fuses q, k, v *per query group*: rows [q heads of group g; k_g; v_g],
           groups in order; a TP rank owns a contiguous run of groups.
  gate_up  linear_fc1 on TP rank r holds [gate_r; up_r] (not a chunk of [gate; up]).
  column   rows split over TP (none left after qkv/gate_up, kept for completeness).
  row      columns split over TP (o_proj, down_proj).
  vocab    rows split over TP after padding the vocabulary to a multiple of
           128 * tp (padding rows are zero and trimmed again on export).
  replicated  norms: every rank holds the full tensor.
Mixture-of-Experts families (the `experts` column of the table) add the rules of
common/model/bridge_moe.py: routers, per-expert tensors, shared experts. Multi-latent attention
(the `mla` column: DeepSeek-V3) replaces the q/k/v rules by common/model/bridge_mla.py's.
How the layers split over pipeline stages, what TP/EP must divide, and activation recompute:
common/model/bridge_layout.py (its functions are importable from here too). A vision-language
checkpoint (the released Qwen3.5s) is read as its language model: common/model/bridge_vl.py.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model.bridge_gdn import (
    GDNSpec,
    gdn_hf_names,
    gdn_hf_shape,
    gdn_param_rule,
    gdn_shard,
    gdn_unshard,
    parse_gdn,
)
from common.model.bridge_gptoss import KINDS as GPTOSS_KINDS
from common.model.bridge_gptoss import (
    GptOssSpec,
    check_gptoss_layout,
    gptoss_hf_names,
    gptoss_hf_shape,
    gptoss_param_rule,
    gptoss_shard,
    gptoss_unshard,
    parse_gptoss,
)
from common.model.bridge_layout import (  # noqa: F401 (re-exported)
    RECOMPUTE_MODULES,
    check_parallel_layout,
    pipeline_layout,
    recompute_config,
    stage_layers,
)
from common.model.bridge_mla import (
    MLASpec,
    mla_config_fields,
    mla_hf_names,
    mla_hf_shape,
    mla_param_rule,
    parse_mla,
)
from common.model.bridge_moe import MoESpec, moe_config_fields, moe_hf_names, moe_hf_shape, moe_param_rule, parse_moe
from common.model.bridge_vl import VL_ARCHITECTURES, text_config
from common.model.unsupported import UnsupportedModelError

VOCAB_DIVISIBLE_BY = 128  # megatron's default make-vocab-size-divisible-by


# The one table of supported architectures: what each needs beyond the Llama layout.
# experts: the Mixture-of-Experts family (common/model/bridge_moe.py), None for dense models.
# mla: multi-latent attention (common/model/bridge_mla.py) instead of grouped-query attention.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False, experts=None, mla=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False, experts=None, mla=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False, experts=None, mla=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True, experts=None, mla=False),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False, experts="qwen", mla=False),  # + gated shared expert
    "Qwen3MoeForCausalLM": dict(qkv_bias=False, qk_norm=True, experts="qwen", mla=False),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False, experts="mixtral", mla=False),
    "DeepseekV3ForCausalLM": dict(qkv_bias=False, qk_norm=False, experts="deepseek", mla=True),  # + sigmoid routing
    # gdn: gated-delta-net layers mixed with gated full attention (common/model/bridge_gdn.py)
    "Qwen3_5ForCausalLM": dict(qkv_bias=False, qk_norm=True, experts=None, mla=False, gdn=True),
    "Qwen3_5MoeForCausalLM": dict(qkv_bias=False, qk_norm=True, experts="qwen", mla=False, gdn=True),  # + gated shared
    # gptoss: attention sinks, sliding windows on alternate layers, biased experts (common/model/bridge_gptoss.py)
    "GptOssForCausalLM": dict(qkv_bias=True, qk_norm=False, experts=None, mla=False, gptoss=True),
}
GDN_KINDS = ("gdn_in", "gdn_conv", "qkvg")  # shard kinds of common/model/bridge_gdn.py

# megatron-core hard-codes these llama3 rope-scaling constants
# (models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding._apply_scaling);
# Llama-3.1 and 3.2 use exactly these, only `factor` differs (8 vs 32).
MCORE_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@dataclass
class HFModelSpec:
    """What the bridge needs to know about an HF decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None when not scaled
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoESpec | None = None  # Mixture-of-Experts layers (common/model/bridge_moe.py), None when dense
    mla: MLASpec | None = None  # multi-latent attention (common/model/bridge_mla.py), None for q/k/v heads
    gdn: GDNSpec | None = None  # gated-delta-net layers (common/model/bridge_gdn.py), None without
    vision_language: bool = False  # the text model of a vision-language checkpoint (common/model/bridge_vl.py)
    gptoss: GptOssSpec | None = None  # gpt-oss's sinks, windows, YaRN (common/model/bridge_gptoss.py)
    hf_config: dict = field(repr=False, default_factory=dict)

    @property
    def heads_per_group(self):
        return self.num_heads // self.num_kv_heads


def _unsupported(field_name, value, supported):
    return UnsupportedModelError(
        f"config.json field {field_name!r} = {value!r} is not supported by the "
        f"HF<->Megatron bridge; supported: {supported}"
    )


def _rope_parameters(cfg):
    """(rope_theta, rope dict or None) from either transformers-4 style (rope_theta +
    rope_scaling) or transformers-5 style (rope_parameters) config.json, read as transformers 5 reads a
    file that has both: rope_scaling and the top-level rope_theta when rope_scaling is there, else
    rope_parameters (a top-level rope_theta only where rope_parameters has none). A file written by
    setting config.rope_theta on a transformers-5 config has both, and transformers and vLLM use the
    theta inside rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    if scaling:
        return float(cfg.get("rope_theta", params.get("rope_theta", 10000.0))), scaling
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), params


def parse_hf_config(cfg: dict) -> HFModelSpec:
    """Validate an HF config.json dict and turn it into an HFModelSpec.

    Raises UnsupportedModelError for anything the megatron model would get wrong.
    """
    cfg, vision_language = text_config(cfg)  # a vision-language checkpoint: its language model's config
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise _unsupported("architectures", archs, sorted(ARCHITECTURES) + sorted(VL_ARCHITECTURES))
    arch = archs[0]
    quantization = (cfg.get("quantization_config") or {}).get("quant_method")
    mxfp4 = arch == "GptOssForCausalLM" and quantization == "mxfp4"  # dequantised on load (bridge_gptoss.py)
    if quantization and not mxfp4:  # e.g. DeepSeek-V3's released fp8 blocks with weight_scale_inv
        raise UnsupportedModelError(
            f"config.json has quantization_config (quant_method {quantization!r}): the bridge reads bf16/fp16/fp32 "
            "weights only. Dequantize the checkpoint first (for DeepSeek-V3's fp8: DeepSeek's "
            "inference/fp8_cast_bf16.py) and remove quantization_config from config.json."
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", cfg["hidden_act"], "'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        # Qwen2's q/k/v bias is part of the architecture (not this flag); a Llama with
        # o_proj/MLP biases would need megatron's add_bias_linear for every linear.
        biased = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM")
        if cfg.get(flag) and not (arch in biased and flag == "attention_bias"):
            raise _unsupported(flag, cfg[flag], "false")

    # Sliding-window attention: megatron's local spec computes full causal attention.
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", True, "false (full attention)")
    window = cfg.get("sliding_window")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and window is not None and window < max_pos:
        raise UnsupportedModelError(
            f"config.json field 'sliding_window' = {window} is smaller than "
            f"max_position_embeddings = {max_pos}: this model uses sliding-window attention, "
            "which the bridge does not implement (supported: null). If every sequence you "
            f"train on is shorter than {window} tokens the two are identical; then set "
            "'sliding_window': null in a copy of config.json."
        )

    theta, rope = _rope_parameters(cfg)
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    scaling_factor = None
    if rope_type == "llama3" and arch in ("LlamaForCausalLM",):
        for key, expected in MCORE_LLAMA3_ROPE.items():
            if float(rope.get(key, expected)) != expected:
                raise _unsupported(
                    f"rope_scaling.{key}", rope.get(key), f"{expected} (megatron-core's llama3 constant)"
                )
        scaling_factor = float(rope["factor"])
    elif rope_type != "default" and not ARCHITECTURES[arch]["mla"] and arch != "GptOssForCausalLM":
        # (MLA: common/model/bridge_mla.py; gpt-oss's YaRN: common/model/bridge_gptoss.py)
        raise _unsupported("rope_scaling.rope_type", rope_type, "'default', and 'llama3' for LlamaForCausalLM")

    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    mla = parse_mla(cfg, rope_type, rope) if ARCHITECTURES[arch]["mla"] else None
    if mla is not None:  # every query head has its own key: heads of qk_head_dim, values of v_head_dim
        num_kv_heads, head_dim = num_heads, mla.qk_head_dim
    if num_heads % num_kv_heads:
        raise _unsupported("num_key_value_heads", num_kv_heads, f"a divisor of num_attention_heads={num_heads}")
    table = dict(ARCHITECTURES[arch])
    experts = table.pop("experts")
    table.pop("mla")
    gdn = parse_gdn(cfg, rope) if table.pop("gdn", False) else None
    gptoss, gptoss_moe = parse_gptoss(cfg, theta, rope) if table.pop("gptoss", False) else (None, None)
    if arch == "Qwen2MoeForCausalLM":
        table["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    return HFModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),  # (all-MoE: unused)
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=scaling_factor,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=parse_moe(cfg, arch) if experts else gptoss_moe,
        mla=mla,
        gdn=gdn,
        vision_language=vision_language,
        gptoss=gptoss,
        hf_config=cfg,
        **table,
    )


def padded_vocab_size(vocab_size, tp):
    multiple = VOCAB_DIVISIBLE_BY * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    spec: HFModelSpec,
    *,
    tp=1,
    pp=1,
    vpp=None,
    cp=1,
    ep=1,
    etp=1,
    sequence_parallel=False,
    params_dtype=torch.float32,
    use_cpu_initialization=False,
    moe_aux_loss_coef=None,
    first_stage_layers=None,
    last_stage_layers=None,
    **overrides,
):
    """megatron TransformerConfig equal to the HF architecture. `overrides` reach the
    config unchanged (e.g. recompute_granularity); dropout is always 0 for RL.
    first_stage_layers / last_stage_layers: layers of the first / last pipeline stage
    (None: automatic, see pipeline_layout).
    MoE models: ep/etp are the expert (tensor) parallel sizes; moe_aux_loss_coef replaces the
    HF config's router_aux_loss_coef (None: keep it)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if spec.gdn is not None and cp > 1:
        raise ValueError(
            f"--cp {cp}: {spec.architecture}'s gated delta nets do not run under context parallelism "
            "(the recurrent state would have to pass between CP ranks); use --cp 1 (--pack for long batches)"
        )

    fused = torch.cuda.is_available()  # these fusions need CUDA kernels
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        add_qkv_bias=spec.qkv_bias,
        add_bias_linear=False,
        qk_layernorm=spec.qk_norm,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        gradient_accumulation_fusion=False,  # needs apex/TE
        persist_layer_norm=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,  # its CUDA extension is not in the pinned GPU stack; SDPA is the fast path
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        init_method_std=0.02,
        **pipeline_layout(spec.num_layers, pp, vpp, first_stage_layers, last_stage_layers),
    )
    if spec.moe is not None:
        kwargs.update(moe_config_fields(spec.moe, ep=ep, etp=etp, aux_loss_coef=moe_aux_loss_coef))
    if spec.mla is not None:
        kwargs.update(mla_config_fields(spec.mla, spec.rope_theta))
    if spec.gptoss is not None:  # o_proj, router and expert biases (q/k/v: add_qkv_bias)
        check_gptoss_layout(cp=cp, etp=etp)
        kwargs.update(add_bias_linear=True)
    if spec.gdn is not None:  # the full-attention layers' output gate (the delta nets: common/model/gdn.py)
        # layers of two kinds: distributed checkpoints keyed per layer (megatron stacks them otherwise)
        kwargs.update(attention_output_gate=True, hetereogenous_dist_checkpoint=True)
    kwargs.update(overrides)
    return (MLATransformerConfig if spec.mla is not None else TransformerConfig)(**kwargs)


def gpt_model_kwargs(spec: HFModelSpec, tp=1):
    """The GPTModel constructor arguments that come from the HF config."""
    return dict(
        vocab_size=padded_vocab_size(spec.vocab_size, tp),
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        rotary_percent=spec.gdn.rotary_fraction if spec.gdn is not None else 1.0,
    )


# ---------------------------------------------------------------------------------------
# Tensor mapping: megatron parameter name (global layer index) -> (kind, HF names)
# ---------------------------------------------------------------------------------------
_LAYER_RULES = {
    # local spec names, then the TransformerEngine spec's fused-norm names
    "input_layernorm.weight": ("replicated", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    ),
    "self_attention.q_layernorm.weight": ("replicated", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("replicated", ["self_attn.k_norm.weight"]),
    "self_attention.linear_proj.weight": ("row", ["self_attn.o_proj.weight"]),
    "pre_mlp_layernorm.weight": ("replicated", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.weight": ("gate_up", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("row", ["mlp.down_proj.weight"]),
}


def param_rule(mcore_name, spec: HFModelSpec):
    """(kind, [hf names]) for a megatron parameter name whose layer index is global."""
    if mcore_name == "embedding.word_embeddings.weight":
        return "vocab", ["model.embed_tokens.weight"]
    if mcore_name == "decoder.final_layernorm.weight":
        return "replicated", ["model.norm.weight"]
    if mcore_name == "output_layer.weight":
        # With tied embeddings and PP>1 the last stage keeps its own copy of the embedding.
        return "vocab", ["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    parts = mcore_name.split(".", 3)
    rule = gdn_param_rule(parts[3], parts[2], spec.gdn) if len(parts) == 4 and spec.gdn else None
    if rule is not None:
        return rule
    rule = mla_param_rule(parts[3], parts[2]) if len(parts) == 4 and spec.mla else None
    if rule is None and len(parts) == 4 and spec.gptoss:
        rule = gptoss_param_rule(parts[3], parts[2])
    if rule is not None:
        return rule
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[3] in _LAYER_RULES:
        kind, suffixes = _LAYER_RULES[parts[3]]
        return kind, [f"model.layers.{parts[2]}.{s}" for s in suffixes]
    rule = moe_param_rule(parts[3], parts[2], spec.moe) if len(parts) == 4 and spec.moe else None
    if rule is not None:
        return rule
    raise KeyError(f"no HF tensor maps to megatron parameter {mcore_name!r}")


def expected_hf_names(spec: HFModelSpec):
    """Every tensor name an HF checkpoint of this spec holds (save_pretrained layout)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if spec.gdn is not None:
        per_layer = []  # the layer's token mixer: gdn_hf_names
    elif spec.mla is not None:
        per_layer += mla_hf_names(spec.mla)
    else:
        per_layer += ["self_attn.o_proj.weight"] + [f"self_attn.{p}_proj.weight" for p in "qkv"]
    if spec.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if spec.qk_norm and spec.gdn is None:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    dense_mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    for i in range(spec.num_layers):
        names += [f"model.layers.{i}.{s}" for s in per_layer]
        if spec.gdn is not None:
            names += [f"model.layers.{i}.{s}" for s in ("input_layernorm.weight", "post_attention_layernorm.weight")]
            names += gdn_hf_names(i, spec.gdn)
        if spec.gptoss is not None:
            names += gptoss_hf_names(i, spec.gptoss.mxfp4)
        elif spec.moe is not None and spec.moe.moe_layers[i]:
            names += moe_hf_names(i, spec.moe)
        else:
            names += [f"model.layers.{i}.{s}" for s in dense_mlp]
    return names


def expected_hf_shape(name, spec: HFModelSpec):
    """The shape config.json implies for an HF tensor (to catch config/weights mismatches)."""
    h, d = spec.hidden_size, spec.head_dim
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (spec.num_heads * d, h),
        "self_attn.q_proj.bias": (spec.num_heads * d,),
        "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
        "self_attn.k_proj.bias": (spec.num_kv_heads * d,),
        "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
        "self_attn.v_proj.bias": (spec.num_kv_heads * d,),
        "self_attn.o_proj.weight": (h, spec.num_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.up_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.down_proj.weight": (h, spec.ffn_hidden_size),
    }
    gdn = gdn_hf_shape(suffix, h, spec.num_heads, d, spec.gdn) if spec.gdn is not None else None
    gptoss = gptoss_hf_shape(suffix, spec) if spec.gptoss is not None else None
    if gdn is not None or gptoss is not None:
        shape = gdn or gptoss
    elif spec.mla is not None and suffix.startswith("self_attn."):
        shape = mla_hf_shape(suffix, h, spec.num_heads, spec.mla)
    else:
        shape = shapes.get(suffix) or (moe_hf_shape(suffix, h, spec.moe) if spec.moe is not None else None)
    if shape is None:
        raise KeyError(f"{name!r} is not a tensor of a {spec.architecture} checkpoint")
    return shape


def shard_from_hf(kind, hf_names, read, spec: HFModelSpec, tp_rank, tp_size):
    """One TP rank's shard of a megatron parameter.

    read(hf_name, row_slice=None, col_slice=None) returns that slice of the HF tensor;
    only the rows/columns this rank owns are ever read (lazy safetensors slices).
    """
    if kind in GDN_KINDS:
        heads = (spec.gdn, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        return gdn_shard(kind, hf_names, read, *heads, tp_rank, tp_size)
    if kind in GPTOSS_KINDS:  # a routed expert (expert TP is 1)
        return gptoss_shard(kind, hf_names, read)
    if kind == "replicated":
        return read(hf_names[0])
    if kind == "row":
        cols = expected_hf_shape(hf_names[0], spec)[1] // tp_size
        return read(hf_names[0], col_slice=slice(tp_rank * cols, (tp_rank + 1) * cols))
    if kind == "column":
        rows = expected_hf_shape(hf_names[0], spec)[0] // tp_size
        return read(hf_names[0], row_slice=slice(tp_rank * rows, (tp_rank + 1) * rows))
    if kind == "gate_up":  # a dense MLP, a routed expert (tp = expert TP) or a shared expert
        rows = expected_hf_shape(hf_names[0], spec)[0] // tp_size
        part = slice(tp_rank * rows, (tp_rank + 1) * rows)
        return torch.cat([read(hf_names[0], row_slice=part), read(hf_names[1], row_slice=part)], dim=0)
    if kind == "vocab":
        rows = padded_vocab_size(spec.vocab_size, tp_size) // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, spec.vocab_size)
        real = read(hf_names[0], row_slice=slice(start, max(start, stop)))
        pad = real.new_zeros((rows - real.shape[0],) + tuple(real.shape[1:]))
        return torch.cat([real, pad], dim=0)
    if kind == "qkv":
        d, groups = spec.head_dim, spec.num_kv_heads // tp_size
        g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
        q = read(hf_names[0], row_slice=slice(g0 * spec.heads_per_group * d, g1 * spec.heads_per_group * d))
        k = read(hf_names[1], row_slice=slice(g0 * d, g1 * d))
        v = read(hf_names[2], row_slice=slice(g0 * d, g1 * d))
        tail = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
        per_group = [q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
        return torch.cat(per_group, dim=1).reshape(-1, *tail)
    raise ValueError(f"unknown kind {kind!r}")


def hf_from_shards(kind, hf_names, shards, spec: HFModelSpec):
    """Inverse of shard_from_hf: the list of all TP ranks' shards -> [(hf_name, full tensor)].
    One shard (TP=1) gives views of it wherever the layout allows, no copies."""

    def cat(parts, dim=0):
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    if kind in GDN_KINDS:
        return gdn_unshard(kind, hf_names, shards, spec.gdn, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if kind in GPTOSS_KINDS:
        return gptoss_unshard(kind, hf_names, shards)
    if kind == "replicated":
        return [(hf_names[0], shards[0])]
    if kind == "row":
        return [(hf_names[0], cat(shards, dim=1))]
    if kind == "column":
        return [(hf_names[0], cat(shards))]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(hf_names[0], cat([g for g, _ in halves])), (hf_names[1], cat([u for _, u in halves]))]
    if kind == "vocab":
        return [(hf_names[0], cat(shards)[: spec.vocab_size])]
    if kind == "qkv":
        d, hpg = spec.head_dim, spec.heads_per_group
        full = cat(shards)
        tail = tuple(full.shape[1:])
        groups = full.shape[0] // ((hpg + 2) * d)  # num_kv_heads, or one TP rank's share of them
        q, k, v = full.reshape(groups, (hpg + 2) * d, *tail).split([hpg * d, d, d], dim=1)
        return [(n, t.reshape(-1, *tail)) for n, t in zip(hf_names, (q, k, v))]
    raise ValueError(f"unknown kind {kind!r}")
