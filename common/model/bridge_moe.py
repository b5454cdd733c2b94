"""The Mixture-of-Experts half of the bridge: Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE, Mixtral and DeepSeek-V3.

Pure functions, like common/model/bridge.py (which calls these for the rows of its table that
name an expert layout):
  parse_moe(cfg, arch)        config.json -> MoESpec, or UnsupportedModelError for a field
                              megatron would get wrong
  moe_config_fields(moe, ...) the TransformerConfig fields of the MoE layers
  moe_param_rule(name, ...)   megatron parameter -> (kind, HF names), experts by global index
  moe_hf_names / moe_hf_shapes  what the HF checkpoint holds, for checks and export

Router equivalences (tests/test_moe.py checks each against transformers):
  HF softmax over all experts -> top-k -> renormalise (norm_topk_prob, Mixtral always)
      == megatron top-k of the logits, then a softmax over those k (pre_softmax False)
  HF softmax over all experts -> top-k, no renormalisation (Qwen2-MoE's default)
      == megatron pre_softmax True
Experts: HF checkpoints store one tensor per expert and projection (the hub layout,
`mlp.experts.{e}.gate_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.w1.weight`);
megatron holds expert e = ep_rank * (E / ep) + j as `mlp.experts.local_experts.{j}`, its
linear_fc1 = [gate; up] split over expert-tensor-parallel ranks like a dense gate_up.
Qwen2-MoE's (and Qwen3.5-MoE's) shared expert is `mlp.shared_experts` (TP-sharded like a dense
MLP) with its sigmoid gate `shared_experts.gate_weight` (1, H); DeepSeek-V3's (`mlp.shared_experts.*` on
disk, n_shared_experts of them fused into one MLP) has no gate.
DeepSeek-V3 routing: sigmoid scores plus the score-correction bias choose the experts
(`mlp.gate.e_score_correction_bias` <-> the router's fp32 buffer `expert_bias`; frozen unless
--moe-router-bias-update-rate turns on megatron's aux-loss-free update),
within the topk_group best of n_group groups, the chosen unbiased scores renormalised and
multiplied by routed_scaling_factor. megatron scores a group by the sum of its top
(topk / topk_group) experts, transformers by its top 2: the bridge takes configs where the
two agree (DeepSeek-V3: 8 / 4) or n_group is 1 (Moonlight). No aux loss by default: the bias
balances the load (aux-loss-free), as in transformers.
Aux loss: megatron adds coef * E * sum_i f_i P_i per MoE layer (f_i counted per micro-batch
and averaged over micro-batches and DP ranks); transformers pools all layers into one term,
so the same coefficient weighs the loss differently beyond one layer (docs/models.md).
"""

import re
from dataclasses import dataclass

# HF checkpoint layout of an expert block: (block module, gate, up, down projection names)
EXPERT_LAYOUTS = {
    "qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek": ("mlp", "gate_proj", "up_proj", "down_proj"),
}
SHARED_EXPERT = {"qwen": "mlp.shared_expert", "deepseek": "mlp.shared_experts"}  # HF module of the shared expert

_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


@dataclass
class MoESpec:
    num_experts: int
    topk: int
    ffn_hidden_size: int  # per routed expert
    moe_layers: list  # per decoder layer: True = MoE, False = dense MLP
    normalize_topk: bool  # renormalise the top-k probabilities
    shared_expert_size: int  # 0: no shared expert (Qwen2-MoE: one, with a sigmoid gate)
    aux_loss_coef: float  # the HF config's router_aux_loss_coef (--moe-aux-loss-coef overrides)
    z_loss_coef: float  # router z-loss, 0 unless the HF config sets one
    layout: str  # key of EXPERT_LAYOUTS
    score_function: str = "softmax"  # DeepSeek-V3: "sigmoid", with the score-correction bias
    num_groups: int | None = None  # group-limited routing: experts in n_group groups ...
    group_topk: int | None = None  # ... of which the topk_group best are eligible
    scaling_factor: float | None = None  # routed_scaling_factor

    @property
    def expert_bias(self):  # DeepSeek-V3's e_score_correction_bias
        return self.layout == "deepseek"

    @property
    def shared_gate(self):  # Qwen2-MoE gates its shared expert; DeepSeek-V3 does not
        return self.layout == "qwen"

    @property
    def names(self):
        return EXPERT_LAYOUTS[self.layout]


