"""Routing replay: the trainer's MoE layers send each token to recorded experts (--routing-replay).

  rollout (R3, "rollout routing replay", Ma et al. 2025, arXiv:2510.11370): the rollout engine
          records the top-k experts of every token it ran, per MoE layer (common/rollout/routes.py);
          they ride with the samples as batch["routes"] (common/rl/batch.py) and every trainer pass
          (old and reference logprobs, the update, PPO's critic) routes each token to them.
  old     (R2): the old-logprob pass records its routes (record_into), the reference pass and the
          updates replay them.
Only the choice of experts is replayed: the gating weights of the chosen experts still come from
the current router logits (softmax of the chosen logits, or the chosen sigmoid scores without
DeepSeek-V3's bias, renormalised), so the router keeps its gradient.

megatron-core 0.16.1 does the replay itself: config.moe_enable_routing_replay (build_model's
override, common/run/flags.py moe_overrides) gives every router a
RouterReplay (transformer/moe/router_replay.py) whose target indices its top-k routing uses in
place of its own top-k (REPLAY_FORWARD; REPLAY_BACKWARD pops a queue for activation recomputation
inside the backward) and whose RECORD action keeps the top-k it computed. This module sets them
per pass and micro-batch; common/model/moe_router.py's Router fills the positions that have no
recorded route (-1: the last token of a sample, which the engine never ran; padding) with its
own top-k, counts the tokens whose own top-k differs (route_mismatch, common/model/moe.py), and
tells the forward from the recomputation in the backward.

Routes of a micro-batch: mb["routes"] (b, T, M, k) int16, M the model's MoE layers in order, -1
where none was recorded. A router sees its pass's tokens in megatron's (T, b) order, under
sequence parallelism its TP rank's T / tp of them, under context parallelism this rank's part
(common/rl/batch.py slices routes like every per-token tensor).

  replay(chunk, mb)               before chunk's forward of mb: its routers route to mb["routes"]
  record(chunk)                   before chunk's forward: its routers record their top-k
  store_recorded(chunk, mb, store)  after it: the recorded ids + 1 into store (N + 1, T, M, k)
  gathered_routes(store)          the stores of all ranks summed: (N, T, M, k) int16 routes
  finish(chunks)                  after a pass: replay and recording off, the targets dropped
"""

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplayAction


def _routers(chunk):
    """(MoE index m, router) of this chunk's MoE layers; m counts the model's MoE layers before it."""
    from common.model.moe import routers

    found = []
    for layer, router in routers([chunk]):
        found.append((sum(router.config.moe_layer_freq[:layer]), router))
    return found


def _sequence_slice(router, length):
    """The positions of a pass of `length` this rank's router sees: all, or under sequence
    parallelism its TP rank's contiguous T / tp (megatron scatters the sequence dimension)."""
    if not router.config.sequence_parallel:
        return slice(0, length)
    from megatron.core import parallel_state as mpu

    part = length // mpu.get_tensor_model_parallel_world_size()
    rank = mpu.get_tensor_model_parallel_rank()
    return slice(rank * part, (rank + 1) * part)


def replay(chunk, mb):
    """Route this chunk's MoE layers to mb["routes"] (b, T, M, k) in its next forward. In a
    pass with a backward and activation recomputation the targets also queue for the
    recomputation (RouterReplay's REPLAY_BACKWARD, first in first out: megatron's schedules run
    each chunk's backwards in the order of its forwards)."""
    routes = mb["routes"]
    for m, router in _routers(chunk):
        replayer = router.router_replay
        if replayer is None:
            raise ValueError("routes given to a model built without moe_enable_routing_replay")
        if routes.shape[2] <= m or routes.shape[3] != router.topk:
            raise ValueError(
                f"routes of {routes.shape[2]} MoE layers x top-{routes.shape[3]} for a model with top-{router.topk} "
                f"routers and MoE layer index {m}: recorded by another model?"
            )
        part = routes[:, _sequence_slice(router, routes.shape[1]), m]  # (b, S, k)
        # (S * b, k) in the router's token order; int64 for megatron's gather, a copy of our own
        # (Router fills its -1 entries in place)
        target = part.transpose(0, 1).reshape(-1, routes.shape[3]).to(torch.int64, copy=True)
        replayer.target_topk_idx = target
        if torch.is_grad_enabled() and router.config.recompute_granularity is not None:
            replayer.replay_backward_list.append(target)
        replayer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def record(chunk):
    """This chunk's routers keep the top-k of their next forward (RouterReplay's RECORD)."""
    for _, router in _routers(chunk):
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)


def token_positions(mb):
    """(rows, cols), both (b, T): where each token of a (context-parallel sliced) micro-batch sits
    in the batch's (N, T) layout; the padding of packed passes and the empty rows added to
    padded ones at row N (a spare row)."""
    if "src_row" in mb:  # packed, or a context-parallel slice
        return mb["src_row"], mb["src_col"]
    b, length = mb["tokens"].shape
    cols = torch.arange(length, device=mb["tokens"].device)
    return mb["row"][:, None].expand(b, length), cols.expand(b, length)


def store_recorded(chunk, mb, store):
    """After chunk's forward of mb under record(): each router's top-k ids + 1 into store
    (N + 1, T, M, k) int32 at the tokens' batch positions (0 stays where no rank recorded)."""
    rows, cols = token_positions(mb)
    for m, router in _routers(chunk):
        ids = router.router_replay.get_recorded_indices()  # (S * b, k), the router's token order
        part = _sequence_slice(router, rows.shape[1])
        r, c = rows[:, part].transpose(0, 1).reshape(-1), cols[:, part].transpose(0, 1).reshape(-1)
        store[r, c, m] = ids.to(store.dtype) + 1


def route_store(num_rows, seq_len, spec, device):
    """A zero store for store_recorded: (num_rows + 1, seq_len, MoE layers, top-k) int32 (the +1
    row takes the padding's routes). int32: NCCL has no int16 sum."""
    layers = sum(spec.moe.moe_layers)
    return torch.zeros(num_rows + 1, seq_len, layers, spec.moe.topk, dtype=torch.int32, device=device)


def gathered_routes(store):
    """Every rank's store summed (all ranks call this; each (token, layer) is routed by exactly one
    rank: data-parallel ranks hold other rows, context-parallel ranks other columns, sequence-
    parallel TP ranks other positions, pipeline stages other layers), as routes (N, T, M, k)
    int16 on the CPU, -1 where no rank recorded one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(store)
    return (store[:-1] - 1).to(torch.int16).cpu()


def finish(chunks):
    """After a pass: the routers route on their own again and drop the targets and records."""
    for chunk in chunks:
        for _, router in _routers(chunk):
            if router.router_replay is not None:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()
