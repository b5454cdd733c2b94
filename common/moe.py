"""Mixture-of-Experts layers without TransformerEngine: the router, grouped experts, expert load.

megatron-core 0.16.1's MoELayer (TopKRouter -> token dispatcher -> experts -> combine)
is used as it is; its layer spec takes two modules of ours:
  Router          TopKRouter whose gating is a plain matmul. megatron's own gating calls
                  `te_general_gemm`, a name its moe_utils.py defines only when TE imports,
                  so without TE (GPU or CPU) the first MoE forward dies with a NameError.
                  It also counts the tokens routed to each expert during updates, for
                  the expert-load metrics (expert_load_metrics).
  GroupedExperts  megatron's SequentialMLP (same parameters, names and checkpoint layout:
                  `experts.local_experts.{j}.linear_fc1/fc2`) whose forward on a GPU runs all
                  local experts in two grouped GEMMs (torch._grouped_mm) instead of a Python
                  loop over experts; elsewhere (CPU, fp32) the loop runs unchanged.
                  tests/gpu/test_moe_gpu.py checks the two equal; bench/moe.py times them.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter


class Router(TopKRouter):
    """TopKRouter with a TE-free gating and a per-expert token count (see the module docstring)."""

    tokens_per_expert = None  # (E,) float32, summed over the update passes since the last read

    def gating(self, input):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)  # (S, B, E) logits

    def routing(self, logits, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)  # routing_map: (tokens, E) bool
        if torch.is_grad_enabled():  # the update's passes, not the logprob passes
            counts = routing_map.sum(0, dtype=torch.float32).detach()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        return probs, routing_map


def _grouped_mm_usable(weight, num_local_experts):
    return (weight.is_cuda and weight.dtype == torch.bfloat16 and num_local_experts > 1
            and hasattr(torch, "_grouped_mm"))


class GroupedExperts(SequentialMLP):
    """SequentialMLP with its local experts run as two grouped GEMMs on a GPU.

    Tokens arrive sorted by local expert (tokens_per_expert[j] rows for expert j). The
    expert weights are stacked per forward, (E_local, 2F, H) and (E_local, H, F): one copy
    of this layer's expert weights, freed after the layer's backward; the parameters stay
    the per-expert tensors of SequentialMLP, so checkpoints, the bridge and the weight sync
    are the same as without grouping. With expert TP (etp > 1) each rank multiplies its
    slice; the dispatcher reduces the partial sums, as for SequentialMLP.
    """

    grouped = True  # False: always the per-expert loop (bench/moe.py compares the two)

    def forward(self, hidden, tokens_per_expert, probs):
        fc1 = self.local_experts[0].linear_fc1.weight
        if not (self.grouped and _grouped_mm_usable(fc1, self.num_local_experts)
                and not self.config.moe_apply_probs_on_input and self.config.gated_linear_unit
                and self.config.activation_func is F.silu and not self.config.add_bias_linear):
            return super().forward(hidden, tokens_per_expert, probs)
        ends = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)  # (E_local,) row ends
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # (E, 2F/etp, H)
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # (E, H, F/etp)
        h = torch._grouped_mm(hidden, w1.transpose(1, 2), offs=ends)  # (N, 2F/etp)
        gate, up = h.chunk(2, dim=-1)
        h = (F.silu(gate) * up * probs.unsqueeze(-1)).to(hidden.dtype)  # weighted by the router's probs
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=ends), None  # (N, H), no bias


def routers(chunks):
    """Every Router of the model chunks (this rank's MoE layers), with its global layer index."""
    from common.model import unwrap

    found = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if isinstance(router, Router):
                found.append((layer.layer_number - 1, router))
    return found


def expert_load_metrics(chunks, num_layers, num_experts, device):
    """Expert-load summary of the tokens routed during the update passes since the last call.

    All ranks call this (one all-reduce over the world). Per MoE layer, load = max over
    experts of the routed tokens / their mean (1.0 = perfectly balanced, E / topk = one
    expert takes every token). Returns {moe_load_max, moe_load_mean}: the worst and the
    average layer. Counts include padding positions of the micro-batches.
    """
    counts = torch.zeros(num_layers, num_experts, device=device)  # (L, E), this rank's layers filled
    for layer, router in routers(chunks):
        if router.tokens_per_expert is not None:
            counts[layer] += router.tokens_per_expert.to(device)
            router.tokens_per_expert = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)  # DP ranks add their tokens; TP/CP copies scale every expert alike
    used = counts.sum(1) > 0
    if not used.any():
        return {}
    load = counts[used].max(1).values / counts[used].mean(1)
    return {"moe_load_max": load.max().item(), "moe_load_mean": load.mean().item()}


def aux_loss_metric(num_micro_batches):
    """The load-balancing loss (without its coefficient) summed over MoE layers and averaged over
    the update's micro-batches, as megatron tracked it since the last call; all ranks call this
    (its reductions). {} when the aux loss is off."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" not in tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
    value = tracker["load_balancing_loss"]["values"].sum().item() / max(num_micro_batches, 1)
    moe_utils.clear_aux_losses_tracker()
    return {"moe_aux_loss": value}
