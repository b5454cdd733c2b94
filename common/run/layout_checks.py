"""The parallel layout of a training run, checked before anything is built (common/run/preflight.py runs
it with the other checks): TP/PP/CP/EP against the world size and the shapes of the model, the critic and
the teacher; the micro-batch sizes derived where not given; the rollout engine's TP against the world.
Every mistake is a UsageError (one line, exit 2 on every rank alike)."""

from common.model.bridge import check_parallel_layout
from common.run.dist import launcher_rank, launcher_world_size
from common.run.flags import MICRO_BATCH_SIZE, fitting_size, logprob_micro_batching
from common.train.guard import UsageError


def _routes(spec):
    """What a model's MoE routes are made of: its MoE layers, experts and top-k."""
    return spec.moe.moe_layers, spec.moe.num_experts, spec.moe.topk


def check_layout(args, spec, critic=None, teacher=None):
    """The parallel layout against the world size and the shapes of the model (and of
    --critic-model: the critic is sharded like the actor, with the same stage sizes)."""
    world = getattr(args, "world_size", None) or launcher_world_size()  # --world-size: a dry run's
    engines = getattr(args, "rollout_gpus", 0)  # --rollout-gpus: the last ranks run the engine only
    if engines >= world:
        raise UsageError(f"--rollout-gpus {engines} leaves no rank to train in a world of {world}: launch more ranks")
    world -= engines
    model_parallel = args.tp * args.pp * args.cp
    if world % model_parallel:
        raise UsageError(
            f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp} x --cp {args.cp} = "
            f"{model_parallel}: start a multiple of tp*pp*cp processes"
        )
    if args.vpp is not None and args.pp == 1:
        raise UsageError("--vpp needs --pp > 1 (virtual stages interleave a pipeline)")
    ep, etp = args.ep, args.etp
    if (world // args.pp) % (ep * etp):  # MoE layers fold each stage's ranks into etp x ep x expert-dp
        raise UsageError(
            f"world size {world} / --pp {args.pp} is not divisible by --ep {ep} x --etp {etp}: "
            "each pipeline stage's ranks must split into expert-parallel groups"
        )
    if spec.moe is not None and args.tp > 1 and not args.sp:
        raise UsageError(f"Mixture-of-Experts layers with --tp {args.tp} need sequence parallelism: add --sp")
    rate = getattr(args, "moe_router_bias_update_rate", 0.0)
    if rate < 0 or (rate and not (spec.moe is not None and spec.moe.expert_bias)):
        raise UsageError(
            f"--moe-router-bias-update-rate {rate}: needs a rate >= 0 and a model whose router has a "
            f"score-correction bias (DeepSeek-V3); {spec.architecture} has none"
        )
    replay = getattr(args, "routing_replay", "none")
    if replay != "none" and spec.moe is None:
        raise UsageError(f"--routing-replay {replay}: {spec.architecture} has no MoE routers; drop the flag")
    if replay != "none" and critic is not None and critic.moe is not None and _routes(critic) != _routes(spec):
        raise UsageError(
            f"--routing-replay {replay}: the critic replays the actor's routes, so --critic-model needs the actor's "
            "MoE layers, experts and top-k (or no experts)"
        )
    if getattr(args, "moe_dispatcher", None) and spec.moe is None:
        raise UsageError(
            f"--moe-dispatcher {args.moe_dispatcher}: {spec.architecture} has no experts to dispatch "
            "tokens to; drop the flag"
        )
    layout = dict(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=ep,
        etp=etp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    for prefix, model in (("", spec), ("--critic-model: ", critic), ("--teacher: ", teacher)):
        if model is None:
            continue
        try:
            check_parallel_layout(model, **layout)
        except ValueError as e:
            raise UsageError(prefix + str(e)) from None
    dp = world // model_parallel
    rollout_batch = args.prompts_per_step * args.samples_per_prompt
    mini_batch = args.mini_batch_size = args.mini_batch_size or rollout_batch  # (config.json records it)
    if rollout_batch % mini_batch:
        raise UsageError(
            f"the rollout batch ({args.prompts_per_step} prompts x {args.samples_per_prompt} samples = "
            f"{rollout_batch}) must be a multiple of --mini-batch-size {mini_batch}"
        )
    if mini_batch % dp:
        raise UsageError(
            f"--mini-batch-size {mini_batch} must be a multiple of the data-parallel size {dp} "
            f"(world {world} / (tp {args.tp} x pp {args.pp}))"
        )
    if args.micro_batch_size is None:  # the largest up to MICRO_BATCH_SIZE that divides a rank's share
        args.micro_batch_size = fitting_size(mini_batch // dp, MICRO_BATCH_SIZE)
        args.micro_batch_size_derived = True  # (the memory plan may give the update a token budget instead)
        if args.micro_batch_size != MICRO_BATCH_SIZE and not args.micro_batch_tokens and launcher_rank() == 0:
            print(
                f"--micro-batch-size {args.micro_batch_size}: each data-parallel rank gets {mini_batch // dp} "
                f"samples of a mini-batch (the default, the largest size up to {MICRO_BATCH_SIZE} that divides them)",
                flush=True,
            )
    for flag, (size, tokens) in (
        ("--micro-batch-size", (args.micro_batch_size, args.micro_batch_tokens)),
        ("--logprob-micro-batch-size", logprob_micro_batching(args)),
    ):
        if not tokens and (mini_batch // dp) % size:
            raise UsageError(
                f"each data-parallel rank gets {mini_batch // dp} samples of a mini-batch, not a multiple "
                f"of {flag} {size}"
            )
    rollout_tp = args.rollout_tp if _uses_vllm(args) else 1
    rollout_world = engines or world
    if rollout_world % rollout_tp:
        raise UsageError(
            f"{'--rollout-gpus' if engines else 'world size'} {rollout_world} is not divisible by --rollout-tp "
            f"{rollout_tp}"
        )
    if rollout_tp > 1 and (spec.head_dim or 64) <= 16:  # docs/gpu.md: both ranks stuck in vLLM's warm-up forward
        raise UsageError(
            f"--rollout-tp {rollout_tp}: vLLM 0.26 hangs at start-up at rollout TP > 1 on a model of head size "
            f"{spec.head_dim}, such as the embedded test model (docs/gpu.md); use a model with wider heads "
            f"(--model) or --rollout-tp 1"
        )
    replicas = rollout_world // rollout_tp
    if args.load_rollouts is None and args.prompts_per_step % replicas:
        raise UsageError(
            f"--prompts-per-step {args.prompts_per_step} must be a multiple of the {replicas} rollout "
            f"replicas ({'--rollout-gpus' if engines else 'world'} {rollout_world} / rollout tp {rollout_tp})"
        )
    if getattr(args, "true_on_policy", False):
        _check_true_on_policy(args, spec)
    if args.max_new_tokens >= spec.max_position_embeddings:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt within the model's "
            f"{spec.max_position_embeddings} positions (max_position_embeddings)"
        )


def _check_true_on_policy(args, spec):
    """--true-on-policy: where the trainer can run the engine's kernels (common/model/exact.py), and only there."""
    parts = {"MoE": spec.moe, "multi-latent attention": spec.mla, "gated delta net": spec.gdn, "gpt-oss": spec.gptoss}
    kind = next((name for name, part in parts.items() if part is not None), None)
    wrong = [
        (kind is not None, f"{spec.architecture} has {kind} layers; it covers dense attention models"),
        (not _uses_vllm(args) or args.load_rollouts, "it needs the vLLM engine (--rollout vllm, on GPUs)"),
        (args.cp > 1, f"--cp {args.cp}: it is for --cp 1"),
        (
            args.rollout_tp != args.tp,
            f"--tp {args.tp} --rollout-tp {args.rollout_tp}: the engine's tensor-parallel split must be the "
            f"trainer's (a row-parallel layer's sums run over the same shards on both sides): --rollout-tp {args.tp}",
        ),
        (args.temperature != 1.0 or args.top_p != 1.0, "it samples at --temperature 1 --top-p 1"),
        (getattr(args, "dtype", None) == "fp32", "it is for bf16 models (vLLM's batch-invariant kernels)"),
        (getattr(args, "lora_rank", 0), "LoRA adapters have no engine kernels to repeat; drop --lora-rank"),
    ]
    for bad, why in wrong:
        if bad:
            raise UsageError(f"--true-on-policy: {why}")


def _uses_vllm(args):
    """The scripts' choice of rollout engine (use_vllm in train_grpo.py), made before start-up."""
    if args.rollout != "auto":
        return args.rollout == "vllm"
    if getattr(args, "dry_run", False) and getattr(args, "gpu_memory_gb", None):
        return True  # a dry run for GPUs plans for vLLM on them
    import torch

    from common.rollout.engines import vllm_available

    return torch.cuda.is_available() and vllm_available()
