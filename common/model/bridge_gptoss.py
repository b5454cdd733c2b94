"""The gpt-oss half of the bridge (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b).

Pure functions, like common/model/bridge.py (which calls these for the row of its table whose
`gptoss` column is set):
  parse_gptoss(cfg, rope)            config.json -> GptOssSpec (and its MoESpec), or UnsupportedModelError
  gptoss_param_rule(rest, L, spec)   megatron parameter of layer L -> (kind, HF names), or None
  gptoss_hf_names / gptoss_hf_shape  what the HF checkpoint holds, for checks and export
  gptoss_shard / gptoss_unshard      the shard kinds of this family (below)
  fused_expert_tensors(pairs, spec)  the export's per-expert pieces -> the checkpoint's fused tensors
  mxfp4_dequantize(blocks, scales)   the hub's MXFP4 expert weights -> floats

Against transformers' modeling_gpt_oss.py (checked in tests/test_gptoss.py):
  attention   q/k/v/o with biases; `self_attn.sinks` (heads,) is one more logit per head in the
              softmax, dropped after it (megatron's softmax_type "learnable": the core attention's
              `softmax_offset`, split over TP by heads, kind "column"); config.layer_types says
              which layers attend a sliding window of `sliding_window` keys (the query's own
              included) and which all earlier keys: common/model/gptoss.py SinkAttention.
  RoPE        YaRN (rope_parameters: factor, beta_fast/slow, original_max_position_embeddings,
              truncate) in transformers' formula, its attention factor scaling cos and sin.
  router      `mlp.router.weight` (E, H) and `.bias` (E,): top-k of the logits, softmax over those k
              (megatron pre_softmax False, as Mixtral).
  experts     fused per layer on disk: `mlp.experts.gate_up_proj` (E, H, 2F) with gate and up in
              alternating columns (gate 0::2, up 1::2), `gate_up_proj_bias` (E, 2F) alike,
              `down_proj` (E, F, H), `down_proj_bias` (E, H). megatron holds expert e as
              `local_experts.{j}.linear_fc1` (2F, H) rows [gate; up] (+ bias) and `linear_fc2` (H, F)
              (+ bias, added weighted by the router probability, as transformers does). The bridge
              names a megatron expert tensor's HF piece `<fused name>#e`; load reads row e of the
              fused tensor, export (fused_expert_tensors) writes the E pieces back into one tensor.
  activation  gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate),
              alpha 1.702 and limit 7.0 as transformers hard-codes them (common/model/gptoss.py).
  MXFP4       the hub's checkpoints store the expert weights as `<name>_blocks` (E, rows, in/32, 16)
              uint8 (two e2m1 values a byte, low nibble first) and `<name>_scales` (E, rows, in/32)
              uint8 (a power of two, biased by 127); load dequantises them (mxfp4_dequantize, the
              same values as transformers' convert_moe_packed_tensors); export writes the plain
              tensors (bf16 by default: merge_to_hf.py --dtype), never MXFP4.
Not mapped, refused at build: expert tensor parallelism (each ETP rank would add fc2's bias) and
context parallelism (SinkAttention has no CP path). Packed sequences are supported.
"""

import re
from dataclasses import dataclass

import torch

from common.model.bridge_moe import MoESpec
from common.model.unsupported import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"
ALPHA, LIMIT = 1.702, 7.0  # transformers' GptOssExperts constants (config.json's swiglu_limit is 7.0)
KINDS = ("gptoss_fc1", "gptoss_fc1_bias", "gptoss_fc2", "gptoss_fc2_bias")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)")
# e2m1 values of the 16 nibbles (sign bit 3, exponent bits 2-1, mantissa bit 0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class GptOssSpec:
    window_layers: list  # per decoder layer: True = sliding-window attention, False = full
    sliding_window: int  # keys a sliding-window query attends, its own included
    inv_freq: tuple  # YaRN (or plain) RoPE inverse frequencies, head_dim / 2 of them
    attention_factor: float  # YaRN's scale of cos and sin (1.0 without YaRN)
    mxfp4: bool = False  # the checkpoint's expert weights are MXFP4 blocks and scales


def _unsupported(field_name, value, supported):
    return UnsupportedModelError(
        f"config.json field {field_name!r} = {value!r} is not supported by the "
        f"HF<->Megatron bridge; supported: {supported}"
    )


