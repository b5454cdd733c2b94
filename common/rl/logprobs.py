"""Log-probabilities and entropy of sampled tokens from tensor-parallel logits, with no vocabulary gather.

    logprobs, entropy = vocab_parallel_logprobs(logits, targets, vocab_size, tp_group, temperature, compute_entropy)

logits: (B, T, V_local), this tensor-parallel rank's slice of the (padded) vocabulary; the
padding columns beyond vocab_size never count. The same quantity the rollout engines return
(common/rollout/engine.py): log_softmax(logits / temperature)[token] over the full vocabulary.
"""

import torch
import torch.distributed as dist

from common.rl.fused import on_gpu_compiled

# -----------------------------------------------------------------------------
# Log-probabilities and entropy from vocab-parallel logits

# --true-on-policy (common/model/exact.py bind): f(logits (..., V_padded or its TP shard), targets (...),
# vocab_size, tp_group or None) -> the rollout engine's own log-probabilities of targets, which replace the
# forward's values (temperature 1; the gradient stays this module's).
EXACT_TOKEN_LOGPROBS = None


def _tp_size_rank(tp_group):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


# The elementwise + reduction math over the (B, T, V_local) logits lives in three pure
# functions that common/rl/fused.py compiles on a GPU into one or two kernels each: they read the
# bf16 logits and keep fp32 values in registers instead of writing (B, T, V_local) fp32 copies
# (at 4096 tokens x 152k vocabulary one fp32 copy is 2.5 GB). On a CPU they run eagerly.


def _shifted(logits, max_x, temperature):
    """x - max over the shard, in fp32 (fp64 input stays fp64, for gradcheck)."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(compute_dtype) / temperature - max_x.unsqueeze(-1)


@on_gpu_compiled
def _shard_max(logits, n_valid: int, temperature: float):
    """(B, T, V_local) -> (B, T): max of logits / temperature over the shard's real columns
    ([n_valid:] is vocabulary padding; -inf on an all-padding shard, fixed by the all-reduce)."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    valid = torch.arange(logits.shape[-1], device=logits.device) < n_valid
    return torch.where(valid, logits.to(compute_dtype) / temperature, float("-inf")).amax(dim=-1)


@on_gpu_compiled
def _shard_sums(logits, max_x, n_valid: int, temperature: float, compute_entropy: bool):
    """(B, T, V_local) -> (2 or 3, B, T) partial sums over the shard's real columns, with
    x = logits / temperature - max: sum_j e^x_j, 0 (the target slot, filled by the caller) and,
    for the entropy, sum_j e^x_j * x_j."""
    x = _shifted(logits, max_x, temperature)
    valid = torch.arange(logits.shape[-1], device=logits.device) < n_valid
    exp_x = torch.where(valid, torch.exp(x), 0.0)  # 0 on padding (its logits are finite numbers)
    sums = [exp_x.sum(dim=-1), torch.zeros_like(max_x)]
    if compute_entropy:
        sums.append((exp_x * x).sum(dim=-1))
    return torch.stack(sums)


@on_gpu_compiled
def _shard_grad(
    logits,
    local_target,
    target_weight,
    max_x,
    log_z,
    grad_logprobs,
    grad_entropy,
    mean_x,
    n_valid: int,
    temperature: float,
):
    """d loss / d logits on the shard, in the logits' dtype (see _VocabParallelLogprobs):
        grad_x_j = -p_j * (g_logp + g_H * (x_j - E_p[x])) + g_logp * 1[j == target]
    target_weight is g_logp where the target is in this shard, else 0; grad_entropy None: no H term."""
    x = _shifted(logits, max_x, temperature)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    probs = torch.where(columns < n_valid, torch.exp(x - log_z.unsqueeze(-1)), 0.0)  # p = softmax(x), (B, T, V_local)
    coef = grad_logprobs.unsqueeze(-1)
    if grad_entropy is not None:
        coef = coef + grad_entropy.unsqueeze(-1) * (x - mean_x.unsqueeze(-1))
    one_hot = torch.where(columns == local_target.unsqueeze(-1), target_weight.unsqueeze(-1), 0.0)
    return ((one_hot - probs * coef) / temperature).to(logits.dtype)


