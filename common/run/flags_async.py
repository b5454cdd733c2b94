"""Flags of asynchronous RL (docs/async.md): --off-policy-steps, --partial-chunk-tokens, --rollout-gpus.

Shared by train_grpo.py and train_ppo.py; the mechanisms are common/rollout/partial.py (partial rollouts on shared
GPUs), common/rollout/remote.py (engines on their own GPUs) and common/rollout/stream.py (partial rollouts on
them)."""

# what --off-policy-steps K > 0 does not work with yet: (flag's attribute, its value when off, why)
UNSUPPORTED = (
    ("env", None, "--env's multi-turn episodes run whole within a step"),
    ("dynamic_sampling", False, "--dynamic-sampling draws its extra prompts within the step"),
    ("load_rollouts", None, "--load-rollouts replays saved samples as they are (versions included)"),
    ("routing_replay", "none", "--routing-replay rollout needs each sample's routes from one engine call"),
)
# what --rollout-gpus does not work with yet: (flag's attribute, its value when off, why)
REMOTE_UNSUPPORTED = (
    ("env", None, "--env's episodes talk to an engine in their process"),
    ("load_rollouts", None, "--load-rollouts needs no engine"),
    ("routing_replay", "none", "--routing-replay rollout is not carried between the two sides yet"),
    ("true_on_policy", False, "--true-on-policy binds the trainer to an engine in its process"),
)
# docs/async.md#which-correction: IcePop's band mask of the behaviour ratio; the PPO clip is against the trainer's
# recomputed old logprobs (decoupled PPO's proximal policy) in every mode
CORRECTION_DEFAULT = "icepop"


def async_flags(p):
    """--off-policy-steps and --partial-chunk-tokens (common/rollout/partial.py)."""
    g = p.add_argument_group("asynchronous RL (docs/async.md)")
    g.add_argument(
        "--off-policy-steps",
        type=int,
        default=0,
        metavar="K",
        help=(
            "partial rollouts with bounded staleness: (K + 1) x --prompts-per-step groups are in flight, each step's "
            "rollout ends once --prompts-per-step groups are complete and the rest continue under the next step's "
            "weights; no sample trains more than K steps after its first token. Needs every token's engine logprob "
            f"(--rollout-logprobs all, set); --rollout-correction default {CORRECTION_DEFAULT}. 0: synchronous"
        ),
    )
    g.add_argument(
        "--partial-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help=(
            "--off-policy-steps: tokens per sample between checks for complete groups (default: a quarter of "
            "--max-new-tokens, rounded up); smaller stops nearer the needed groups, at more engine calls. With "
            "--rollout-gpus it turns partial rollouts on: the engines generate all the time, a weight sync waits "
            "for one chunk and running samples continue under the new weights (else whole requests one step ahead)"
        ),
    )
    g.add_argument(
        "--rollout-gpus",
        type=int,
        default=0,
        metavar="R",
        help=(
            "the last R ranks of the launch run only the rollout engine, the others only the trainer (nothing "
            "offloaded); weights go to the engines over NCCL after each update. With --off-policy-steps 1 the "
            "engines generate the next step's samples while the trainer trains on this step's (one step off-policy); "
            "with --off-policy-steps K --partial-chunk-tokens N partial rollouts stream on them across updates; "
            "0: the engine shares the trainer's GPUs"
        ),
    )
    g.add_argument(
        "--sync-overlap",
        choices=("auto", "off"),
        default="auto",
        help=(
            "--rollout-gpus: auto sends each weight sync from a thread of the first trainer rank while the next "
            "step's passes run (the optimizer step waits for it: metric sync_wait_sec), where the trainer's export "
            "gathers nothing (--tp, --pp, --ep, --etp 1); off: the step waits for the sync, as it does at "
            "larger layouts"
        ),
    )
    return g


def resolve_async(args):
    """--off-policy-steps and what it implies, in place (before resolve_corrections and the --rollout-logprobs
    mode): the chunk size, --rollout-logprobs all, the default correction. ValueError: what to change."""
    k, remote = args.off_policy_steps, args.rollout_gpus
    if k < 0:
        raise ValueError(f"--off-policy-steps must be >= 0 (0: synchronous), not {k}")
    if remote < 0:
        raise ValueError(f"--rollout-gpus must be >= 0 (0: the engine shares the trainer's GPUs), not {remote}")
    if remote:
        for name, off, why in REMOTE_UNSUPPORTED:
            if getattr(args, name, off) != off:
                raise ValueError(f"--rollout-gpus is not supported with {why}: drop one of them")
        if k > 1 and args.partial_chunk_tokens is None:  # whole requests: a sync waits for the one in flight
            raise ValueError(
                f"--rollout-gpus runs whole requests one step ahead (--off-policy-steps 1), not {k} steps: a step "
                "further ahead adds staleness and no overlap; for partial rollouts that continue across weight "
                "updates add --partial-chunk-tokens N"
            )
        # the trainer's GPUs hold no engine: nothing to make room for
        args.offload_params = False if args.offload_params is None else args.offload_params
        args.offload_optimizer = False if args.offload_optimizer is None else args.offload_optimizer
        gathers = (args.tp, args.pp, args.ep, args.etp) != (1, 1, 1, 1)  # collectives: in the loop's thread only
        args.sync_overlap = "off" if gathers or args.offload_params or args.sync_overlap == "off" else "on"
    else:
        args.sync_overlap = "off"
    if k == 0:
        if args.partial_chunk_tokens is not None:
            raise ValueError("--partial-chunk-tokens is for partial rollouts: add --off-policy-steps K (K >= 1)")
        return
    for name, off, why in UNSUPPORTED:
        if getattr(args, name, off) != off:
            raise ValueError(f"--off-policy-steps {k} is not supported with {why}: drop one of them")
    if args.rollout_logprobs not in (None, "all"):
        raise ValueError(
            f"--off-policy-steps {k} needs the engine's logprob of every token (the behaviour policy): "
            f"--rollout-logprobs all, not {args.rollout_logprobs}"
        )
    args.rollout_logprobs = "all"
    if args.rollout_correction is None and not args.tis_cap:
        args.rollout_correction = CORRECTION_DEFAULT
    if remote and args.partial_chunk_tokens is None:  # whole samples, one step ahead: nothing partial
        return
    chunk = args.partial_chunk_tokens
    if chunk is None:
        args.partial_chunk_tokens = -(-args.max_new_tokens // 4)
    elif chunk < 1:
        raise ValueError(f"--partial-chunk-tokens must be >= 1, not {chunk}")


def remote_mode(args):
    """What the engines on GPUs of their own (--rollout-gpus) do, in words (the start-up line)."""
    k, chunk = args.off_policy_steps, args.partial_chunk_tokens
    sync = "; weight syncs sent behind the next step's passes" if args.sync_overlap == "on" else ""
    if not k:
        return "synchronous: each step's samples of its own weights" + sync
    if chunk is None:
        return "whole requests one step ahead" + sync
    return f"streaming partial rollouts: samples at most {k} steps old, {chunk}-token chunks" + sync