def rope_frequencies(head_dim, theta, rope):
    """(inverse frequencies (head_dim/2,) fp32, attention factor) of RoPE, YaRN where
    rope["rope_type"] is "yarn": transformers' _compute_yarn_parameters written out (the ramp
    between the interpolated and the extrapolated frequencies, truncated to whole dimensions
    unless truncate is false, as gpt-oss has it)."""
    import math

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos_freqs = theta**exponents
    if (rope or {}).get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    factor = float(rope["factor"])
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    original = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def parse_gptoss(cfg: dict, theta, rope) -> tuple:
    """(GptOssSpec, MoESpec) of a gpt-oss config.json; UnsupportedModelError for what differs
    from what transformers computes and the bridge maps."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise _unsupported("layer_types", types, f"{n} entries, each {SLIDING!r} or {FULL!r}")
    window = cfg.get("sliding_window")
    if SLIDING in types and (window is None or int(window) < 1):
        raise _unsupported("sliding_window", window, "a positive integer (layer_types has sliding layers)")
    if float(cfg.get("swiglu_limit", LIMIT)) != LIMIT:  # transformers ignores the field and uses 7.0
        raise _unsupported("swiglu_limit", cfg["swiglu_limit"], f"{LIMIT} (transformers' constant)")
    if not cfg.get("attention_bias", True):
        raise _unsupported("attention_bias", False, "true (gpt-oss has q/k/v/o biases)")
    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise _unsupported("quantization_config.quant_method", quant.get("quant_method"), "'mxfp4' or none")
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise _unsupported("rope_parameters.rope_type", rope_type, "'yarn' or 'default'")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    inv_freq, factor = rope_frequencies(head_dim, theta, dict(rope or {}, rope_type=rope_type))
    experts, topk = int(cfg.get("num_local_experts", 128)), int(cfg.get("num_experts_per_tok", 4))
    if experts < 2 or not 1 <= topk <= experts:
        raise _unsupported("num_local_experts/num_experts_per_tok", (experts, topk), "E >= 2 and 1 <= k <= E")
    moe = MoESpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        moe_layers=[True] * n,
        normalize_topk=topk > 1,  # softmax over the top-k logits (one expert: weight 1.0 either way)
        shared_expert_size=0,
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,
        layout="gptoss",
    )
    spec = GptOssSpec(
        window_layers=[t == SLIDING for t in types],
        sliding_window=int(window or 0),
        inv_freq=tuple(inv_freq.tolist()),
        attention_factor=factor,
        mxfp4=bool(quant),
    )
    return spec, moe


def check_gptoss_layout(cp=1, etp=1):
    """What the bridge does not map for gpt-oss, refused with what to use instead."""
    if cp > 1:
        raise ValueError(
            f"--cp {cp}: gpt-oss's attention (sinks, sliding windows: common/model/gptoss.py) has no "
            "context-parallel path; use --cp 1 (--pack for long batches)"
        )
    if etp > 1:
        raise ValueError(
            f"--etp {etp}: gpt-oss's expert biases are not split over expert tensor parallelism; "
            "use --etp 1 (experts over --ep, attention over --tp)"
        )


_RULES = {
    "self_attention.linear_proj.bias": ("replicated", "self_attn.o_proj.bias"),
    "self_attention.core_attention.softmax_offset": ("column", "self_attn.sinks"),
    "mlp.router.weight": ("replicated", "mlp.router.weight"),
    "mlp.router.bias": ("replicated", "mlp.router.bias"),
}
_FUSED = {  # (fc, weight|bias) -> (kind, fused HF tensor of the layer)
    ("1", "weight"): ("gptoss_fc1", "mlp.experts.gate_up_proj"),
    ("1", "bias"): ("gptoss_fc1_bias", "mlp.experts.gate_up_proj_bias"),
    ("2", "weight"): ("gptoss_fc2", "mlp.experts.down_proj"),
    ("2", "bias"): ("gptoss_fc2_bias", "mlp.experts.down_proj_bias"),
}


def gptoss_param_rule(rest, layer):
    """(kind, HF names) of a gpt-oss layer parameter (name after decoder.layers.L., global expert
    index), or None for the rules shared with the other families (norms, q/k/v, o_proj)."""
    if rest in _RULES:
        kind, suffix = _RULES[rest]
        return kind, [f"model.layers.{layer}.{suffix}"]
    match = _EXPERT.fullmatch(rest)
    if match is None:
        return None
    kind, fused = _FUSED[match[2], match[3]]
    return kind, [f"model.layers.{layer}.{fused}#{match[1]}"]


def gptoss_hf_names(layer, mxfp4=False):
    """The gpt-oss tensors of one layer beyond the Llama ones (mxfp4: the expert weights as blocks and scales)."""
    names = ["self_attn.o_proj.bias", "self_attn.sinks", "mlp.router.weight", "mlp.router.bias"]
    for _, fused in _FUSED.values():
        quantized = mxfp4 and not fused.endswith("_bias")
        names += [fused + "_blocks", fused + "_scales"] if quantized else [fused]
    return [f"model.layers.{layer}.{s}" for s in names]


def gptoss_hf_shape(suffix, spec):
    """Shape of a gpt-oss tensor (suffix after model.layers.L.), or None; MXFP4 blocks and scales too."""
    h, moe = spec.hidden_size, spec.moe
    e, f = moe.num_experts, moe.ffn_hidden_size
    return {
        "self_attn.o_proj.bias": (h,),
        "self_attn.sinks": (spec.num_heads,),
        "mlp.router.weight": (e, h),
        "mlp.router.bias": (e,),
        "mlp.experts.gate_up_proj": (e, h, 2 * f),
        "mlp.experts.gate_up_proj_bias": (e, 2 * f),
        "mlp.experts.down_proj": (e, f, h),
        "mlp.experts.down_proj_bias": (e, h),
        "mlp.experts.gate_up_proj_blocks": (e, 2 * f, h // 32, 16),
        "mlp.experts.gate_up_proj_scales": (e, 2 * f, h // 32),
        "mlp.experts.down_proj_blocks": (e, h, f // 32, 16),
        "mlp.experts.down_proj_scales": (e, h, f // 32),
    }.get(suffix)


def mxfp4_dequantize(blocks, scales, dtype=torch.bfloat16):
    """MXFP4 (..., rows, G, 16) uint8 blocks and (..., rows, G) uint8 scales -> (..., rows, G * 32):
    each byte two e2m1 values (low nibble first), each group of 32 times 2 ** (scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1)  # (..., G, 16, 2)
    values = values.reshape(*blocks.shape[:-1], 32)
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1))
    return out.to(dtype).reshape(*blocks.shape[:-2], -1)


