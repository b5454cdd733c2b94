"""Mixture-of-Experts layers without TransformerEngine: token dispatch and expert load.

megatron-core 0.16.1's MoELayer (TopKRouter -> token dispatcher -> experts -> combine)
is used as it is; its layer spec takes two modules of ours:
  Router          common/model/moe_router.py: TopKRouter with a TE-free gating, its routing
                  compiled on a GPU, and the tokens routed to each expert counted during
                  updates, for the expert-load metrics (step_metrics).
  GroupedExperts  common/model/moe_experts.py: megatron's SequentialMLP (same parameters, names
                  and checkpoint layout) whose local experts run as two grouped GEMMs.
and build_model gives its all-gather token dispatcher (EP=1, or --moe-dispatcher allgather
at EP > 1, where the scripts give every EP rank's pass i the same token count:
batch.micro_batches(same_tokens=True)),
where no token is dropped, DeviceSortDispatcher (sort_tokens_on_device): tokens sorted by
expert on the device, where megatron's dispatcher waits for the device three times per layer
and pass (the expert counts to the host, two masked_selects).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe import moe_layer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from common.model.moe_experts import GroupedExperts
from common.model.moe_router import Router
from common.rl.fused import on_gpu_compiled


class DeviceSortDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher without host waits: tokens sorted by expert on the device.

    Every token goes to exactly top-k experts (no capacity, no dropping), so the (token,
    expert) pairs of the gathered routing map number tokens x top-k, known on the host. A
    stable sort of the map, expert-major with tokens ascending, puts them in the order of
    megatron's masked_select; the map's columns are first rolled so that this rank's experts
    come first. With every expert local (EP=1) all rows are this rank's: megatron's rows,
    probs and results exactly. With EP > 1 this rank's pairs are the first rows and the rest
    are other ranks' (the tail, GroupedExperts.mask_tail), and the counts per expert stay on
    the device (GroupedExperts takes them there), where megatron's dispatcher sends them to
    the host and selects rows by mask (two waits per layer and pass). The tail rows are
    computed by no GEMM and get probability 0 (a spare zero through F.embedding's padding_idx,
    whose backward drops their gradients).

    The permutation and the combine are gathers (_Permute, _Unpermute), both ways: each token's
    top-k rows are found by one stable argsort of the rows' tokens (`order`), so the combine
    and the permutation's backward sum each token's k rows in one pass (gather_rows_sum: the
    tail's rows, never written by a GEMM, masked in the same pass) and the combine's backward
    and the permutation's forward are row gathers. megatron's combine scatter-adds the rows
    into the tokens (atomic adds over the whole tokens x EP x top-k buffer, then its backward
    is a gather); F.embedding's backward sorted the rows again. The sums come out in the same
    order as megatron's (each token's rows in expert order), in fp32 on a CPU the same bits;
    in bf16 each token's sum is rounded once instead of after every add. (Masking the buffer
    out of place, in and out, forward and backward, took 9% of the EP=2 step's device time;
    combining the tail into one spare token made the step slower: 32k rows of atomic adds
    into one row.) Then megatron's reduce-scatter over EP.
    """

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape
        first, count = self.local_expert_indices[0], self.num_local_experts
        if first:  # columns rolled: this rank's experts first
            probs = probs.roll(-first, dims=1)
        experts = getattr(self, "grouped_experts", None)  # set by device_sorted
        descending = experts is not None and experts.order_descending()
        picks, token, self.order, self.keep, tokens_per_expert = permuted_rows(
            self.routing_map, first, count, self.config.moe_router_topk, descending
        )
        if experts is not None:
            experts.rows_descending = descending  # for this pass's GEMMs
        self.routing_map = None
        self.reversed_local_input_permutation_mapping = token
        probs = probs.T.reshape(-1)  # expert-major, as the routing map's pairs
        if count == self.config.num_moe_experts:
            self.local_probs = probs.index_select(0, picks)
        else:  # the tail's picks point past the end: probability 0, no gradient (padding_idx)
            self.local_probs = F.embedding(picks, torch.cat([probs, probs.new_zeros(1)])[:, None], len(probs))[:, 0]
        return _Permute.apply(hidden_states, token, self.order, self.keep), tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        """The experts' rows (weighted by their probs) summed per token: (tokens, hidden), before
        megatron's reduce-scatter over EP."""
        return _Unpermute.apply(hidden_states, self.reversed_local_input_permutation_mapping, self.order, self.keep)


