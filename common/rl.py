"""RL math shared by train_grpo.py and train_ppo.py: pure functions on tensors.

Nothing here knows about models, engines or `args`; a flag reaches these functions as an
explicit keyword at the call site. Shapes: B sequences (rows), T response tokens (columns,
right-padded), V_local = this tensor-parallel rank's slice of the (padded) vocabulary.
`mask` is the (B, T) response mask: 1/True on tokens that count, 0/False on padding.

    vocab_parallel_logprobs  log pi(token) (+ entropy) from TP-sharded logits, no vocab gather
    masked_mean/sum/whiten   reductions over valid tokens only
    group_advantages         GRPO / Dr.GRPO advantages from per-sample rewards
    policy_loss              PPO clipped surrogate with DAPO's asymmetric clip (+ TIS weights)
    aggregate_loss           token_mean (DAPO) / seq_mean_token_mean (GRPO) /
                             seq_mean_token_sum_norm (Dr.GRPO), with global normalisers
    kl_penalty               k1 / k2 / k3 estimators of KL(pi || ref)
    truncated_is_weights     rollout-engine vs trainer mismatch correction (TIS)
    gae, value_loss, explained_variance   the PPO critic side
"""
import torch
import torch.distributed as dist

from common.fused import on_gpu_compiled

# -----------------------------------------------------------------------------
# Log-probabilities and entropy from vocab-parallel logits


def _tp_size_rank(tp_group):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


# The elementwise + reduction math over the (B, T, V_local) logits lives in three pure
# functions that common/fused.py compiles on a GPU into one or two kernels each: they read the
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
def _shard_grad(logits, local_target, target_weight, max_x, log_z, grad_logprobs, grad_entropy, mean_x,
                n_valid: int, temperature: float):
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
        # common/model.py's GPTModel hands over its logits as a (B, T, V) view of the (T, B, V)
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
        grad_logits = _shard_grad(logits, local_target, target_weight, max_x, log_z, grad_logprobs,
                                  grad_entropy, mean_x, ctx.n_valid, ctx.temperature)
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


# -----------------------------------------------------------------------------
# Masked reductions


def masked_sum(x, mask, dim=None):
    """Sum of x over positions where mask != 0 (mask may hold float weights). Positions outside
    the mask are excluded even if they hold inf/nan (e.g. logprobs of padding)."""
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def sequence_sums(x, mask, seq_ids=None):
    """Per-sequence masked sums of x (B, T): over each row (B,), or, for packed rows where one
    row holds several samples, over the tokens of each id in seq_ids (B, T) (ids < B*T; one
    entry per possible id, 0 where the id is unused)."""
    if seq_ids is None:
        return masked_sum(x, mask, dim=-1)
    mask = mask.to(x.dtype)
    values = torch.where(mask != 0, x * mask, torch.zeros_like(x)).reshape(-1)
    return torch.zeros(values.numel(), dtype=x.dtype, device=x.device).index_add_(0, seq_ids.reshape(-1), values)


