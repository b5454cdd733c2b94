"""The command-line flags train_grpo.py and train_ppo.py share, in groups (what --help shows
under each title): here the model, LoRA, the parallel layout, batches and optimisation, and the
settings derived from them. Each script adds its own algorithm and optimisation flags between them,
so what an experiment edits stays in the script; everything here means the same in both.
Each function returns its group, for a script's own flags of that kind. The run's groups (data,
steps and outputs, the memory plan, benchmarks) are in common/run/flags_run.py; the rollout side's
(engine and sampling, off-policy corrections, reward) in common/run/flags_rollout.py."""

import argparse

from common.model.bridge import RECOMPUTE_MODULES

# --micro-batch-size when not given: the largest size up to this that divides each data-parallel
# rank's share of a mini-batch (common/run/preflight.py derives it)
MICRO_BATCH_SIZE = 8


def model_flags(p):
    """--model, --embedded-model: where the model comes from (the script adds --mcore-ckpt); --gdn-kernel."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help=(
            "HF model dir (config.json + safetensors + tokenizer) or hub id ORG/NAME (downloaded to the HF cache on "
            "first use; HF_HUB_OFFLINE=1: the cache only); default: the embedded tiny model"
        ),
    )
    g.add_argument(
        "--embedded-model",
        choices=["dense", "moe", "deepseek", "qwen3_5", "qwen3_5_moe", "gpt_oss"],
        default="dense",
        help=(
            "without --model: the tiny dense Qwen2, the same body with a Qwen3-MoE MLP (8 experts, top-2) in every "
            "layer, or a tiny DeepSeek-V3 (multi-latent attention, a dense layer then 8 sigmoid-routed experts in 4 "
            "groups + a shared expert), or a tiny Qwen3.5 (a gated delta net layer, then gated full attention), "
            "or qwen3_5_moe: that Qwen3.5 with an MoE MLP (8 experts, top-2, a gated shared expert) in each layer, "
            "or a tiny gpt-oss (attention sinks, a sliding-window then a full-attention layer, 8 biased experts, top-2)"
        ),
    )
    g.add_argument(
        "--gdn-kernel",
        choices=["torch", "fla"],
        default="torch",
        help=(
            "the recurrence of Qwen3.5's gated delta nets: torch = the pure-torch chunked recurrence (any device); "
            "fla = flash-linear-attention's fused Triton kernels (CUDA, the fla-core package; refused where fla "
            "refuses its backward: Hopper GPUs with Triton 3.4-3.7.0, docs/models.md)"
        ),
    )
    return g


def lora_flags(p, trained="policy"):
    """LoRA (common/model/lora.py): low-rank adapters trained on a frozen base (docs/lora.md)."""
    g = p.add_argument_group("LoRA")
    g.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help=(
            f"train LoRA adapters of this rank r on the frozen base instead of the whole {trained} (0: full "
            "fine-tuning); the reference is the base (the adapters off), checkpoints hold the adapters"
        ),
    )
    g.add_argument("--lora-alpha", type=float, default=None, help="the adapters' scale is alpha / r (default: 2 r)")
    g.add_argument(
        "--lora-targets",
        default="attention,mlp",
        help="comma-separated: attention (qkv and output projections), mlp (dense and shared-expert MLPs)",
    )
    return g


def lora_settings(args):
    """dict(rank=, alpha=, targets=) of --lora-* (ValueError saying what to fix), or None without --lora-rank."""
    from common.model.lora import parse_targets

    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning), not {args.lora_rank}")
    if not args.lora_rank:
        if args.lora_alpha is not None:
            raise ValueError("--lora-alpha needs --lora-rank r (> 0)")
        return None
    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    if alpha <= 0:
        raise ValueError(f"--lora-alpha must be > 0, not {alpha}")
    return dict(rank=args.lora_rank, alpha=alpha, targets=parse_targets(args.lora_targets))


def parallel_flags(p):
    """Megatron's parallel layout (data parallelism is what is left: world / (tp * pp * cp)), dtype, MoE routing."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    g.add_argument("--pp", type=int, default=1, help="Megatron pipeline parallel size")
    g.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (interleaved schedule)")
    g.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the first pipeline stage; the "
        "middle stages share the rest equally (default: even when the layers divide by pp*vpp, else automatic)",
    )
    g.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help="decoder layers on the last pipeline stage, "
        "which also runs the output layer and the loss (default: automatic, no more than the other stages)",
    )
    g.add_argument(
        "--sp", action="store_true", help="sequence parallelism (with --tp > 1; MoE models with --tp > 1 need it)"
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help=(
            "expert parallel size (MoE models): each pipeline stage's ranks split the experts over ep ranks, tokens "
            "go to them by all-to-all"
        ),
    )
    g.add_argument(
        "--etp",
        type=int,
        default=1,
        help="expert tensor parallel size (MoE models): each expert's weights split over etp ranks",
    )
    g.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context parallel size: every sequence of the trainer's passes split over cp ranks "
        "(2*cp chunks, balanced for causal attention; keys/values all-gathered; with --pack every sample of a "
        "pass is cut so, "
        "padded to a multiple of 2*cp), for sequences that do not fit one GPU",
    )
    g.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard optimizer state over data-parallel ranks",
    )
    g.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="model dtype (default: bf16 on GPU, fp32 on CPU)"
    )
    g.add_argument(
        "--moe-aux-loss-coef",
        type=float,
        default=None,
        help=(
            "MoE load-balancing loss coefficient (megatron's aux loss per MoE layer, added to the loss; 0: off); "
            "default: the model config's router_aux_loss_coef"
        ),
    )
    g.add_argument(
        "--moe-dispatcher",
        choices=["alltoall", "allgather"],
        default=None,
        help=(
            "how tokens reach their experts (default: allgather with every expert on each rank, alltoall at "
            "--ep/--etp > 1): megatron's all-to-all, which waits on the host for the split sizes every layer, or "
            "allgather: every EP rank gathers all tokens of its EP group and picks its experts' share on the device "
            "(common/model/moe.py). At --ep > 1 allgather needs the same token count in each pass on every EP rank, "
            "so the trainer pads each pass to the largest of its EP peers' (empty rows or a longer packed tail); "
            "measured 1.2x faster than alltoall at EP=2 and equal at EP=4 on fixed-length batches "
            "(docs/performance.md)"
        ),
    )
    g.add_argument(
        "--moe-router-bias-update-rate",
        type=float,
        default=0.0,
        help=(
            "DeepSeek-V3 models: after every optimizer step move each router's score-correction bias by this amount "
            "towards balanced expert load (megatron's aux-loss-free balancing; DeepSeek-V3's pretraining used "
            "0.001); 0: the loaded bias stays frozen"
        ),
    )
    g.add_argument(
        "--routing-replay",
        choices=["none", "rollout", "old"],
        default="none",
        help=(
            "MoE models: which experts the trainer's passes send each token to. rollout (R3): the ones the rollout "
            "engine chose, recorded per token and MoE layer and carried with the samples; old (R2): the ones of the "
            "old-logprob pass, replayed by the reference pass and the updates; none: each pass routes on its own. "
            "The gating weights of the chosen experts still come from the current router (docs/models.md)"
        ),
    )
    return g


