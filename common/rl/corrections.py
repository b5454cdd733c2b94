"""Off-policy corrections (--rollout-correction): the rollout engine's samples against the trainer's policy.

The engine (vLLM: other kernels, bf16, its own sampler) samples from pi_behav, whose logprobs come with the samples
(`rollout_logprobs`); the trainer recomputes pi_old (`old_logprobs`, the proximal policy of the PPO clip) and trains
pi_theta. Even synchronously the two differ (docs/gpu.md#rollout-logprobs); each correction below turns that
difference into per-token weights w (B, T), multiplied (detached) into the policy-gradient term of the loss
(policy_loss's is_weights). A weight of 0 masks a token out while it keeps its place in the loss's normalisers, as
in TRL and in DeepSeek-V3.2's formula (verl's rejection also drops it from them). With r_t = pi_old / pi_behav of
token t (1 where the engine brought no logprob) and a band [low, high]:

    tis                 w_t = min(r_t, high)                                  Yao et al. 2025 (TIS)
    seq-mask-is         w_t = R [low <= R <= high], R = prod_t r_t of the row   TRL's sequence_mask, verl's Seq-MIS
    icepop              w_t = r_t [low <= r_t <= high]                          IcePop (Ling team 2025)
    geo-mask            w_t = [low <= G <= high], G = exp(mean_t log r_t)       verl's geometric rejection
    decoupled           w_t = r_t [r_t <= high], r_t = pi_prox / pi_behav       decoupled PPO (AReaL, Fu et al. 2025)
    seq-offpolicy-mask  w_t = 0 where A_t < 0 and mean_t log(pi_behav / pi_theta) > delta     DeepSeek-V3.2 (2025)

resolve_correction turns the flags into a mode and its thresholds; correction_weights gives the batch's weights
(all modes but seq-offpolicy-mask, which needs pi_theta) and their metrics; loss_weights gives one micro-batch's.
Shapes: B sequences (rows; packed rows: seq_ids), T response positions; `mask` (B, T) the tokens of the loss,
`rollout_mask` (B, T) those that brought an engine logprob. Imports nothing of the project but common.rl.losses.
"""

import math

import torch

from common.rl.losses import sequence_means, sequence_sums

CORRECTIONS = ("none", "tis", "seq-mask-is", "icepop", "seq-offpolicy-mask", "geo-mask", "decoupled")
LOG_RATIO_BOUND = 20.0  # exp(20) = 4.9e8: a log-ratio beyond is masked or capped anyway; exp must not overflow


def resolve_correction(mode, *, tis_cap=0.0, low=None, high=None, delta=None):
    """The correction of a run and its thresholds from the flags: (mode, low, high, delta), the unused ones None.
    ValueError says what to change. mode None: "tis" with --tis-cap C (the older flag, = --correction-high C),
    else "none". Defaults where a flag is not given:
        tis          high 2 (TIS's cap; verl's default)
        seq-mask-is  [1/high, high], high 2 (verl's Seq-MIS; TRL's sequence_mask: 3, no lower bound)
        icepop       [0.5, 2] (the IcePop blog's alpha, beta)
        geo-mask     [1/high, high], high 1.001 (verl's geometric rejection: a per-token average, so tight)
        decoupled    high 5: a larger pi_prox / pi_behav masks the token (AReaL's behav_imp_weight_cap)
        seq-offpolicy-mask  delta 0.5 nats per token (the paper gives none; TRL's docs suggest 0.5 to start)
    """
    if tis_cap and mode not in (None, "tis"):
        raise ValueError(
            f"--tis-cap is --rollout-correction tis --correction-high C: not with --rollout-correction {mode}"
        )
    if tis_cap and high is not None:
        raise ValueError("--tis-cap C is --correction-high C: give one of them")
    mode = mode or ("tis" if tis_cap else "none")
    bands = {"seq-mask-is": (None, 2.0), "icepop": (0.5, 2.0), "geo-mask": (None, 1.001)}  # (low, high); None: 1/high
    uses = {"low": mode in bands, "high": mode in (*bands, "tis", "decoupled"), "delta": mode == "seq-offpolicy-mask"}
    for name, value in (("low", low), ("high", high), ("delta", delta)):
        if value is not None and not uses[name]:
            raise ValueError(f"--correction-{name} has no meaning with --rollout-correction {mode}")
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--correction-{name} must be a finite number, not {value}")
    if mode in ("tis", "decoupled"):
        high = tis_cap or (high if high is not None else {"tis": 2.0, "decoupled": 5.0}[mode])
    elif mode in bands:
        high = high if high is not None else bands[mode][1]
        low = low if low is not None else bands[mode][0] if bands[mode][0] is not None else 1.0 / high
    elif mode == "seq-offpolicy-mask":
        delta = 0.5 if delta is None else delta
    if high is not None and not high > 0:
        raise ValueError(f"--correction-high must be > 0, not {high}")
    if low is not None and not 0 <= low <= high:
        raise ValueError(f"--correction-low {low} must be in [0, --correction-high {high}]")
    return mode, low, high, delta


