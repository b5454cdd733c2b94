"""The trainer's forward-only passes: a per-token number of every sampled token, into the rows of the batch.

logprob_pass(chunks, mbs, store, ...)   logprobs (old, reference): every rank of the last stage
forward_pass(chunks, mbs, fn, store, ...)  any per-token number (logprobs, values): every rank, all rows

All ranks call both (megatron's schedule and the sums are collective).
"""

import torch

from common.rl.batch import scatter_tokens
from common.rl.logprobs import vocab_parallel_logprobs
from common.train import schedule


def logprob_pass(chunks, mbs, store, routes=None, *, vocab_size, tp_group, temperature, device):
    """Forward-only logprobs of every micro-batch into store[row] (last pipeline stage only);
    routes: a routing_replay.route_store that takes the pass's MoE routes; vocab_size: the model's;
    temperature: the sampling temperature the logits are divided by."""
    from megatron.core import parallel_state as mpu

    # filled without a host sync per micro-batch; + a spare row for the tails of packed passes
    on_device = torch.zeros(store.shape[0] + 1, store.shape[1], device=device)

    def loss_fn(mb, logits):
        logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], vocab_size, tp_group, temperature)
        scatter_tokens(on_device, mb, logprobs.float())  # (b, T_mb) back to the samples' rows
        return logprobs.sum() * 0, {}

    with torch.no_grad():
        schedule.run_micro_batches(chunks, mbs, loss_fn, forward_only=True, device=device, record_routes=routes)
    # each DP rank filled its own rows (each CP rank its columns): sum, so every rank has all rows
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    store.copy_(schedule.all_reduce_sum(on_device[:-1], group, device))


def forward_pass(chunks, mbs, per_token_fn, store, routes=None, *, device):
    """Forward-only per-token numbers (B, T[, ...]) of every micro-batch into store[row], on EVERY
    rank (token rewards, GAE and the logged statistics are computed everywhere): TP rank 0
    of each last pipeline stage writes its DP rank's rows, then a sum over all ranks (one
    writer per row: exact) gives every rank all rows. per_token_fn(mb, output) -> (b, T), output the
    model's (logits, or a critic's values). routes: a routing_replay.route_store that takes the pass's
    MoE routes."""
    from megatron.core import parallel_state as mpu

    tp_first = mpu.get_tensor_model_parallel_rank() == 0
    # filled without a host sync per micro-batch; + a spare row for the tails of packed passes
    on_device = torch.zeros(store.shape[0] + 1, *store.shape[1:], device=device)

    def loss_fn(mb, output):
        per_token = per_token_fn(mb, output)  # (b, T); TP collectives inside run on every TP rank
        if tp_first:
            scatter_tokens(on_device, mb, per_token.float())  # back to the samples' rows
        return per_token.sum() * 0, {}

    with torch.no_grad():
        schedule.run_micro_batches(chunks, mbs, loss_fn, forward_only=True, device=device, record_routes=routes)
    store.copy_(schedule.all_reduce_sum(on_device[:-1], None, device))