class _VocabParallelLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature)[target] and the softmax entropy, with the vocabulary
    split over the TP group. Every rank returns the same (B, T) values; only (B, T)-sized
    all-reduces cross the wire (a max, then one stacked sum), never the (B, T, V) logits.

    Backward needs no communication: with p = softmax(x), x = logits / temperature,
        d logp[target] / dx_j = 1[j == target] - p_j
        d H / dx_j            = -p_j (x_j - E_p[x])          (H = logZ - E_p[x])
    and p_j, E_p[x] follow from the local logits plus the saved (B, T) max / log Z / E_p[x].
    We save the input logits (already alive as the output layer's result) and recompute p,
    instead of keeping a (B, T, V_local) fp32 softmax, as megatron's vocab_parallel_cross_entropy
    does: the fused backward reads the logits once and writes the gradient once.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, tp_group, temperature, compute_entropy):
        # common/model/gpt.py's GPTModel hands over its logits as a (B, T, V) view of the (T, B, V)
        # tensor megatron computes (no transposing copy): work in that memory order, and give
        # the gradient back in it, so the output layer's backward needs no copy either.
        ctx.time_major = logits.dim() == 3 and logits.stride(0) < logits.stride(1)
        if ctx.time_major:
            # the (T, B) tensors contiguous too: elementwise results follow their inputs' layout
            logits, targets = logits.transpose(0, 1), targets.transpose(0, 1).contiguous()  # (T, B, V), (T, B)
        tp_size, tp_rank = _tp_size_rank(tp_group)
        v_local = logits.shape[-1]
        vocab_start = tp_rank * v_local
        # columns [n_valid:] of this shard are vocabulary padding (global id >= vocab_size):
        # probability 0. A rank can be all padding (n_valid = 0).
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        ctx.set_materialize_grads(False)  # an unused entropy output gets grad None, not zeros

        max_x = _shard_max(logits, n_valid, temperature)  # (B, T)
        if tp_size > 1:
            dist.all_reduce(max_x, op=dist.ReduceOp.MAX, group=tp_group)
        sums = _shard_sums(logits, max_x, n_valid, temperature, compute_entropy)  # (2 or 3, B, T)
        # the target logit lives on exactly one rank; the others contribute 0 to the sum
        in_shard = (targets >= vocab_start) & (targets < vocab_start + v_local)  # (B, T)
        local_target = (targets - vocab_start).clamp(0, v_local - 1)
        target_x = _shifted(logits.gather(-1, local_target.unsqueeze(-1)), max_x, temperature)  # (B, T, 1)
        sums[1] = target_x.squeeze(-1).masked_fill(~in_shard, 0.0)
        if tp_size > 1:  # one all-reduce for all sums
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp, target_x = sums[0], sums[1]
        log_z = torch.log(sum_exp)  # log-partition of the shifted logits, (B, T)
        logprobs = target_x - log_z  # (B, T)
        if EXACT_TOKEN_LOGPROBS is not None and temperature == 1.0:
            logprobs = EXACT_TOKEN_LOGPROBS(logits, targets, vocab_size, tp_group if tp_size > 1 else None)

        ctx.n_valid, ctx.temperature = n_valid, temperature
        mean_x = sums[2] / sum_exp if compute_entropy else None  # E_p[x - max], (B, T)
        ctx.save_for_backward(logits, local_target, in_shard, max_x, log_z, mean_x)
        entropy = log_z - mean_x if compute_entropy else None  # H = -sum p log p = log Z - E_p[x]
        if ctx.time_major:  # (T, B) -> (B, T) views
            logprobs, entropy = logprobs.transpose(0, 1), entropy.transpose(0, 1) if compute_entropy else None
        return (logprobs, entropy) if compute_entropy else logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, local_target, in_shard, max_x, log_z, mean_x = ctx.saved_tensors
        compute_dtype = max_x.dtype
        if ctx.time_major:  # (B, T) grads -> the (T, B) order of the saved tensors
            grad_logprobs = grad_logprobs.transpose(0, 1).contiguous() if grad_logprobs is not None else None
            grad_entropy = grad_entropy.transpose(0, 1).contiguous() if grad_entropy is not None else None
        if grad_logprobs is None:  # only the entropy is used
            grad_logprobs = torch.zeros_like(max_x)
        grad_logprobs = grad_logprobs.to(compute_dtype)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(compute_dtype)
        target_weight = grad_logprobs * in_shard
        grad_logits = _shard_grad(
            logits,
            local_target,
            target_weight,
            max_x,
            log_z,
            grad_logprobs,
            grad_entropy,
            mean_x,
            ctx.n_valid,
            ctx.temperature,
        )
        if ctx.time_major:
            grad_logits = grad_logits.transpose(0, 1)  # (B, T, V) view of (T, B, V) memory, as the input
        return grad_logits, None, None, None, None, None


def vocab_parallel_logprobs(logits, targets, vocab_size, tp_group=None, temperature=1.0, compute_entropy=False):
    """Per-token log-probabilities (and entropies) from this TP rank's vocabulary shard.

    logits:  (B, T, V_local) megatron's parallel_output=True logits: TP rank r holds vocab columns
             [r * V_local, (r + 1) * V_local) of a vocabulary padded to tp * V_local >= vocab_size.
    targets: (B, T) int64 global token ids, all < vocab_size (fill padded positions with any real
             id, e.g. 0, and mask them out later: a padding id would give -inf).
    Returns (logprobs (B, T), entropy (B, T) or None), fp32 (or fp64), identical on every TP rank:
        log_softmax(full_logits[..., :vocab_size] / temperature).gather(targets), and its entropy.
    Differentiable w.r.t. logits (both outputs; the entropy is used as a bonus in losses).
    All ranks of tp_group must call this; tp_group=None or a group of one communicates nothing.
    `temperature` must match the rollout sampler's so that pi_old == the sampling distribution.
    """
    out = _VocabParallelLogprobs.apply(logits, targets, vocab_size, tp_group, temperature, compute_entropy)
    return out if compute_entropy else (out, None)
