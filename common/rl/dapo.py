"""DAPO's data-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv 2503.14476), used by train_grpo.py:

    overlong_penalty(lengths, max_len, buffer, factor)    soft length penalty (eq. 13), added to rewards
    dynamic_sampling(samples, rewards, group, more, ...)  keep only groups whose rewards differ (sec. 3.2)

The loss-side switches are flags of the scripts: clip-higher (--clip-high 0.28), token-level
loss (--loss-agg token_mean), overlong filtering (--mask-truncated), no KL (--kl-coef 0).
"""

import torch


def overlong_penalty(lengths, max_len, buffer, factor=1.0):
    """DAPO's soft overlong punishment per response, to add to its reward:
        0                                   len <= max_len - buffer
        factor * ((max_len - buffer) - len) / buffer    in the buffer (0 down to -factor)
        -factor                             len > max_len
    lengths: (N,) response tokens; max_len: the generation limit (--max-new-tokens); buffer: the
    last tokens before it in which the penalty grows linearly (DAPO: 4096 of 20480)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    start = max_len - buffer
    penalty = (start - lengths) / buffer
    return factor * torch.where(lengths <= start, 0.0, torch.where(lengths > max_len, -1.0, penalty))


def dynamic_sampling(samples, rewards, group, more, max_rounds):
    """DAPO's dynamic sampling: a group whose G rewards are all equal has zero advantage for
    every sample, so it adds no gradient, only noise in the batch's normalisers. Keep the
    groups whose rewards differ; while fewer than the batch holds, call more(round) (1, 2, ...)
    for another batch of (samples, rewards), at most max_rounds times. If still short, the
    batch is filled with zero-signal groups (in the order they came), so the optimizer step
    always sees the batch size it was configured for (its micro-batch geometry is checked).

    samples, rewards: prompt-major, `group` per prompt. Every rank calls this with the same
    (all-gathered) samples and rewards, so every rank makes the same choices.
    Returns (samples, rewards, metrics): metrics sampling_rounds (1 = no extra round),
    informative_groups (kept), filler_groups (zero-signal groups kept to fill the batch),
    first_round_informative_frac."""
    want = len(samples) // group
    informative, filler, rounds = [], [], 0

    def split(samples, rewards):
        for g in range(len(samples) // group):
            part = slice(g * group, (g + 1) * group)
            (informative if rewards[part].max() > rewards[part].min() else filler).append(
                (samples[part], rewards[part])
            )

    split(samples, rewards)
    first_frac = len(informative) / max(want, 1)
    while len(informative) < want and rounds < max_rounds:
        rounds += 1
        split(*more(rounds))
    chosen = (informative[:want] + filler)[:want]
    metrics = {
        "sampling_rounds": 1 + rounds,
        "informative_groups": min(len(informative), want),
        "filler_groups": want - min(len(informative), want),
        "first_round_informative_frac": first_frac,
    }
    return [s for part, _ in chosen for s in part], torch.cat([r for _, r in chosen]), metrics