def default_dispatcher(ep, etp):
    """megatron's token dispatcher for --moe-dispatcher unset: all-gather with every expert
    local (DeviceSortDispatcher then sorts the tokens on the device), else all-to-all, which
    moves only the tokens each EP rank's experts need. All-gather at EP > 1 (--moe-dispatcher
    allgather) was measured faster at EP=2 (1.2x on two H200s, fixed-length batches) and
    equal at EP=4 (docs/performance.md); it needs the same number of tokens per pass on every
    EP rank, which the scripts' micro-batches then pad to (batch.micro_batches same_tokens)."""
    return "allgather" if ep * etp == 1 else "alltoall"


def _unsupported(field_name, value, supported):
    from common.model.unsupported import UnsupportedModelError

    return UnsupportedModelError(
        f"config.json field {field_name!r} = {value!r} is not supported by the "
        f"HF<->Megatron bridge; supported: {supported}"
    )


def parse_moe(cfg: dict, arch: str) -> MoESpec:
    """The MoE part of an HF config. Every field that changes the MoE computation is mapped or refused."""
    num_layers = int(cfg["num_hidden_layers"])
    if arch == "DeepseekV3ForCausalLM":
        return _parse_deepseek(cfg, num_layers)
    if arch == "MixtralForCausalLM":
        num_experts, ffn = int(cfg.get("num_local_experts", 8)), int(cfg["intermediate_size"])
        moe_layers, normalize, shared, layout = [True] * num_layers, True, 0, "mixtral"
        if float(cfg.get("router_jitter_noise") or 0.0) != 0.0:  # multiplicative noise on the router's input
            raise _unsupported(
                "router_jitter_noise",
                cfg["router_jitter_noise"],
                "0.0 (training-time noise would make the trainer's logprobs differ from the rollout's)",
            )
    elif arch == "Qwen3_5MoeForCausalLM":  # every layer MoE, top-k always renormalised, a gated shared expert
        num_experts, ffn, layout = int(cfg.get("num_experts") or 0), int(cfg["moe_intermediate_size"]), "qwen"
        moe_layers, normalize = [True] * num_layers, True
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if not shared:
            raise _unsupported(
                "shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"), "> 0 (always built)"
            )
    else:  # Qwen2-MoE, Qwen3-MoE: MoE every decoder_sparse_step-th layer, except mlp_only_layers
        # released configs say num_experts; transformers 5 writes num_local_experts
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        ffn = int(cfg["moe_intermediate_size"])
        step, dense_only = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        if step < 1:
            raise _unsupported("decoder_sparse_step", step, "an integer >= 1")
        moe_layers = [i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
        normalize, layout = bool(cfg.get("norm_topk_prob", False)), "qwen"
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        if arch == "Qwen2MoeForCausalLM" and not shared:
            raise _unsupported(
                "shared_expert_intermediate_size",
                cfg.get("shared_expert_intermediate_size"),
                "> 0 (Qwen2-MoE always builds its shared expert)",
            )
    topk = int(cfg.get("num_experts_per_tok", 2))
    if num_experts < 2 or not any(moe_layers):
        raise _unsupported(
            "num_experts", num_experts, ">= 2 with at least one MoE layer (else use the dense architecture)"
        )
    if not 1 <= topk <= num_experts:
        raise _unsupported("num_experts_per_tok", topk, f"1..{num_experts}")
    if topk == 1 and normalize:  # renormalised top-1 is always 1.0; megatron refuses softmax-after-top-1
        raise _unsupported("norm_topk_prob", True, "false when num_experts_per_tok is 1")
    return MoESpec(
        num_experts=num_experts,
        topk=topk,
        ffn_hidden_size=ffn,
        moe_layers=moe_layers,
        normalize_topk=normalize,
        shared_expert_size=shared,
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),  # transformers' default of all three
        z_loss_coef=float(cfg.get("router_z_loss_coef") or 0.0),
        layout=layout,
    )