def uses_old_logprobs(mode):
    """Whether the correction's weights need the trainer's old logprobs (GRPO's on-policy steps skip that pass)."""
    return mode not in ("none", "seq-offpolicy-mask")


def truncated_is_weights(old_logprobs, rollout_logprobs, cap=2.0):
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): reweight each token by w = min(pi_old / pi_rollout, cap), truncated at `cap`
    to bound the variance. (B, T) in, (B, T) detached weights out."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def icepop_weights(log_ratio, low=0.5, high=2.0):
    """IcePop ("Small Leak Can Sink a Great Ship", Ling team 2025): the token's ratio r where it lies in
    [low, high], 0 outside (double-sided masking instead of TIS's truncation). log_ratio (B, T) = log r."""
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def sequence_mask_is_weights(log_ratio, mask, low=0.5, high=2.0):
    """Sequence-level masked IS (TRL's sequence_mask, verl's Seq-MIS): every token of a row gets the row's
    product ratio R = exp(sum_t log r_t) over its masked tokens where R lies in [low, high], else 0.
    log_ratio, mask (B, T), one sequence per row."""
    seq_ratio = (log_ratio * mask).sum(-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # (B, 1)
    keep = (seq_ratio >= low) & (seq_ratio <= high)
    return torch.where(keep, seq_ratio, torch.zeros_like(seq_ratio)).expand_as(log_ratio)


def geometric_mask(log_ratio, mask, low=1 / 1.001, high=1.001):
    """Geometric-mean rejection (verl's rollout_rs "geometric"; Liu, Li et al. 2025, "When Speed Kills
    Stability"): 1 for every token of a row whose geometric-mean ratio G = exp(mean_t log r_t) lies in
    [low, high], else 0. A per-token average: long sequences are not rejected for their length alone."""
    log_g = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    geo_ratio = log_g.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    keep = (geo_ratio >= low) & (geo_ratio <= high)
    return keep.to(log_ratio.dtype).expand_as(log_ratio)


def decoupled_weights(log_ratio, high=5.0):
    """Decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025): the PPO ratio pi_theta / pi_prox is clipped
    against the proximal policy (the trainer's old logprobs, policy_loss's old_logprobs), and each token is
    weighted by pi_prox / pi_behav, the behaviour policy being the engine's; a token whose weight exceeds
    `high` is left out (AReaL's behav_imp_weight_cap). log_ratio (B, T) = log pi_prox - log pi_behav."""
    ratio = log_ratio.clamp(max=LOG_RATIO_BOUND).exp()
    return torch.where(ratio <= high, ratio, torch.zeros_like(ratio))


def offpolicy_sequence_mask(logprobs, rollout_logprobs, rollout_mask, advantages, delta, seq_ids=None, cp_group=None):
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, eq. 9): 0 on the tokens of a sequence
    whose advantage is negative and whose mean per-token log(pi_behav / pi_theta) (the KL of the behaviour
    policy, the engine's, to the current one, estimated on its own samples) exceeds delta; else 1. Such
    samples are both bad and far off-policy: pushing them down moves the policy where it knows least.
    logprobs (B, T): pi_theta's (detached here); rollout_logprobs, rollout_mask (B, T): the engine's and where
    it gave them; advantages (B,) or (B, T). seq_ids/cp_group as common/rl/losses.py sequence_means: under
    context parallelism all ranks of cp_group call this, in the same order."""
    kl = sequence_means((rollout_logprobs - logprobs.detach()) * rollout_mask, rollout_mask, seq_ids, cp_group)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    return 1.0 - ((advantages < 0) & (kl > delta)).to(logprobs.dtype)


def quantiles(values, qs):
    """torch.quantile's linear interpolation, without its 16M-element limit (a long rollout has more tokens)."""
    ordered = values.double().sort().values
    at = torch.tensor(qs, dtype=torch.float64) * (len(ordered) - 1)
    below = at.floor().long()
    above = (below + 1).clamp(max=len(ordered) - 1)
    return (ordered[below] + (at - below) * (ordered[above] - ordered[below])).tolist()


def correction_metrics(weights, log_ratio, rollout_mask, mask):
    """The logged numbers of a batch's correction: correction_weight_mean (mean weight over the loss's tokens),
    correction_masked_frac (share of those with weight 0), correction_masked_seq_frac (share of sequences with a
    token masked), and engine_ratio_p5/p50/p95 (quantiles of pi_old / pi_behav over the tokens that brought an
    engine logprob). Python floats; a metric with no token to count is left out."""
    valid, has = mask.bool(), rollout_mask.bool()
    metrics = {}
    if valid.any():
        masked = (weights == 0) & valid
        metrics["correction_weight_mean"] = weights[valid].double().mean().item()
        metrics["correction_masked_frac"] = masked.sum().item() / valid.sum().item()
        metrics["correction_masked_seq_frac"] = masked.any(-1)[valid.any(-1)].double().mean().item()
    if has.any():
        ratios = log_ratio[has].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        p5, p50, p95 = quantiles(ratios, [0.05, 0.5, 0.95])
        metrics.update(engine_ratio_p5=p5, engine_ratio_p50=p50, engine_ratio_p95=p95)
    return metrics


def correction_weights(mode, old_logprobs, rollout_logprobs, rollout_mask, mask, low=None, high=None):
    """A batch's per-token weights (B, T) (detached; ones for "none", for seq-offpolicy-mask (applied per
    micro-batch by loss_weights) and where old_logprobs is None: GRPO's on-policy steps) and their metrics
    (correction_metrics; {} for "none" or without old_logprobs; the engine_ratio quantiles alone for
    seq-offpolicy-mask). One sequence per row; tokens without an engine logprob (rollout_mask 0) have ratio 1.
    low/high: resolve_correction's."""
    if mode == "none" or old_logprobs is None:
        return torch.ones_like(mask, dtype=torch.float32), {}
    rollout_mask = rollout_mask * mask
    log_ratio = (old_logprobs - rollout_logprobs) * rollout_mask  # (B, T) log pi_old / pi_behav, 0 without one
    if mode == "tis":
        weights = truncated_is_weights(log_ratio, torch.zeros_like(log_ratio), cap=high)
    elif mode == "seq-mask-is":
        weights = sequence_mask_is_weights(log_ratio, mask, low, high)
    elif mode == "icepop":
        weights = icepop_weights(log_ratio, low, high)
    elif mode == "geo-mask":
        weights = geometric_mask(log_ratio, mask, low, high)
    elif mode == "decoupled":
        weights = decoupled_weights(log_ratio, high)
    elif mode == "seq-offpolicy-mask":  # masked per micro-batch (loss_weights, which logs what it masks)
        metrics = correction_metrics(torch.ones_like(log_ratio), log_ratio, rollout_mask, mask)
        return torch.ones_like(log_ratio), {k: v for k, v in metrics.items() if k.startswith("engine_ratio")}
    else:
        raise ValueError(f"unknown --rollout-correction {mode!r}, expected one of {', '.join(CORRECTIONS)}")
    weights = weights.detach().float()
    return weights, correction_metrics(weights, log_ratio, rollout_mask, mask)


def loss_weights(mode, mb, logprobs, delta=None, cp_group=None):
    """One micro-batch's weights of the policy term: mb["is_weights"] (correction_weights'), times DeepSeek's
    off-policy mask under seq-offpolicy-mask (against this pass's pi_theta: logprobs, (B, T)), and that mask's
    metrics as sums and counts for common/train/schedule.py reduce_metrics ({} otherwise). mb: a micro-batch of
    common/rl/batch.py (mask, advantages, rollout_logprobs, rollout_mask, is_weights; seq where packed)."""
    if mode != "seq-offpolicy-mask":
        return mb["is_weights"], {}
    mask, seq_ids = mb["mask"], mb.get("seq")
    keep = offpolicy_sequence_mask(
        logprobs, mb["rollout_logprobs"], mb["rollout_mask"] * mask, mb["advantages"], delta, seq_ids, cp_group
    )
    masked = (1.0 - keep) * mask
    sequences = sequence_sums(torch.ones_like(keep), mask, seq_ids) > 0  # the sequences with a token here
    return mb["is_weights"] * keep, {
        "correction_masked_frac": masked.sum(),
        "correction_masked_frac__n": mask.sum(),
        "correction_masked_seq_frac": (sequence_sums(masked, mask, seq_ids) > 0).sum(),
        "correction_masked_seq_frac__n": sequences.sum(),
    }
