"""The algorithm's flags both training scripts share: the clipped policy loss (PPO's, GRPO's, GSPO's) and its
terms, DAPO's sampling and shaping (train_grpo.py); and resolve_training_flags, what the other flag groups imply
for one another once parsed. Each script adds its own algorithm flags (GRPO's advantages and KL, PPO's GAE, KL
mode and critic) to the group it passes here."""

from common.rollout.engine import rollout_logprobs_mode
from common.rollout.lengths import parse_lengths
from common.run import flags_async, flags_rollout
from common.run.flags import lora_settings


def policy_loss_flags(g, *, agg_help):
    """The policy loss (common/rl/losses.py policy_loss, aggregate_loss) into the script's algorithm group g."""
    g.add_argument("--clip-low", type=float, default=0.2, help="PPO ratio clip below 1")
    g.add_argument("--clip-high", type=float, default=0.2, help="PPO ratio clip above 1 (DAPO clip-higher: 0.28)")
    g.add_argument(
        "--dual-clip",
        type=float,
        default=0.0,
        help="dual-clip PPO: for negative advantages the loss is capped at C x |A| (C > 1; verl uses 3; 0 = off)",
    )
    g.add_argument(
        "--gspo",
        action="store_true",
        help=(
            "GSPO: one importance ratio per sequence (exp of the mean token log-ratio), clipped per sequence; the "
            "paper uses --clip-low 3e-4 --clip-high 4e-4 --loss-agg seq_mean_token_mean"
        ),
    )
    g.add_argument(
        "--loss-agg",
        choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"],
        default="token_mean",
        help=agg_help,
    )
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus")


def dapo_flags(g):
    """DAPO's dynamic sampling and reward shaping (common/rl/dapo.py) into GRPO's algorithm group g."""
    g.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help=(
            "DAPO: drop prompt groups whose rewards are all equal and sample more prompts until the batch holds only "
            "groups with a signal"
        ),
    )
    g.add_argument(
        "--max-sampling-rounds",
        type=int,
        default=3,
        help="--dynamic-sampling: at most this many extra rounds per step, then zero-signal groups fill the batch",
    )
    g.add_argument(
        "--overlong-buffer",
        type=int,
        default=0,
        help="DAPO's soft overlong penalty over the last N tokens before --max-new-tokens, added to the reward (0 off)",
    )
    g.add_argument(
        "--overlong-penalty-factor",
        type=float,
        default=1.0,
        help="the penalty at --max-new-tokens (it grows linearly over --overlong-buffer)",
    )
    g.add_argument(
        "--mask-truncated",
        action="store_true",
        help="DAPO's overlong filtering: responses cut at --max-new-tokens are left out of the loss",
    )


def resolve_training_flags(args):
    """What the flag groups imply for one another, in place, in this order; ValueError: what to change.
    --off-policy-steps: --rollout-logprobs all and its default correction (common/run/flags_async.py);
    --true-on-policy: --rollout-logprobs all; --rollout-correction's thresholds (common/rl/corrections.py);
    --env's budgets (docs/agentic.md); args.lora: dict(rank, alpha, targets) or None (full fine-tuning);
    args.rollout_logprobs: the engine's logprob mode; --bench-response-lengths parsed (drawn every step)."""
    flags_async.resolve_async(args)
    flags_rollout.resolve_true_on_policy(args)
    flags_rollout.resolve_corrections(args)
    flags_rollout.check_env_flags(args)
    args.lora = lora_settings(args)
    args.rollout_logprobs = rollout_logprobs_mode(args.rollout_logprobs, args.temperature, args.rollout_correction)
    if getattr(args, "bench_response_lengths", None):  # (train_grpo.py's benchmark mode)
        parse_lengths(args.bench_response_lengths, max_tokens=args.max_new_tokens)
        if args.load_rollouts:
            raise ValueError("--bench-response-lengths sets what the engine samples: not with --load-rollouts")