def batch_flags(p):
    """Mini-batches (optimizer steps), micro-batches (forward passes), packing, recompute."""
    g = p.add_argument_group("batches")
    g.add_argument(
        "--mini-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step, global (default: the whole rollout batch)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="samples per forward pass per rank (packed passes, the default: a budget of this many times "
        "the step's longest sample, filled with as many whole samples as fit); default: the largest size up "
        f"to {MICRO_BATCH_SIZE} that divides the samples each data-parallel rank gets of a mini-batch",
    )
    g.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="instead of --micro-batch-size, fill each forward pass with samples up to this many tokens per "
        "rank (packed: the row's tokens; with --no-pack: length-sorted samples x padded length; 0 = off): "
        "fewer, fuller passes (docs/performance.md)",
    )
    g.add_argument(
        "--logprob-micro-batch-size",
        type=int,
        default=None,
        help="samples per forward-only pass per rank (old and reference logprobs; PPO's critic values), "
        "as --micro-batch-size: these passes keep no activations, so larger ones fit (default: "
        "--micro-batch-size; given alone, it sizes these passes by samples even where "
        "--micro-batch-tokens sizes the update's by tokens)",
    )
    g.add_argument(
        "--logprob-micro-batch-tokens",
        type=int,
        default=None,
        help="tokens per forward-only pass per rank, as --micro-batch-tokens (default: --micro-batch-tokens, "
        "unless --logprob-micro-batch-size is given)",
    )
    g.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="activation recompute (less memory, more compute): selective = the --recompute-modules of "
        "every layer, full = whole layers, --recompute-layers at a time",
    )
    g.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=list(RECOMPUTE_MODULES),
        default=["core_attn"],
        help="with --recompute selective: megatron's recompute_modules (mlp, moe, moe_act, "
        "shared_experts: MLP / MoE activations; core_attn: the attention kernel)",
    )
    g.add_argument(
        "--recompute-layers",
        type=int,
        default=1,
        help="with --recompute full: layers per recomputed chunk (megatron's recompute_num_layers)",
    )
    g.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence packing (default on; --no-pack: length-sorted padded micro-batches): each forward "
        "pass is one row of whole samples back to back, no padding, attention confined to each "
        "sample; up to --micro-batch-tokens tokens per pass (0: --micro-batch-size rows of the "
        "step's longest sample). Measured faster than padding in every setting tried: 1.05-1.24x "
        "on GPUs, ~3x on a CPU (README, docs/performance.md)",
    )
    return g