def _parse_deepseek(cfg, num_layers):
    num_experts, topk = int(cfg["n_routed_experts"]), int(cfg.get("num_experts_per_tok", 8))
    first_dense, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq", 1))
    if freq != 1:
        raise _unsupported("moe_layer_freq", freq, "1 (every layer after first_k_dense_replace is MoE)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise _unsupported("scoring_func", cfg["scoring_func"], "'sigmoid'")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _unsupported("topk_method", cfg["topk_method"], "'noaux_tc'")
    if not cfg.get("norm_topk_prob", True) and topk > 1:  # megatron renormalises sigmoid top-k scores always
        raise _unsupported("norm_topk_prob", False, "true (megatron renormalises sigmoid scores of top-k > 1)")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1:
        if num_experts % groups or not 1 <= group_topk <= groups:
            raise _unsupported(
                "n_group/topk_group",
                (groups, group_topk),
                f"n_group dividing n_routed_experts={num_experts} and 1 <= topk_group <= n_group",
            )
        if topk != 2 * group_topk:  # see the module docstring
            raise _unsupported(
                "num_experts_per_tok",
                topk,
                f"2 * topk_group = {2 * group_topk} with n_group > 1 "
                "(megatron scores a group by its top topk/topk_group experts, transformers by its top 2)",
            )
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    if not shared:
        raise _unsupported("n_shared_experts", cfg.get("n_shared_experts"), ">= 1")
    if not 1 <= topk <= num_experts or first_dense >= num_layers:
        raise _unsupported(
            "num_experts_per_tok/first_k_dense_replace",
            (topk, first_dense),
            f"1..{num_experts} experts per token and at least one MoE layer",
        )
    return MoESpec(
        num_experts=num_experts,
        topk=topk,
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_layers=[i >= first_dense for i in range(num_layers)],
        normalize_topk=True,
        shared_expert_size=shared,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        layout="deepseek",
        score_function="sigmoid",
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )


def moe_config_fields(moe: MoESpec, *, ep=1, etp=1, aux_loss_coef=None):
    """TransformerConfig keyword arguments of the MoE layers (megatron-core 0.16.1 names)."""
    coef = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(m) for m in moe.moe_layers],
        moe_router_topk=moe.topk,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.normalize_topk,  # module docstring
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,  # the loaded bias stays (the scripts' --moe-router-bias-update-rate)
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_z_loss_coeff=moe.z_loss_coef or None,
        moe_shared_expert_intermediate_size=moe.shared_expert_size or None,
        moe_shared_expert_gate=moe.shared_gate,  # Qwen2-MoE: sigmoid(x @ gate) * shared(x)
        moe_token_dispatcher_type=default_dispatcher(ep, etp),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # megatron's grouped paths need TE or grouped_gemm: common/model/moe_experts.py has ours
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,  # TE kernels
    )


def expert_index(name):
    """The expert index in a megatron expert parameter name, or None for other parameters."""
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def global_expert_name(name, ep_rank, ep_size, num_experts):
    """A megatron expert parameter name with its local index j (on EP rank ep_rank) replaced by
    the global expert index ep_rank * E/ep + j."""
    j = expert_index(name)
    return _EXPERT.sub(f".experts.local_experts.{ep_rank * num_experts // ep_size + j}.", name, count=1)


