"""The gated-delta-net half of the bridge: Qwen3.5 (three of every four layers a gated delta net, a
linear-attention recurrence; the fourth full attention with an output gate).

Pure functions, like common/model/bridge.py (which calls these for the rows of its table whose
`gdn` column is set):
  parse_gdn(cfg)                   config.json -> GDNSpec, or UnsupportedModelError
  gdn_param_rule(rest, L, gdn)     megatron parameter of layer L -> (kind, HF names), or None
  gdn_hf_names / gdn_hf_shape      what the HF checkpoint holds, for checks and export
  gdn_shard / gdn_unshard          the shard kinds of this family (below)

Against transformers' modeling_qwen3_5.py (checked in tests/test_qwen35.py):
  linear layers  linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log,
                 norm, out_proj} -> common/model/gdn.py's GatedDeltaNet (self_attention.*). Its fused
                 in_proj holds on TP rank r [q_r; k_r; v_r; z_r; b_r; a_r] (kind "gdn_in": heads
                 split over TP, key heads and value heads alike), its depthwise conv1d [q_r; k_r; v_r]
                 (kind "gdn_conv"); dt_bias and A_log are per value head ("column").
  full attention q_proj rows are per head [query (head_dim); gate (head_dim)]; megatron's gated
                 attention (TransformerConfig.attention_output_gate) fuses per query group
                 [queries of group g; their gates; k_g; v_g] (kind "qkvg"). Partial RoPE
                 (rope_parameters.partial_rotary_factor) on the first dims, rotate-half layout.
  norms          every RMSNorm of the decoder (input, post-attention, final, q/k) is zero-centred:
                 x_normed * (1 + w) (common/model/gpt.py ZeroCenteredRMSNorm, same weights as HF);
                 the gated norm of the delta net is plain: x_normed * w * silu(z).
  mrope          the text positions of the vision-language model are the same on its three
                 axes, so the interleaved multimodal RoPE is the plain one for text.
"""

from dataclasses import dataclass

import torch

from common.model.unsupported import UnsupportedModelError

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class GDNSpec:
    linear_layers: list  # per decoder layer: True for a gated delta net, False for full attention
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    rotary_fraction: float  # partial RoPE of the full-attention layers

    @property
    def key_dim(self):
        return self.key_head_dim * self.num_key_heads

    @property
    def value_dim(self):
        return self.value_head_dim * self.num_value_heads

    @property
    def conv_dim(self):
        return 2 * self.key_dim + self.value_dim

    def in_pieces(self, tp=1):
        """Row counts of one TP rank's fused in_proj: q, k, v, z, b, a."""
        k, v, h = self.key_dim // tp, self.value_dim // tp, self.num_value_heads // tp
        return [k, k, v, v, h, h]


def _unsupported(field_name, value, supported):
    return UnsupportedModelError(
        f"config.json field {field_name!r} = {value!r} is not supported by the "
        f"HF<->Megatron bridge; supported: {supported}"
    )