def optim_flags(p, title, lr_help, scope=""):
    """The learning rate, its schedule and AdamW's weight decay (scope: which models they apply
    to, said in the help); the script adds its clipping (and PPO its critic's learning rate)."""
    g = p.add_argument_group(title)
    g.add_argument("--lr", type=float, default=1e-6, help=lr_help)
    g.add_argument("--min-lr", type=float, default=0.0, help=f"final learning rate of the decay{scope}")
    g.add_argument("--lr-warmup-steps", type=int, default=0, help=f"linear warmup, in optimizer steps{scope}")
    g.add_argument(
        "--lr-decay",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="decay after warmup, to --min-lr at the last step",
    )
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    return g


# What shapes the learning-rate schedules (common/train/setup.py): saved with each checkpoint, so
# that --resume names the ones given another value (common/train/resume.py changed_flags).
SCHEDULE_FLAGS = (
    "lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay",
    "weight_decay",
    "steps",
    "critic_lr",
    "critic_warmup_steps",
)


def schedule_flags(args):
    """{"--lr": value, ...} of the SCHEDULE_FLAGS this script has."""
    return {f"--{name.replace('_', '-')}": getattr(args, name) for name in SCHEDULE_FLAGS if hasattr(args, name)}


def moe_overrides(args):
    """The TransformerConfig fields the MoE flags change from the model's (build_model's
    config overrides): the router bias update, the token dispatcher, routing replay (megatron's
    RouterReplay, common/model/routing_replay.py)."""
    overrides = {}
    if args.routing_replay != "none":
        overrides["moe_enable_routing_replay"] = True
    if args.moe_router_bias_update_rate:
        overrides["moe_router_bias_update_rate"] = args.moe_router_bias_update_rate
    if args.moe_dispatcher:
        overrides["moe_token_dispatcher_type"] = args.moe_dispatcher
    return overrides


def logprob_micro_batching(args):
    """(samples, tokens) per forward-only pass per rank, B.micro_batches' micro_batch_size and
    max_tokens: the --logprob-micro-batch-* flags, else the update's --micro-batch-* ones."""
    size = args.logprob_micro_batch_size or args.micro_batch_size
    if args.logprob_micro_batch_tokens is not None:
        return size, args.logprob_micro_batch_tokens
    return size, 0 if args.logprob_micro_batch_size else args.micro_batch_tokens


def fitting_size(total, cap):
    """The largest size <= cap that divides total (1 at worst): a batch size that splits `total`
    samples into equal parts."""
    return next(size for size in range(min(cap, total), 0, -1) if total % size == 0)
