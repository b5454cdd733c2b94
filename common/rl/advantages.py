"""Advantages: GRPO's group-relative one per sample, GAE's per token for PPO's critic.

    group_advantages(rewards, group_size, normalize_std)   GRPO / Dr.GRPO, one scalar per sample
    gae(rewards, values, mask, gamma, lam)                 (advantages, returns) per token
    masked_whiten(x, mask)                                  standardise over valid tokens

Shapes as in common/rl/losses.py: (B, T) per token, `mask` the response mask.
"""

import torch

from common.rl.losses import masked_mean


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
