"""The Mixture-of-Experts half of the bridge: Qwen3-MoE, Qwen2-MoE and Mixtral.

Pure functions, like common/bridge.py (which calls these for the rows of its table that
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
Qwen2-MoE's shared expert is `mlp.shared_experts` (TP-sharded like a dense MLP) with its
sigmoid gate `shared_experts.gate_weight` (1, H).
Aux loss: megatron adds coef * E * sum_i f_i P_i per MoE layer (f_i counted per micro-batch
and averaged over micro-batches and DP ranks); transformers pools all layers into one term,
so the same coefficient weighs the loss differently beyond one layer (documented in the README).
"""
import re
from dataclasses import dataclass


# HF checkpoint layout of an expert block: (block module, gate, up, down projection names)
EXPERT_LAYOUTS = {
    "qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}

_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


@dataclass
class MoESpec:
    num_experts: int
    topk: int
    ffn_hidden_size: int          # per routed expert
    moe_layers: list              # per decoder layer: True = MoE, False = dense MLP
    normalize_topk: bool          # renormalise the top-k probabilities
    shared_expert_size: int       # 0: no shared expert (Qwen2-MoE: one, with a sigmoid gate)
    aux_loss_coef: float          # the HF config's router_aux_loss_coef (--moe-aux-loss-coef overrides)
    z_loss_coef: float            # router z-loss, 0 unless the HF config sets one
    layout: str                   # key of EXPERT_LAYOUTS

    @property
    def names(self):
        return EXPERT_LAYOUTS[self.layout]


def _unsupported(field_name, value, supported):
    from common.bridge import UnsupportedModelError

    return UnsupportedModelError(f"config.json field {field_name!r} = {value!r} is not supported by the "
                                 f"HF<->Megatron bridge; supported: {supported}")


def parse_moe(cfg: dict, arch: str) -> MoESpec:
    """The MoE part of an HF config. Every field that changes the MoE computation is mapped or refused."""
    num_layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        num_experts, ffn = int(cfg.get("num_local_experts", 8)), int(cfg["intermediate_size"])
        moe_layers, normalize, shared, layout = [True] * num_layers, True, 0, "mixtral"
        if float(cfg.get("router_jitter_noise") or 0.0) != 0.0:  # multiplicative noise on the router's input
            raise _unsupported("router_jitter_noise", cfg["router_jitter_noise"],
                               "0.0 (training-time noise would make the trainer's logprobs differ from the rollout's)")
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
            raise _unsupported("shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size"),
                               "> 0 (Qwen2-MoE always builds its shared expert)")
    topk = int(cfg.get("num_experts_per_tok", 2))
    if num_experts < 2 or not any(moe_layers):
        raise _unsupported("num_experts", num_experts, ">= 2 with at least one MoE layer (else use the dense architecture)")
    if not 1 <= topk <= num_experts:
        raise _unsupported("num_experts_per_tok", topk, f"1..{num_experts}")
    if topk == 1 and normalize:  # renormalised top-1 is always 1.0; megatron refuses softmax-after-top-1
        raise _unsupported("norm_topk_prob", True, "false when num_experts_per_tok is 1")
    return MoESpec(num_experts=num_experts, topk=topk, ffn_hidden_size=ffn, moe_layers=moe_layers,
                   normalize_topk=normalize, shared_expert_size=shared,
                   aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),  # transformers' default of all three
                   z_loss_coef=float(cfg.get("router_z_loss_coef") or 0.0), layout=layout)


def moe_config_fields(moe: MoESpec, *, ep=1, etp=1, aux_loss_coef=None):
    """TransformerConfig keyword arguments of the MoE layers (megatron-core 0.16.1 names)."""
    coef = moe.aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(m) for m in moe.moe_layers],
        moe_router_topk=moe.topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.normalize_topk,  # see the module docstring
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_z_loss_coeff=moe.z_loss_coef or None,
        moe_shared_expert_intermediate_size=moe.shared_expert_size or None,
        moe_shared_expert_gate=bool(moe.shared_expert_size),  # Qwen2-MoE: sigmoid(x @ gate) * shared(x)
        # all-to-all moves only the tokens each EP rank's experts need; with every expert
        # local, all-gather is the simpler path (both match transformers, probe notes)
        moe_token_dispatcher_type="alltoall" if ep * etp > 1 else "allgather",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_grouped_gemm=False,  # megatron's grouped paths need TE or grouped_gemm: common/moe.py has ours
        moe_permute_fusion=False, moe_router_fusion=False,  # TE kernels
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
    e = expert_index("." + rest)
    if e is not None:
        if rest.endswith("linear_fc1.weight"):
            return "gate_up", [f"{prefix}.experts.{e}.{gate}.weight", f"{prefix}.experts.{e}.{up}.weight"]
        if rest.endswith("linear_fc2.weight"):
            return "row", [f"{prefix}.experts.{e}.{down}.weight"]
    shared = f"model.layers.{layer}.mlp.shared_expert"
    rules = {
        "mlp.shared_experts.linear_fc1.weight": ("gate_up", [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"]),
        "mlp.shared_experts.linear_fc2.weight": ("row", [f"{shared}.down_proj.weight"]),
        "mlp.shared_experts.gate_weight": ("replicated", [f"{shared}_gate.weight"]),
    }
    return rules.get(rest)


def moe_hf_names(layer, moe: MoESpec):
    """The HF tensor names of one MoE layer's MLP (save_pretrained layout)."""
    block, gate, up, down = moe.names
    prefix = f"model.layers.{layer}.{block}"
    names = [f"{prefix}.gate.weight"]
    names += [f"{prefix}.experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in (gate, up, down)]
    if moe.shared_expert_size:
        shared = f"model.layers.{layer}.mlp.shared_expert"
        names += [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight", f"{shared}.down_proj.weight",
                  f"{shared}_gate.weight"]
    return names


def moe_hf_shape(suffix, hidden, moe: MoESpec):
    """Shape of an MoE tensor from the name's part after `model.layers.L.`, or None."""
    block, gate, up, down = moe.names
    f, s = moe.ffn_hidden_size, moe.shared_expert_size
    suffix = re.sub(r"\.experts\.\d+\.", ".experts.*.", suffix)
    return {
        f"{block}.gate.weight": (moe.num_experts, hidden),
        f"{block}.experts.*.{gate}.weight": (f, hidden), f"{block}.experts.*.{up}.weight": (f, hidden),
        f"{block}.experts.*.{down}.weight": (hidden, f),
        "mlp.shared_expert.gate_proj.weight": (s, hidden), "mlp.shared_expert.up_proj.weight": (s, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, s), "mlp.shared_expert_gate.weight": (1, hidden),
    }.get(suffix)