@on_gpu_compiled
def permuted_rows(routing_map, first, count, topk, descending=False):
    """DeviceSortDispatcher's bookkeeping of one pass, from the (tokens, E) bool routing map of
    every EP rank's tokens; this rank's experts are first..first+count-1, every token has topk.
    The rows go by local expert, each expert's tokens ascending; descending: the last local
    expert's rows first (the order GroupedExperts reads the experts' weights in place).
    Returns
      picks              (tokens x topk,) each permuted row's pair, an index into the map read
                         expert-major with this rank's experts first; the tail's (other ranks'
                         pairs, EP > 1): past the end (tokens x E)
      token              (tokens x topk,) each row's token
      order, keep        (tokens, topk) each token's rows in expert order, and which are this
                         rank's (the tail's point at row 0)
      tokens_per_expert  (count,) rows per local expert, in the rows' order
    On a GPU one compiled function (eager: ~18 small kernels per layer and pass)."""
    if first:
        routing_map = routing_map.roll(-first, dims=1)
    num_tokens, num_experts = routing_map.shape
    if descending:
        routing_map = torch.cat([routing_map[:, :count].flip(1), routing_map[:, count:]], dim=1)
    flat = routing_map.T.reshape(-1).to(torch.uint8)  # expert-major
    picks = torch.sort(flat, descending=True, stable=True).indices[: num_tokens * topk]
    tokens_per_expert = routing_map[:, :count].sum(0)
    token = picks % num_tokens
    order = torch.argsort(token, stable=True).view(num_tokens, -1)
    if descending:  # each token's rows in ascending expert order again; picks into the unflipped map
        order = order.flip(1)
        column = picks // num_tokens
        picks = torch.where(column < count, (count - 1 - column) * num_tokens + token, picks)
    if count == num_experts:  # every expert here: every row is this rank's
        return picks, token, order, torch.ones_like(order, dtype=torch.bool), tokens_per_expert
    tail = torch.arange(picks.shape[0], device=picks.device) >= tokens_per_expert.sum()
    keep = ~tail[order]
    return (
        picks.masked_fill(tail, num_tokens * num_experts),
        token,
        order.masked_fill(~keep, 0),
        keep,
        tokens_per_expert,
    )


@on_gpu_compiled
def gather_rows_sum(rows, order, keep):
    """(R, H) rows -> (T, H): token t's sum of rows order[t, 0..k-1] where keep[t] (T, k) is True
    (the others count as zero, whatever they hold); fp32 accumulation, one rounding. On a GPU
    one kernel over (T, H) with k coalesced row loads per token (common/rl/fused.py; written as a
    reduction over k, inductor's kernel read the rows 4x slower)."""
    total = None
    for j in range(order.shape[1]):
        term = torch.where(keep[:, j, None], rows.index_select(0, order[:, j]), 0).float()
        total = term if total is None else total + term
    return total.to(rows.dtype)


class _Permute(torch.autograd.Function):
    """hidden (T, H) -> rows (R, H) = hidden[token]: each token copied to its k rows. Backward:
    each token's rows' gradients summed (gather_rows_sum over `order`; the tail rows', never
    written by the grouped GEMM's backward, left out by `keep`), where index_select's backward
    adds atomically and F.embedding's sorts."""

    @staticmethod
    def forward(ctx, hidden, token, order, keep):
        ctx.save_for_backward(order, keep)
        return hidden.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        order, keep = ctx.saved_tensors
        return gather_rows_sum(grad, order, keep), None, None, None


class _Unpermute(torch.autograd.Function):
    """rows (R, H) -> (T, H): each token's rows summed, the tail's left out (gather_rows_sum).
    Backward: every row gets its token's gradient (a gather; the tail rows' are read by no GEMM)."""

    @staticmethod
    def forward(ctx, rows, token, order, keep):
        ctx.save_for_backward(token)
        return gather_rows_sum(rows, order, keep)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None, None


def sort_tokens_on_device(chunks):
    """Give every MoE layer of these model chunks DeviceSortDispatcher where it applies: the
    all-gather dispatcher (EP=1, or --moe-dispatcher allgather), no
    capacity (no dropped tokens), and, unless this rank holds every expert, GroupedExperts
    (device_sort_possible). The dispatcher keeps its state and gains its methods (a subclass
    without state of its own: the class is swapped in place; megatron's TransformerLayer
    builds MoELayer with its own arguments only for MoELayer itself, so the layer spec keeps
    megatron's class). Returns the number of layers changed."""
    from common.model.chunks import unwrap

    changed = 0
    for chunk in chunks:
        for module in unwrap(chunk).modules():
            if (
                isinstance(module, moe_layer.MoELayer)
                and type(module.token_dispatcher) is MoEAllGatherTokenDispatcher
                and device_sort_possible(module)
            ):
                device_sorted(module.token_dispatcher, module)
                module.experts.mask_tail = module.num_local_experts < module.config.num_moe_experts
                changed += 1
    return changed


def device_sorted(dispatcher, layer):
    """megatron's all-gather dispatcher of this MoELayer made DeviceSortDispatcher in place, told
    the layer's GroupedExperts (whose weights' order it sorts the rows in). Returns it."""
    dispatcher.__class__ = DeviceSortDispatcher
    dispatcher.grouped_experts = layer.experts if isinstance(layer.experts, GroupedExperts) else None
    return dispatcher


