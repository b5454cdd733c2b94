"""megatron's pipeline schedule over micro-batches (common/rl/batch.py builds them), and the step around it.

run_micro_batches(...)           megatron's forward(-backward) schedule over micro-batches
train_step(...)                  zero grads, forward-backward, finite check, optimizer + scheduler step
all_reduce_sum(tensor, ...)      a sum over a process group, through the device
reduce_metrics(...)              per-micro-batch sums -> global means on every rank
"""

import torch
import torch.distributed as dist

from common.rl.batch import context_parallel_slice, packed_seq_params
from common.train.guard import check_finite_update


def run_micro_batches(model_chunks, micro_batches, loss_fn, forward_only, device, record_routes=None):
    """Run megatron's pipeline schedule (1F1B / interleaved / no-pipelining) over micro-batches.

    loss_fn(micro_batch, logits) -> (loss, metrics dict of scalar sums); it runs on the last
    pipeline stage only, with logits (B, T, V_padded/tp) of that micro-batch. megatron
    divides each returned loss by the number of micro-batches (and DDP averages gradients
    over data-parallel ranks): the caller's normaliser accounts for both.
    MoE routing replay (common/model/routing_replay.py): micro-batches with "routes" route
    every token to them; record_routes, a routing_replay.route_store, takes this rank's routes
    of the pass instead.
    Returns the list of metrics dicts (last pipeline stage; empty elsewhere).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from common.model import routing_replay
    from common.model.moe import moe_padding_mask

    cp_size = mpu.get_context_parallel_world_size()
    if cp_size > 1:  # this rank's part of every sequence; megatron's schedule divides seq_length by cp itself
        cp_rank = mpu.get_context_parallel_rank()
        micro_batches = [
            dict(context_parallel_slice(mb, cp_size, cp_rank), full_length=mb["tokens"].shape[1])
            for mb in micro_batches
        ]

    def forward_step(data_iterator, model):
        # from pageable host memory a "non_blocking" copy still waits for the GPU's queue to
        # drain first; from pinned memory it does not (the host keeps launching ahead). An
        # expand()ed tensor cannot be pinned as it is: contiguous() first (a no-op otherwise).
        mb = {
            k: (v.contiguous().pin_memory() if device.type == "cuda" else v).to(device, non_blocking=True)
            if torch.is_tensor(v)
            else v
            for k, v in next(data_iterator).items()
        }
        packed = packed_seq_params(mb)  # packed rows: attention confined to each sample
        extra = {"packed_seq_params": packed} if packed else {}
        padding = moe_padding_mask(model, mb.get("valid"))  # MoE: routing statistics without the padding
        if padding is not None:
            extra["padding_mask"] = padding
        if "routes" in mb:  # each token to its recorded experts (the router's gating weights stay its own)
            routing_replay.replay(model, mb)
        elif record_routes is not None:
            routing_replay.record(model)
        logits = model(mb["tokens"], mb["positions"], None, **extra)
        if record_routes is not None:
            routing_replay.store_recorded(model, mb, record_routes)
        return logits, lambda output: loss_fn(mb, output)

    # the pipeline schedules need one shape (micro_batches(same_length=True)); without a
    # pipeline every micro-batch may have its own length
    seq_length = max(mb.get("full_length", mb["tokens"].shape[1]) for mb in micro_batches)
    micro_batch_size = micro_batches[0]["tokens"].shape[0]
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches) for _ in model_chunks],  # one iterator per virtual stage
            model=model_chunks,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    finally:  # the routers route on their own again, the replayed targets freed
        routing_replay.finish(model_chunks)


def train_step(model_chunks, optimizer, scheduler, micro_batches, loss_fn, device, step=None, before_step=None):
    """One optimizer step over micro-batches: zero the DDP grad buffers and the optimizer's
    grads, forward-backward (run_micro_batches: DDP reduces the gradients at the end), a check
    that the loss and the gradients are finite (else guard.NonFiniteError naming `step`, and
    no update), the optimizer step (grad clipping inside) and one scheduler step. All ranks
    call this. before_step: called before the optimizer step (the scripts wait there for the
    optimizer state's reload, common/train/colocation.py Colocation.wait_optimizers).
    Returns (the metrics dicts of run_micro_batches, the grad norm; 0.0 where megatron
    reports none)."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = run_micro_batches(model_chunks, micro_batches, loss_fn, forward_only=False, device=device)
    check_finite_update(model_chunks, metrics, device, step)
    if before_step is not None:
        before_step()
    _, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    return metrics, grad_norm or 0.0


def all_reduce_sum(tensor, group, device):
    """Sum a tensor over a process group (through the device for NCCL); returns a CPU tensor (the
    input itself in a group of one)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    on_device = tensor.to(device)
    dist.all_reduce(on_device, group=group)
    return on_device.cpu()


def reduce_metrics(metric_dicts, device):
    """Global means of per-micro-batch metrics, on every rank. All ranks call this.

    Each metric arrives as a sum under 'name' and its count under 'name__n' (count 1 when
    absent). Sums and counts are added over micro-batches and over all ranks that hold
    any (the last pipeline stage of every data-parallel replica; TP rank 0 only, so TP
    replicas of the same numbers count once), then divided.
    """
    from megatron.core import parallel_state as mpu

    names = sorted({k for d in metric_dicts for k in d if not k.endswith("__n")})
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:  # ranks without a last stage hold no metrics: agree on the key set
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        names = sorted({n for ns in every for n in ns})
    totals = torch.zeros(2 * len(names), dtype=torch.float64)
    if mpu.get_tensor_model_parallel_rank() == 0:
        for d in metric_dicts:
            for i, name in enumerate(names):
                if name in d:
                    totals[2 * i] += float(d[name])
                    totals[2 * i + 1] += float(d.get(name + "__n", 1.0))
    if distributed:
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    return {name: (totals[2 * i] / totals[2 * i + 1].clamp(min=1)).item() for i, name in enumerate(names)}