def masked_mean(x, mask, dim=None):
    """Mean of x over valid positions; 0 (not nan) where nothing is valid."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


def masked_whiten(x, mask, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over valid positions; 0 on masked positions.

    Population variance (divide by the count, not count - 1): whitening standardises the
    values we have, and the choice only rescales by sqrt(n / (n - 1)) ~ 1 for token counts.
    Statistics are local to this tensor (this rank's batch), as in most PPO implementations.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


# -----------------------------------------------------------------------------
# Advantages


def group_advantages(rewards, group_size, normalize_std=True, eps=1e-6):
    """GRPO's group-relative advantage, one scalar per sample (DeepSeekMath, Shao et al. 2024, 4.1.2):
        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     normalize_std=True  (GRPO)
        A_i =  r_i - mean(r_group)                             normalize_std=False (Dr.GRPO)
    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the std because it
    up-weights prompts that are nearly always right or wrong (a difficulty bias).

    rewards: (N,) with N = num_prompts * group_size, prompt-major (all samples of prompt 0, then
    prompt 1, ...), as the rollout engine returns them. Returns (N,) advantages, rewards' dtype.

    std is the population std (divide by G, no Bessel correction): we standardise the G samples
    we have rather than estimate a variance, which gives each non-constant group exactly unit
    mean-square advantage and stays defined for G = 1 (the unbiased std of one sample is nan).
    Implementations with torch.std's default (unbiased) differ by a factor sqrt((G - 1) / G),
    i.e. only a slightly different effective learning rate. A group with equal rewards gets 0.
    Computed in float64: (r - mean) of equal fp32 rewards can be ~1e-8 instead of 0, which
    dividing by eps = 1e-6 would blow up into a spurious advantage.
    """
    grouped = rewards.to(torch.float64).view(-1, group_size)  # (num_prompts, G)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1).to(rewards.dtype)


@torch.no_grad()
def gae(rewards, values, mask, gamma=1.0, lam=1.0):
    """Generalized Advantage Estimation (Schulman et al. 2015, "High-Dimensional Continuous
    Control Using GAE"), backwards over each row's valid tokens:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
    where "next" is the next VALID token of the row; after the last valid token the episode has
    ended, so V_next = A_next = 0. Masked positions inside a row (e.g. tool output in a
    multi-turn rollout) are skipped, not treated as the end of the episode.

    rewards, values, mask: (B, T), right-padded; rewards must sit on valid tokens (usually the
    score on the last one, and -beta * KL on every one). Returns (advantages, returns), (B, T),
    detached, 0 on masked positions; returns = advantages + values are the critic's targets.
    """
    valid = mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # a masked position leaves the carried (next_value, next_adv) untouched
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        advantages[:, t] = torch.where(valid[:, t], adv_t, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


# -----------------------------------------------------------------------------
# Policy loss and its aggregation


def policy_loss(logprobs, old_logprobs, advantages, clip_low=0.2, clip_high=0.2, is_weights=None, dual_clip=0.0,
                sequence_mask=None, seq_ids=None, cp_group=None):
    """PPO clipped surrogate (Schulman et al. 2017), per token, to be minimised:
        loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A),  ratio = pi / pi_old
    clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025, e.g. 0.2 / 0.28): it lets
    low-probability tokens with A > 0 grow further, against entropy collapse.
    dual_clip = c > 1 (dual-clip PPO, Ye et al. 2020; verl's default c = 3): for A < 0 the loss
    is also capped at -c * A, so a huge ratio on a bad token cannot make an unbounded step.
    sequence_mask (B, T): the importance ratio is GSPO's (Zheng et al. 2025) sequence-level one,
        s_i = exp(mean over the row's masked tokens of (logprob - old_logprob)),
    clipped per sequence; in the per-token form of the paper (GSPO-token) every token of row i
    gets the ratio sg(s_i) * pi(y_t) / sg(pi(y_t)): value s_i, gradient s_i * grad log pi(y_t).
    With per-sequence advantages and seq_mean_token_mean aggregation this is GSPO's gradient.
    seq_ids (B, T): the sequence of each token where rows are packed (sequence_sums).
    cp_group: context parallelism (common/batch.py:context_parallel_slice), where this call sees
    only its rank's chunks of every sequence: the sequences' log-ratio sums and token counts are
    summed over the group, so s_i is the whole sequence's, the same on every CP rank. They are
    detached (s_i enters as sg(s_i)), so the sum needs no backward: each rank's gradient is
    s_i * grad log pi of its own tokens. All ranks of cp_group call this, in the same order.
    The paper's clip range is tiny, as a sequence ratio moves little: clip_low 3e-4, clip_high 4e-4.

    logprobs (B, T) with grad; old_logprobs (B, T); advantages (B,) (one per sequence, GRPO) or
    (B, T) (per token, PPO/GAE). is_weights: optional (B, T) truncated importance weights
    (truncated_is_weights), multiplied in detached.
    Returns (per_token_loss (B, T), clipped (B, T) bool): clipped marks tokens where the clipped
    branch was taken, i.e. got no gradient (mean over valid tokens = the clip_frac metric).
    Reduce per_token_loss with aggregate_loss.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1) broadcasts over tokens
    log_ratio = logprobs - old_logprobs  # (B, T)
    if sequence_mask is not None:  # GSPO: the sequence's mean log-ratio, its gradient per token
        # (2, B) per row, or (2, B*T) per packed sample id: sums of log-ratios and token counts
        sums = torch.stack([sequence_sums(log_ratio.detach(), sequence_mask, seq_ids),
                            sequence_sums(torch.ones_like(log_ratio), sequence_mask, seq_ids)])
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(sums, group=cp_group)  # the other ranks' chunks of the same sequences
        ratios = sums[0] / sums[1].clamp(min=1)
        seq_log_ratio = ratios[:, None] if seq_ids is None else ratios[seq_ids]  # back on the tokens
        log_ratio = seq_log_ratio + logprobs - logprobs.detach()
    # log-ratio capped at 20 (ratio 5e8): exp overflowing to inf would turn a zero gradient
    # through min() into 0 * inf = nan. Such a ratio is clipped (A > 0) or pathological anyway.
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # (B, T)
    surr = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped = surr_clipped < surr  # strictly smaller: min() picks the clipped, flat branch
    loss = -torch.minimum(surr, surr_clipped)
    if dual_clip:
        bound = -dual_clip * advantages  # > 0 where A < 0
        capped = (advantages < 0) & (loss > bound)
        loss = torch.where(capped, bound.expand_as(loss), loss)
        clipped = clipped | capped
    if is_weights is not None:
        loss = loss * is_weights.detach()
    return loss, clipped


def aggregate_loss(per_token, mask, mode, num_tokens=None, num_seqs=None, max_len=None, seq_ids=None,
                   seq_counts=None):
    """Reduce a (B, T) per-token loss to a scalar; `mode` is one of:
        "token_mean"              sum of all valid token losses / num_tokens        (DAPO)
        "seq_mean_token_mean"     mean over each row's valid tokens, then / num_seqs (GRPO)
        "seq_mean_token_sum_norm" each row's sum / max_len, then / num_seqs        (Dr.GRPO)
    GRPO's per-sequence mean lets long sequences count less per token (a length bias, Liu et
    al. 2025); DAPO and Dr.GRPO weight every token alike.

    Contract with micro-batches and data parallelism. The normalisers are GLOBAL constants of
    the optimizer step's mini-batch, so the returned value is this micro-batch's SHARE of the
    mini-batch loss L, and the shares of all micro-batches on all DP ranks SUM to L:
        num_tokens: valid tokens of the whole mini-batch (all micro-batches, all DP ranks),
                    e.g. all_reduce(sum of mask.sum() over my micro-batches, dp_group);
        num_seqs:   rows of the whole mini-batch (all micro-batches, all DP ranks),
                    counting rows with no valid token;
        max_len:    one constant for every micro-batch, the generation budget (max new tokens),
                    not the padded width of this micro-batch.
    Defaults (None) are this call's local values (mask.sum(), B, T): right for a single batch.
    seq_ids (B, T): packed rows (common/batch.py:packed_micro_batches), where a sequence is
    the tokens of one id, not a row; pass num_seqs and max_len explicitly then.
    seq_counts: each sequence's valid tokens when this call sees only part of it (context
    parallelism: common/batch.py:context_parallel_slice), for seq_mean_token_mean: (B,) per
    row, or with seq_ids one entry per id as sequence_sums' result.
    Summing the shares over micro-batches then gives each rank Sum_k L_k, and SUMMING gradients
    over DP ranks would give grad L. Megatron undoes part of that, so the caller rescales:
      - megatron DDP averages gradients over the DP group (divides by dp_size, unless
        DDPConfig/TransformerConfig.calculate_per_token_loss): multiply by dp_size;
      - megatron's forward_backward_func also divides a loss_func's 2-tuple (loss, metrics)
        output by num_microbatches: multiply by num_microbatches too.
    So a loss_func inside forward_backward_func returns
        aggregate_loss(...) * num_microbatches * dp_size
    and a hand-written loop calling loss.backward() per micro-batch under megatron DDP uses
        aggregate_loss(...) * dp_size.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(per_token, mask) / num_tokens
    num_seqs = per_token.shape[0] if num_seqs is None else num_seqs
    seq_sums = sequence_sums(per_token, mask, seq_ids)  # (B,), or one per possible id
    if mode == "seq_mean_token_mean":
        counts = sequence_sums(torch.ones_like(per_token), mask, seq_ids) if seq_counts is None \
            else seq_counts.to(per_token.dtype)  # valid tokens per sequence
        seq_losses = seq_sums / counts.clamp(min=1)  # a sequence with no valid token adds 0
    elif mode == "seq_mean_token_sum_norm":
        seq_losses = seq_sums / (per_token.shape[1] if max_len is None else max_len)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    return seq_losses.sum() / num_seqs


# -----------------------------------------------------------------------------
# KL and importance weights


def kl_penalty(logprobs, ref_logprobs, kind):
    """Per-token estimators of KL(pi || ref) from tokens sampled from pi (J. Schulman,
    "Approximating KL Divergence", 2020), with log r = log ref - log pi:
        "k1": -log r                    unbiased, high variance, can be negative
        "k2": 0.5 * (log r)^2           biased (low when pi ~ ref), low variance, >= 0
        "k3": (r - 1) - log r           unbiased, low variance, >= 0 (GRPO's choice)
    logprobs, ref_logprobs: (B, T). Returns (B, T). Differentiable w.r.t. both.
    """
    log_ratio = ref_logprobs - logprobs  # log r = log q/p, (B, T)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}, expected 'k1', 'k2' or 'k3'")


def truncated_is_weights(old_logprobs, rollout_logprobs, cap=2.0):
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): the rollout engine (vLLM, other kernels, bf16) samples
    from pi_rollout, not exactly the trainer's pi_old; reweight each token by
        w = min(pi_old / pi_rollout, cap)
    truncated at `cap` to bound the variance. (B, T) in, (B, T) detached weights out.
    """
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


# -----------------------------------------------------------------------------
# Critic (PPO)


def value_loss(values, old_values, returns, mask, clip=0.2):
    """PPO's clipped value loss (as in OpenAI baselines' ppo2), per token:
        0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)
    values (B, T) with grad; old_values, returns (B, T) from the rollout; mask (B, T).
    Returns (per_token_loss (B, T), 0 on masked positions; clipped (B, T) bool: the clipped
    term was the larger one, i.e. the vf_clip_frac metric). Reduce with aggregate_loss.
    """
    values_clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    valid = mask.bool()
    loss = torch.where(valid, 0.5 * torch.maximum(loss_unclipped, loss_clipped), 0.0)
    return loss, (loss_clipped > loss_unclipped) & valid


@torch.no_grad()
def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, 0 no better than a
    constant, < 0 worse. nan when the returns have zero variance. Returns a Python float."""
    values, returns = values.double(), returns.double()

    def var(x):
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    var_returns = var(returns)
    if var_returns == 0:
        return float("nan")
    return float(1.0 - var(returns - values) / var_returns)
