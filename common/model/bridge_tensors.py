"""The tensor half of the HF <-> Megatron-Core bridge (common/model/bridge.py, which re-exports it): which HF
tensors make each megatron parameter and how it is sharded over tensor parallelism (param_rule), the names and
shapes an HF checkpoint of a spec holds (expected_hf_names, expected_hf_shape), one TP rank's shard cut out of
lazily read HF tensors (shard_from_hf) and the shards put back together (hf_from_shards). The kinds and their
layout: bridge.py's docstring. `spec` is bridge.HFModelSpec (not imported here: bridge.py imports this file).
Pure functions: no I/O, no collectives.
"""

import math

import torch

from common.model.bridge_gdn import gdn_hf_names, gdn_hf_shape, gdn_param_rule, gdn_shard, gdn_unshard
from common.model.bridge_gptoss import KINDS as GPTOSS_KINDS
from common.model.bridge_gptoss import (
    gptoss_hf_names,
    gptoss_hf_shape,
    gptoss_param_rule,
    gptoss_shard,
    gptoss_unshard,
)
from common.model.bridge_mla import mla_hf_names, mla_hf_shape, mla_param_rule
from common.model.bridge_moe import moe_hf_names, moe_hf_shape, moe_param_rule

VOCAB_DIVISIBLE_BY = 128  # megatron's default make-vocab-size-divisible-by
GDN_KINDS = ("gdn_in", "gdn_conv", "qkvg")  # shard kinds of common/model/bridge_gdn.py


def padded_vocab_size(vocab_size, tp):
    """The vocabulary padded to a multiple of 128 x TP (megatron's embedding and output layer rows)."""
    multiple = VOCAB_DIVISIBLE_BY * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


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


def param_rule(mcore_name, spec):
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


def expected_hf_names(spec):
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


def expected_hf_shape(name, spec):
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


def shard_from_hf(kind, hf_names, read, spec, tp_rank, tp_size):
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


def hf_from_shards(kind, hf_names, shards, spec):
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