def parse_gdn(cfg: dict, rope: dict | None) -> GDNSpec:
    """The Qwen3.5 part of a (text) config.json."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise _unsupported("layer_types", types, f"{n} entries, each {LINEAR!r} or {FULL!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", cfg["hidden_act"], "'silu'")
    if cfg.get("attn_output_gate", True) is not True:
        raise _unsupported("attn_output_gate", cfg["attn_output_gate"], "true")
    spec = GDNSpec(
        linear_layers=[t == LINEAR for t in types],
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        rotary_fraction=float((rope or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
    )
    if spec.num_value_heads % spec.num_key_heads:
        raise _unsupported(
            "linear_num_value_heads", spec.num_value_heads, f"a multiple of linear_num_key_heads={spec.num_key_heads}"
        )
    if (rope or {}).get("mrope_section") and not sum(rope["mrope_section"]):
        raise _unsupported("rope_parameters.mrope_section", rope["mrope_section"], "a non-empty list")
    return spec


_GDN_RULES = {
    "self_attention.in_proj.weight": (
        "gdn_in",
        ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"]
        + ["linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"],
    ),
    "self_attention.conv1d.weight": ("gdn_conv", ["linear_attn.conv1d.weight"]),
    "self_attention.dt_bias": ("column", ["linear_attn.dt_bias"]),
    "self_attention.A_log": ("column", ["linear_attn.A_log"]),
    "self_attention.out_norm.weight": ("replicated", ["linear_attn.norm.weight"]),
    "self_attention.out_proj.weight": ("row", ["linear_attn.out_proj.weight"]),
}
_GATED_QKV = (
    "qkvg",
    ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
)


def gdn_param_rule(rest, layer, gdn: GDNSpec):
    """(kind, HF names) of a Qwen3.5 layer parameter (name after decoder.layers.L.), or None for
    the rules the family shares with Qwen3 (norms, o_proj, MLP)."""
    if gdn.linear_layers[int(layer)]:
        rule = _GDN_RULES.get(rest)
    else:
        rule = _GATED_QKV if rest == "self_attention.linear_qkv.weight" else None
    if rule is None:
        return None
    kind, suffixes = rule
    return kind, [f"model.layers.{layer}.{s}" for s in suffixes]


def gdn_hf_names(layer, gdn: GDNSpec):
    """The token mixer's tensors of one layer (the norms and the MLP are common/model/bridge.py's)."""
    if gdn.linear_layers[layer]:
        names = [s for _, suffixes in _GDN_RULES.values() for s in suffixes]
    else:
        names = _GATED_QKV[1] + ["self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return [f"model.layers.{layer}.{s}" for s in names]


def gdn_hf_shape(suffix, hidden, num_heads, head_dim, gdn: GDNSpec):
    """Shape of a Qwen3.5 token-mixer tensor (suffix after model.layers.L.), or None."""
    shapes = {
        "linear_attn.in_proj_qkv.weight": (gdn.conv_dim, hidden),
        "linear_attn.in_proj_z.weight": (gdn.value_dim, hidden),
        "linear_attn.in_proj_b.weight": (gdn.num_value_heads, hidden),
        "linear_attn.in_proj_a.weight": (gdn.num_value_heads, hidden),
        "linear_attn.conv1d.weight": (gdn.conv_dim, 1, gdn.conv_kernel),
        "linear_attn.dt_bias": (gdn.num_value_heads,),
        "linear_attn.A_log": (gdn.num_value_heads,),
        "linear_attn.norm.weight": (gdn.value_head_dim,),
        "linear_attn.out_proj.weight": (hidden, gdn.value_dim),
        "self_attn.q_proj.weight": (2 * num_heads * head_dim, hidden),
    }
    return shapes.get(suffix)


def gdn_shard(kind, hf_names, read, gdn: GDNSpec, num_heads, num_kv_heads, head_dim, tp_rank, tp_size):
    """One TP rank's shard of a "gdn_in", "gdn_conv" or "qkvg" parameter (bridge.shard_from_hf)."""
    if kind in ("gdn_in", "gdn_conv"):
        # the rank's slice of each logical piece: q, k, v of the conv's channels, then z, b, a
        k, v, h = gdn.key_dim // tp_size, gdn.value_dim // tp_size, gdn.num_value_heads // tp_size
        qkv = [(k, 0), (k, gdn.key_dim), (v, 2 * gdn.key_dim)]  # (rows per rank, offset) in in_proj_qkv
        parts = [read(hf_names[0], row_slice=slice(off + tp_rank * n, off + (tp_rank + 1) * n)) for n, off in qkv]
        if kind == "gdn_in":
            parts += [
                read(name, row_slice=slice(tp_rank * n, (tp_rank + 1) * n)) for name, n in zip(hf_names[1:], (v, h, h))
            ]
        return torch.cat(parts, dim=0)
    if kind == "qkvg":
        groups, hpg = num_kv_heads // tp_size, num_heads // num_kv_heads
        g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
        qg = read(hf_names[0], row_slice=slice(g0 * hpg * 2 * head_dim, g1 * hpg * 2 * head_dim))
        hidden = qg.shape[1]
        qg = qg.reshape(groups, hpg, 2, head_dim, hidden)  # per head [query; gate]
        q = qg[:, :, 0].reshape(groups, hpg * head_dim, hidden)
        g = qg[:, :, 1].reshape(groups, hpg * head_dim, hidden)
        kk = read(hf_names[1], row_slice=slice(g0 * head_dim, g1 * head_dim)).reshape(groups, head_dim, hidden)
        vv = read(hf_names[2], row_slice=slice(g0 * head_dim, g1 * head_dim)).reshape(groups, head_dim, hidden)
        return torch.cat([q, g, kk, vv], dim=1).reshape(-1, hidden)
    raise ValueError(f"unknown kind {kind!r}")


def gdn_unshard(kind, hf_names, shards, gdn: GDNSpec, num_heads, num_kv_heads, head_dim):
    """Inverse of gdn_shard: all TP ranks' shards -> [(hf_name, full tensor)]."""
    tp = len(shards)
    if kind in ("gdn_in", "gdn_conv"):
        full = sum(gdn.in_pieces(1)) if kind == "gdn_in" else gdn.conv_dim
        split = full // shards[0].shape[0]  # the TP size the shards were cut for (one shard: a rank's own pieces)
        sizes = gdn.in_pieces(split) if kind == "gdn_in" else gdn.in_pieces(split)[:3]
        per_rank = [s.split(sizes, dim=0) for s in shards]
        pieces = [torch.cat([r[i] for r in per_rank], dim=0) if tp > 1 else per_rank[0][i] for i in range(len(sizes))]
        out = [(hf_names[0], torch.cat(pieces[:3], dim=0))]
        return out + list(zip(hf_names[1:], pieces[3:]))
    if kind == "qkvg":
        hpg = num_heads // num_kv_heads
        full = torch.cat(shards, dim=0) if tp > 1 else shards[0]
        hidden = full.shape[1]
        groups = full.shape[0] // ((2 * hpg + 2) * head_dim)  # num_kv_heads, or one TP rank's share of them
        q, g, k, v = full.reshape(groups, -1, hidden).split([hpg * head_dim, hpg * head_dim, head_dim, head_dim], 1)
        qg = torch.stack([q.reshape(-1, head_dim, hidden), g.reshape(-1, head_dim, hidden)], dim=1)
        return [
            (hf_names[0], qg.reshape(-1, hidden)),
            (hf_names[1], k.reshape(-1, hidden)),
            (hf_names[2], v.reshape(-1, hidden)),
        ]
    raise ValueError(f"unknown kind {kind!r}")
