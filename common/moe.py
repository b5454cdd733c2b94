"""Mixture-of-Experts layers without TransformerEngine: the router, grouped experts, expert load.

megatron-core 0.16.1's MoELayer (TopKRouter -> token dispatcher -> experts -> combine)
is used as it is; its layer spec takes two modules of ours:
  Router          TopKRouter whose gating is a plain matmul. megatron's own gating calls
                  `te_general_gemm`, a name its moe_utils.py defines only when TE imports,
                  so without TE (GPU or CPU) the first MoE forward dies with a NameError.
                  It also counts the tokens routed to each expert during updates, for
                  the expert-load metrics (step_metrics).
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
    passes = 0                # update (grad-enabled) forward passes since the last read

    def gating(self, input):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)  # (S, B, E) logits

    def routing(self, logits, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)  # routing_map: (tokens, E) bool
        if torch.is_grad_enabled():  # the update's passes, not the logprob passes
            counts = routing_map.sum(0, dtype=torch.float32).detach()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
            self.passes += 1
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Expert weights are megatron's "expert-parallel" parameters (not all-reduced over the
        # dense data-parallel group) at every EP size, EP=1 included, where megatron would
        # treat them as dense. The optimizer then always has its two parts (dense, experts),
        # so a training checkpoint's optimizer state has the same structure at every EP and
        # resumes at another one. The math is unchanged: at EP=1 the expert-data-parallel
        # group holds the same ranks.
        for param in self.parameters():
            param.allreduce = False
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


def step_metrics(chunks, spec, device, prefix="", aux=True):
    """The MoE metrics of the update passes since the last call; all ranks call this (its all-reduces).

      moe_load_max / moe_load_mean  per MoE layer, max over experts of the routed tokens / their
                                    mean (1.0 = balanced, E/topk = one expert takes every
                                    token): the worst layer, and the mean over layers. Counts
                                    include the padding positions of the micro-batches.
      moe_aux_loss                  megatron's load-balancing loss without its coefficient,
                                    summed over MoE layers, per micro-batch (what
                                    --moe-aux-loss-coef multiplies); when the aux loss is on and
                                    aux (megatron tracks one value per layer for all models: PPO's
                                    actor and critic steps would mix)
    prefix: put before each name (the critic's: "critic_").
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe import moe_utils

    num_layers, num_experts = spec.num_layers, spec.moe.num_experts
    counts = torch.zeros(num_layers, num_experts, device=device)  # (L, E), this rank's layers filled
    passes = torch.zeros(1, device=device)
    for layer, router in routers(chunks):
        if router.tokens_per_expert is not None:
            counts[layer] += router.tokens_per_expert.to(device)
            passes = torch.maximum(passes, torch.full_like(passes, router.passes))
        router.tokens_per_expert, router.passes = None, 0
    tracker = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    aux_loss = tracker["values"].to(device).float().clone() if tracker else torch.zeros(num_layers, device=device)
    if tracker:
        moe_utils.clear_aux_losses_tracker()
    flat = torch.cat([counts.flatten(), aux_loss])
    if dist.is_initialized() and dist.get_world_size() > 1:
        # sums: DP ranks add their tokens and losses, PP stages their layers, SP ranks their
        # partial losses; TP copies of the counts scale every expert alike
        dist.all_reduce(flat)
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)  # the same on every rank with an MoE layer
    counts, aux_loss = flat[:-num_layers].view(num_layers, num_experts), flat[-num_layers:]
    used = counts.sum(1) > 0
    if not used.any():
        return {}
    load = counts[used].max(1).values / counts[used].mean(1)
    metrics = {f"{prefix}moe_load_max": load.max().item(), f"{prefix}moe_load_mean": load.mean().item()}
    if aux and (tracker or aux_loss.any()):
        # megatron's logged value: summed over layers, averaged over DP ranks and micro-batches
        metrics[f"{prefix}moe_aux_loss"] = (aux_loss.sum() / mpu.get_data_parallel_world_size() / passes.clamp(min=1)).item()
    return metrics
