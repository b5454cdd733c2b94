"""HF <-> Megatron-Core: config mapping and the tensor mapping, as pure functions.

Two halves:
  1. `parse_hf_config(config.json dict) -> HFModelSpec`, then `transformer_config(...)`
     and `gpt_model_kwargs(...)`. A config the bridge cannot represent exactly is a
     `UnsupportedModelError` naming the field, its value and what is supported:
     never a silently different model.
  2. `param_rule(mcore_name, spec) -> (kind, hf_names)` says which HF tensors make a
     megatron parameter and how it is sharded over tensor parallelism; then
     `shard_from_hf` cuts one TP rank's shard out of (lazily read) HF tensors and
     `hf_from_shards` puts the TP shards back together as HF tensors. This half lives in
     common/model/bridge_tensors.py and is importable from here.
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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model.bridge_gdn import (
    GDNSpec,
    parse_gdn,
)
from common.model.bridge_gptoss import (
    GptOssSpec,
    check_gptoss_layout,
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
    parse_mla,
)
from common.model.bridge_moe import MoESpec, moe_config_fields, parse_moe
from common.model.bridge_tensors import (  # noqa: F401 (re-exported: the tensor half)
    _LAYER_RULES,
    expected_hf_names,
    expected_hf_shape,
    hf_from_shards,
    padded_vocab_size,
    param_rule,
    shard_from_hf,
)
from common.model.bridge_vl import VL_ARCHITECTURES, text_config
from common.model.unsupported import UnsupportedModelError

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