def _read_expert(read, name, e):
    """Expert e's row of the fused tensor `name`, plain or dequantised from MXFP4 (then (rows, in),
    the transpose of the plain (in, rows) layout, which is returned as such)."""
    try:
        return read(name, row_slice=slice(e, e + 1))[0]
    except KeyError:
        if name.endswith("_bias"):
            raise
    blocks = read(name + "_blocks", row_slice=slice(e, e + 1))[0]
    scales = read(name + "_scales", row_slice=slice(e, e + 1))[0]
    return mxfp4_dequantize(blocks, scales, torch.float32).T  # (in, rows) as the plain tensor


def gptoss_shard(kind, hf_names, read):
    """Expert e's megatron tensor from row e of its fused HF tensor (expert TP is 1)."""
    name, e = hf_names[0].rsplit("#", 1)
    x = _read_expert(read, name, int(e))
    if kind == "gptoss_fc1":  # (H, 2F), columns gate, up, gate, up, ... -> rows [gate; up] (2F, H)
        return torch.cat([x[:, 0::2].T, x[:, 1::2].T], dim=0).contiguous()
    if kind == "gptoss_fc1_bias":
        return torch.cat([x[0::2], x[1::2]])
    if kind == "gptoss_fc2":  # (F, H) -> (H, F)
        return x.T.contiguous()
    return x  # gptoss_fc2_bias (H,)


def gptoss_unshard(kind, hf_names, shards):
    """Inverse of gptoss_shard: [("<fused name>#e", expert e's row of the fused tensor)]."""
    (x,) = shards
    if kind in ("gptoss_fc1", "gptoss_fc1_bias"):
        gate, up = x.chunk(2, dim=0)
        gate, up = (gate.T, up.T) if kind == "gptoss_fc1" else (gate, up)
        out = torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], -1)  # alternate columns again
    else:
        out = x.T if kind == "gptoss_fc2" else x
    return [(hf_names[0], out)]


def fused_expert_tensors(pairs, spec):
    """(hf_name, tensor) pairs with experts as `<fused name>#e` pieces -> the checkpoint's fused
    tensors: each piece copied into its row as it comes (the pieces may be views of reused
    buffers), the fused tensor yielded after its last expert. All of a layer's experts come
    before the next layer's (export order), so about one layer's experts are held at a time."""
    pending, counts = {}, {}
    for name, tensor in pairs:
        if "#" not in name:
            yield name, tensor
            continue
        fused, e = name.rsplit("#", 1)
        if fused not in pending:
            pending[fused] = tensor.new_empty((spec.moe.num_experts, *tensor.shape))
        pending[fused][int(e)].copy_(tensor)
        counts[fused] = counts.get(fused, 0) + 1
        if counts[fused] == spec.moe.num_experts:
            yield fused, pending.pop(fused)
    if pending:
        raise RuntimeError(f"export: experts missing from {sorted(pending)} (a bridge bug)")
