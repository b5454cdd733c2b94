"""RL losses shared by train_grpo.py and train_ppo.py: pure functions on tensors.

Nothing here knows about models, engines or `args`; a flag reaches these functions as an
explicit keyword at the call site. Shapes: B sequences (rows), T response tokens (columns,
right-padded). `mask` is the (B, T) response mask: 1/True on tokens that count, 0/False on padding.

    masked_sum/mean, sequence_sums/means   reductions over valid tokens only
    policy_loss              PPO clipped surrogate with DAPO's asymmetric clip (+ correction weights)
    aggregate_loss           token_mean (DAPO) / seq_mean_token_mean (GRPO) /
                             seq_mean_token_sum_norm (Dr.GRPO), with global normalisers
    kl_penalty               k1 / k2 / k3 estimators of KL(pi || ref)
    value_loss, explained_variance   the PPO critic side
Log-probabilities: common/rl/logprobs.py; advantages: common/rl/advantages.py; the off-policy
corrections' weights (TIS and others): common/rl/corrections.py.
"""

import torch
import torch.distributed as dist

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


def sequence_means(x, mask, seq_ids=None, cp_group=None):
    """Each token's sequence mean of x over mask, detached, (B, T): per row, or per id of seq_ids (packed rows,
    as sequence_sums); 0 for a sequence with no masked token. cp_group (context parallelism: this rank holds
    chunks of every sequence): the sums and counts are summed over the group first, so every rank gets the
    whole sequence's mean; all ranks of cp_group call this, in the same order."""
    x = x.detach()
    sums = torch.stack([sequence_sums(x, mask, seq_ids), sequence_sums(torch.ones_like(x), mask, seq_ids)])
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(sums, group=cp_group)  # the other ranks' chunks of the same sequences
    means = sums[0] / sums[1].clamp(min=1)
    return means[:, None].expand_as(x) if seq_ids is None else means[seq_ids]


def masked_mean(x, mask, dim=None):
    """Mean of x over valid positions; 0 (not nan) where nothing is valid."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


# -----------------------------------------------------------------------------
# Policy loss and its aggregation


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    clip_low=0.2,
    clip_high=0.2,
    is_weights=None,
    dual_clip=0.0,
    sequence_mask=None,
    seq_ids=None,
    cp_group=None,
):
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
    cp_group: context parallelism (common/rl/batch.py:context_parallel_slice), where this call sees
    only its rank's chunks of every sequence: the sequences' log-ratio sums and token counts are
    summed over the group, so s_i is the whole sequence's, the same on every CP rank. They are
    detached (s_i enters as sg(s_i)), so the sum needs no backward: each rank's gradient is
    s_i * grad log pi of its own tokens. All ranks of cp_group call this, in the same order.
    The paper's clip range is tiny, as a sequence ratio moves little: clip_low 3e-4, clip_high 4e-4.

    logprobs (B, T) with grad; old_logprobs (B, T); advantages (B,) (one per sequence, GRPO) or
    (B, T) (per token, PPO/GAE). is_weights: optional (B, T) weights of the off-policy corrections
    (common/rl/corrections.py: TIS and others), multiplied in detached.
    Returns (per_token_loss (B, T), clipped (B, T) bool): clipped marks tokens where the clipped
    branch was taken, i.e. got no gradient (mean over valid tokens = the clip_frac metric).
    Reduce per_token_loss with aggregate_loss.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1) broadcasts over tokens
    log_ratio = logprobs - old_logprobs  # (B, T)
    if sequence_mask is not None:  # GSPO: the sequence's mean log-ratio, its gradient per token
        # (2, B) per row, or (2, B*T) per packed sample id: sums of log-ratios and token counts
        sums = torch.stack(
            [
                sequence_sums(log_ratio.detach(), sequence_mask, seq_ids),
                sequence_sums(torch.ones_like(log_ratio), sequence_mask, seq_ids),
            ]
        )
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


def aggregate_loss(per_token, mask, mode, num_tokens=None, num_seqs=None, max_len=None, seq_ids=None, seq_counts=None):
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
    seq_ids (B, T): packed rows (common/rl/batch.py:packed_micro_batches), where a sequence is
    the tokens of one id, not a row; pass num_seqs and max_len explicitly then.
    seq_counts: each sequence's valid tokens when this call sees only part of it (context
    parallelism: common/rl/batch.py:context_parallel_slice), for seq_mean_token_mean: (B,) per
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
        counts = (
            sequence_sums(torch.ones_like(per_token), mask, seq_ids)
            if seq_counts is None
            else seq_counts.to(per_token.dtype)
        )  # valid tokens per sequence
        seq_losses = seq_sums / counts.clamp(min=1)  # a sequence with no valid token adds 0
    elif mode == "seq_mean_token_sum_norm":
        seq_losses = seq_sums / (per_token.shape[1] if max_len is None else max_len)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    return seq_losses.sum() / num_seqs


# -----------------------------------------------------------------------------
# KL


def policy_metrics(loss, entropy, clipped, drift, mask, num_tokens, *, first=False):
    """A micro-batch's metrics of the policy loss, as sums with their counts (key__n; the update's mean over all
    micro-batches and ranks is their ratio): the loss (weighed by its share of the mini-batch's num_tokens), the
    entropy, the share of tokens clipped, ppo_kl = the mean of drift (old - new logprobs) and, first (before the
    step's first optimizer step, where old = new but for rounding), first_update_logprob_err = its mean |drift|."""
    n = mask.sum()
    metrics = {
        "policy_loss": loss.detach(),
        "policy_loss__n": n / num_tokens,
        "entropy": masked_sum(entropy.detach(), mask),
        "entropy__n": n,
        "clip_frac": masked_sum(clipped.float(), mask),
        "clip_frac__n": n,
        "ppo_kl": masked_sum(drift, mask),
        "ppo_kl__n": n,
    }
    if first:
        metrics.update(first_update_logprob_err=masked_sum(drift.abs(), mask), first_update_logprob_err__n=n)
    return metrics


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


# -----------------------------------------------------------------------------
# Critic (PPO)


def value_loss(values, old_values, returns, mask, clip=0.2):
    """PPO's clipped value loss (as in OpenAI baselines' ppo2), per token:
        0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)
    values (B, T) with grad; old_values, returns (B, T) from the rollout; mask (B, T).
    Returns (per_token_loss (B, T), 0 on masked positions; clipped (B, T) bool: V was outside
    the range and the clipped term the larger one, i.e. the vf_clip_frac metric). Reduce with aggregate_loss.
    """
    delta = values - old_values
    values_clipped = old_values + delta.clamp(-clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    valid = mask.bool()
    loss = torch.where(valid, 0.5 * torch.maximum(loss_unclipped, loss_clipped), 0.0)
    # within the range old + (V - old) is V but for rounding (fp32: 0.13 + (0.053 - 0.13) != 0.053),
    # which would make either term the larger by chance: only tokens the clamp moved count
    return loss, (delta.abs() > clip) & (loss_clipped > loss_unclipped) & valid


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