def moe_param_rule(rest, layer, moe: MoESpec):
    """(kind, HF names) for the part `rest` of a megatron layer parameter name, or None when it
    is not an MoE parameter. Expert indices in `rest` are global."""
    block, gate, up, down = moe.names
    prefix = f"model.layers.{layer}.{block}"
    if rest == "mlp.router.weight":
        return "replicated", [f"{prefix}.gate.weight"]
    if rest == "mlp.router.expert_bias":  # a buffer (common/model/gpt.py: named_global_tensors)
        return "replicated", [f"{prefix}.gate.e_score_correction_bias"]
    e = expert_index("." + rest)
    if e is not None:
        if rest.endswith("linear_fc1.weight"):
            return "gate_up", [f"{prefix}.experts.{e}.{gate}.weight", f"{prefix}.experts.{e}.{up}.weight"]
        if rest.endswith("linear_fc2.weight"):
            return "row", [f"{prefix}.experts.{e}.{down}.weight"]
    shared = f"model.layers.{layer}.{SHARED_EXPERT.get(moe.layout)}"
    rules = {
        "mlp.shared_experts.linear_fc1.weight": ("gate_up", [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"]),
        "mlp.shared_experts.linear_fc2.weight": ("row", [f"{shared}.down_proj.weight"]),
        "mlp.shared_experts.gate_weight": ("replicated", [f"{shared}_gate.weight"]),  # Qwen2-MoE's sigmoid gate
    }
    return rules.get(rest)


def moe_hf_names(layer, moe: MoESpec):
    """The HF tensor names of one MoE layer's MLP (save_pretrained layout)."""
    block, gate, up, down = moe.names
    prefix = f"model.layers.{layer}.{block}"
    names = [f"{prefix}.gate.weight"] + ([f"{prefix}.gate.e_score_correction_bias"] if moe.expert_bias else [])
    names += [f"{prefix}.experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in (gate, up, down)]
    if moe.shared_expert_size:
        shared = f"model.layers.{layer}.{SHARED_EXPERT[moe.layout]}"
        names += [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight", f"{shared}.down_proj.weight"]
        names += [f"{shared}_gate.weight"] if moe.shared_gate else []
    return names


def moe_hf_shape(suffix, hidden, moe: MoESpec):
    """Shape of an MoE tensor from the name's part after `model.layers.L.`, or None."""
    block, gate, up, down = moe.names
    f, s = moe.ffn_hidden_size, moe.shared_expert_size
    suffix = re.sub(r"\.experts\.\d+\.", ".experts.*.", suffix)
    shared = SHARED_EXPERT.get(moe.layout, "-")
    return {
        f"{block}.gate.weight": (moe.num_experts, hidden),
        f"{block}.gate.e_score_correction_bias": (moe.num_experts,),
        f"{block}.experts.*.{gate}.weight": (f, hidden),
        f"{block}.experts.*.{up}.weight": (f, hidden),
        f"{block}.experts.*.{down}.weight": (hidden, f),
        f"{shared}.gate_proj.weight": (s, hidden),
        f"{shared}.up_proj.weight": (s, hidden),
        f"{shared}.down_proj.weight": (hidden, s),
        f"{shared}_gate.weight": (1, hidden),
    }.get(suffix)


# checkpoint name of one expert's projection: model.layers.L.<block>.experts.E.<proj>.weight
EXPERT_BLOCKS = "|".join(sorted({block for block, *_ in EXPERT_LAYOUTS.values()}))
EXPERT_NAME = re.compile(rf"model\.layers\.(\d+)\.(?:{EXPERT_BLOCKS})\.experts\.(\d+)\.(\w+)\.weight")
# projection -> its half of the fused gate_up_proj (0 gate, 1 up), None for down_proj
EXPERT_HALF = {
    proj: half for _, gate, up, down in EXPERT_LAYOUTS.values() for proj, half in ((gate, 0), (up, 1), (down, None))
}