def device_sort_possible(layer):
    """Whether DeviceSortDispatcher can serve this MoELayer: no capacity (no dropped tokens) and,
    unless every expert is on this rank, GroupedExperts (it skips the rows of other ranks'
    experts, on its grouped path or its loop; megatron's SequentialMLP cannot)."""
    partial = layer.num_local_experts < layer.config.num_moe_experts
    return layer.config.moe_expert_capacity_factor is None and (
        not partial or isinstance(layer.experts, GroupedExperts)
    )


def moe_padding_mask(model, valid):
    """megatron's padding_mask for one pass of this model chunk: True on the positions where
    `valid` (B, T; batch.pack_sequences) is False, which the routers then leave out of the
    load-balancing loss, the z-loss and the router-bias updates (megatron-core 0.16.1), and out
    of the expert-load counts (Router). None for a model without MoE layers or a pass without
    `valid`. The padding still flows through the experts like any token (its outputs are
    masked by the losses). With sequence parallelism megatron splits the mask over TP with
    the embedding, so a later pipeline stage gets its TP rank's part here."""
    from megatron.core import parallel_state as mpu

    from common.model.chunks import unwrap

    gpt = unwrap(model)
    if valid is None or not gpt.config.num_moe_experts:
        return None
    padding = ~valid.bool()
    if gpt.config.sequence_parallel and not gpt.pre_process:
        padding = padding.chunk(mpu.get_tensor_model_parallel_world_size(), dim=1)[mpu.get_tensor_model_parallel_rank()]
    return padding


def routers(chunks):
    """Every Router of the model chunks (this rank's MoE layers), with its global layer index."""
    from common.model.chunks import unwrap

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
                                    token): the worst layer, and the mean over layers. The
                                    padding of the micro-batches is not counted (moe_padding_mask).
      moe_aux_loss                  megatron's load-balancing loss without its coefficient,
                                    summed over MoE layers, per micro-batch (what
                                    --moe-aux-loss-coef multiplies); when the aux loss is on and
                                    aux (megatron tracks one value per layer for all models: PPO's
                                    actor and critic steps would mix)
      route_mismatch                under routing replay (common/model/routing_replay.py): of the
                                    (token, MoE layer) pairs the step's forward-only passes
                                    replayed (the old logprobs; PPO's critic values), the share
                                    where the router's own top-k would have chosen other experts
                                    (1 - router agreement; padding and tokens without a recorded
                                    route left out): with the rollout's routes, the engine's and
                                    the trainer's disagreement at the same weights
      route_mismatch_update         the same over the update passes, whose weights move after
                                    each optimizer step (the only number when GRPO skips the old
                                    pass: then its one update pass comes before any step)
    prefix: put before each name (the critic's: "critic_").
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe import moe_utils

    num_layers, num_experts = spec.num_layers, spec.moe.num_experts
    counts = torch.zeros(num_layers, num_experts, device=device)  # (L, E), this rank's layers filled
    passes = torch.zeros(1, device=device)
    replay = torch.zeros(4, device=device)  # (replayed pairs, of which the own top-k differs) x (forward-only, update)
    for layer, router in routers(chunks):
        if router.tokens_per_expert is not None:
            counts[layer] += router.tokens_per_expert.to(device)
            passes = torch.maximum(passes, torch.full_like(passes, router.passes))
        if router.replay_counts is not None:
            replay += router.replay_counts.to(device)
        router.tokens_per_expert, router.passes, router.replay_counts = None, 0, None
    tracker = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    aux_loss = tracker["values"].to(device).float().clone() if tracker else torch.zeros(num_layers, device=device)
    if tracker:
        moe_utils.clear_aux_losses_tracker()
    flat = torch.cat([counts.flatten(), aux_loss, replay])
    if dist.is_initialized() and dist.get_world_size() > 1:
        # sums: DP ranks add their tokens and losses, PP stages their layers, SP ranks their
        # partial losses and their tokens' routes; TP copies of the counts scale every expert alike
        dist.all_reduce(flat)
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)  # the same on every rank with an MoE layer
    counts, aux_loss = flat[: num_layers * num_experts].view(num_layers, num_experts), flat[-num_layers - 4 : -4]
    metrics = {
        f"{prefix}{name}": (pairs[1] / pairs[0]).item()
        for name, pairs in (("route_mismatch", flat[-4:-2]), ("route_mismatch_update", flat[-2:]))
        if pairs[0] > 0
    }
    used = counts.sum(1) > 0
    if not used.any():
        return metrics
    load = counts[used].max(1).values / counts[used].mean(1)
    metrics.update({f"{prefix}moe_load_max": load.max().item(), f"{prefix}moe_load_mean": load.mean().item()})
    if aux and (tracker or aux_loss.any()):
        # megatron's logged value: summed over layers, averaged over DP ranks and micro-batches
        metrics[f"{prefix}moe_aux_loss"] = (
            aux_loss.sum() / mpu.get_data_parallel_world_size() / passes.clamp(min=1)
        ).item()
    return metrics
