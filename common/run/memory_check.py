"""The memory plan of a training run at start-up: derived defaults, the refusal, --dry-run's table.

    spec = check_training_run(parser, args)   # in the scripts' parse_args, every rank
    check_memory(parser, args, spec)          # derives, prints, refuses (exit 2)
    if args.dry_run: sys.exit(0)              # the plan printed is all a dry run does

check_memory reads the scripts' flags (as common/run/flags.py's helpers do), plans with
common/run/memory_plan.py, and:
  - fills the defaults derived from the plan into args, printed once ("derived: ..."):
    --gpu-memory-utilization (the engine's share of what the trainer leaves on the GPU during
    the rollout), --save-any-layout (on at data parallel 1, where a save gathers nothing) and
    --micro-batch-tokens (where the default micro-batches would not fit);
  - raises UsageError (one line: the phase, the place, the shortfall, the flags that would make
    it fit; exit 2) where a phase is over a GPU, or a node's pinned host memory over its RAM,
    and warns above 95%;
  - prints the plan (common/run/memory_print.py): its totals in a few lines at the start of a GPU
    run, the whole table with --dry-run. GB are 10^9 bytes, as the run's mem_*_gb metrics.
The machine: the visible GPU (torch.cuda, without creating a context) or --gpu-memory-gb, the
node's available host memory or --host-memory-gb, torchrun's world or --world-size (dry run).
"""

import functools
import math
import os

from common.model.bridge import check_parallel_layout, parse_hf_config
from common.run import memory_plan as M
from common.run.dist import launcher_rank, launcher_world_size
from common.run.flags import logprob_micro_batching
from common.run.memory_print import format_plan, format_summary
from common.train.guard import UsageError

H100_NODE = dict(world=8, gpus_per_node=8, gpu_bytes=80e9)  # what the dry run also plans for, one line


def target_machine(args):
    """(world size, GPU bytes or None for a CPU run, ranks per node, node host bytes or None)."""
    from common.run.host_memory import host_memory_available

    world = (args.world_size or launcher_world_size()) - getattr(args, "rollout_gpus", 0)  # the trainers (not engines)
    gpu_bytes = args.gpu_memory_gb * M.GB if args.gpu_memory_gb else visible_gpu_bytes()
    per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or 1
    node = args.host_memory_gb * M.GB if args.host_memory_gb else host_memory_available()
    return world, gpu_bytes, min(per_node, world), node


def visible_gpu_bytes():
    """Total memory of this rank's GPU, None without one. torch.cuda.get_device_properties asks the
    driver without creating a CUDA context (none appears on the GPUs of other ranks)."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()  # (one visible GPU per rank: 0)
    return float(torch.cuda.get_device_properties(device).total_memory)


def _vllm_available():
    from common.rollout.engines import vllm_available

    return vllm_available()


def plan_inputs(args, spec, world, gpu_bytes, per_node, node_bytes, critic=None, reward_model=None, share_scale=1.0):
    """plan_memory's keywords for the scripts' flags on this machine. share_scale: the real GPU's memory over
    the planned one's (--gpu-memory-gb on a larger card): vLLM's share of the whole card, in the plan's unit."""
    on_gpu = gpu_bytes is not None
    if args.load_rollouts or getattr(args, "rollout_gpus", 0):  # (--rollout-gpus: the engines on GPUs of their own)
        engine = None
    elif args.rollout == "vllm" or (args.rollout == "auto" and on_gpu and (args.dry_run or _vllm_available())):
        engine = "vllm"  # the scripts' choice (use_vllm); a dry run plans for vLLM on the GPUs it plans for
    else:
        engine = "hf"
    max_len = args.max_prompt_len + args.max_new_tokens  # prompts longer are dropped (common/run/data.py)
    if getattr(args, "env", None):  # --env: an episode's whole context (first prompt, turns, observations)
        max_len = args.max_episode_tokens or spec.max_position_embeddings
    update_tokens = args.micro_batch_tokens or args.micro_batch_size * max_len
    remote_sync = None  # --rollout-gpus: the weight sync's buckets, in its phase or beside the next step's passes
    if getattr(args, "rollout_gpus", 0):
        remote_sync = "behind" if getattr(args, "sync_overlap", "off") == "on" else "step"
    lp_size, lp_tokens = logprob_micro_batching(args)
    dp = world // (args.tp * args.pp * args.cp)
    per_dp = (args.mini_batch_size or args.prompts_per_step * args.samples_per_prompt) // max(dp, 1)
    if args.micro_batch_tokens:  # at most this many passes (each holds at least one whole sample)
        micro_batches = min(per_dp, math.ceil(per_dp * max_len / args.micro_batch_tokens))
    else:
        micro_batches = math.ceil(per_dp / args.micro_batch_size)
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    return dict(
        spec=spec,
        world=world,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sp=args.sp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        dtype_bytes={"bf16": 2, "fp32": 4}[dtype],
        distributed_optimizer=args.distributed_optimizer,
        reference=args.kl_coef > 0,
        lora=getattr(args, "lora", None),  # --lora-rank: adapters trained, the base frozen
        critic=critic,
        reward_model=reward_model,
        teacher=_teacher_spec(args.teacher) if getattr(args, "teacher", None) else None,
        engine=engine,
        rollout_tp=args.rollout_tp if engine == "vllm" else 1,
        engine_share=None if args.gpu_memory_utilization is None else args.gpu_memory_utilization * share_scale,
        max_model_len=max_len,
        update_tokens=update_tokens,
        update_micro_batches=max(micro_batches, 1),
        logprob_tokens=lp_tokens or lp_size * max_len,
        recompute=args.recompute,
        recompute_modules=tuple(args.recompute_modules),
        recompute_layers=args.recompute_layers,
        offload_params=engine == "vllm" if args.offload_params is None else args.offload_params,
        offload_optimizer=engine == "vllm" if args.offload_optimizer is None else args.offload_optimizer,
        save_any_layout=bool(args.save_any_layout),
        sync_bucket_mb=args.sync_bucket_mb,
        remote_sync=remote_sync,
        gpu_bytes=gpu_bytes,
        gpus_per_node=per_node,
        node_bytes=node_bytes,
    )


@functools.lru_cache(maxsize=4)
def _teacher_spec(path):
    """--teacher's HFModelSpec from its config.json (checked by common/run/preflight.py)."""
    from common.model.gpt import load_hf_spec

    return load_hf_spec(path)


def check_memory(parser, args, spec, *, has_critic=False):
    """The run's memory plan, on every rank alike (same files, same flags: same decision): fills
    args' derived defaults, prints (rank 0); where a phase cannot fit, parser.error (one line on
    rank 0, exit 2). has_critic: PPO (its critic: --critic-model's config, else the policy's).
    Returns the Plan."""
    try:
        return _check_memory(args, spec, has_critic)
    except UsageError as e:
        parser.error(str(e))


def _check_memory(args, spec, has_critic):
    world, gpu_bytes, per_node, node_bytes = target_machine(args)  # (--world-size: checked by preflight)
    critic_spec = _critic_spec(args.critic_model, spec) if has_critic else None
    reward_spec = None
    if getattr(args, "reward_model", None):
        from common.train.reward_model import reward_model_spec

        reward_spec = reward_model_spec(args.reward_model)
    derived = []
    optimizer_dp = world // (args.tp * args.pp)
    if args.save_any_layout is None:
        args.save_any_layout = optimizer_dp == 1 or not args.distributed_optimizer
        derived.append(
            "--save-any-layout (data parallel 1: nothing to gather; checkpoints resume at any layout)"
            if args.save_any_layout
            else f"--no-save-any-layout (data parallel {optimizer_dp}: a save that resumes at any layout gathers "
            "12 bytes per parameter in host memory and blocks the loop; checkpoints resume at this TP/PP, any DP. "
            "--save-any-layout for any layout)"
        )
    # --gpu-memory-gb on a larger GPU (sharing it, or an 80 GB plan tried on a 141 GB card): the run plans for
    # that size and vLLM's share, a fraction of the whole card (vLLM's meaning), is scaled to keep within it
    real = None if args.dry_run else visible_gpu_bytes()
    scale = real / gpu_bytes if args.gpu_memory_gb and real and real > gpu_bytes else 1.0
    machine = (world, gpu_bytes, per_node, node_bytes, critic_spec, reward_spec)
    engines = getattr(args, "rollout_gpus", 0)  # GPUs of the launch that run only the engine (not in the plan)
    inputs = plan_inputs(args, spec, *machine, share_scale=scale)
    plan = first = M.plan_memory(**inputs)
    if _pass_problems(plan) and getattr(args, "micro_batch_size_derived", False) and not args.micro_batch_tokens:
        # the default micro-batches do not fit (or only without the plan's margin): a token budget that does
        tokens = fitting_micro_batch_tokens(inputs)
        if tokens is not None:
            full = inputs["update_tokens"]
            args.micro_batch_tokens = tokens
            inputs = plan_inputs(args, spec, *machine, share_scale=scale)
            plan = M.plan_memory(**inputs)
            derived.append(
                f"--micro-batch-tokens {tokens} (passes of --micro-batch-size {args.micro_batch_size} samples of "
                f"up to {full // args.micro_batch_size} tokens would need more than {M.WARN_AT:.0%} of the GPU in "
                f"the {' and '.join(sorted({phase for _, phase, _ in _pass_problems(first)}))} phase)"
            )
    if plan.engine_share_derived:
        args.gpu_memory_utilization = plan.engine_share / scale
        derived.insert(
            0,
            f"--gpu-memory-utilization {plan.engine_share / scale:.2f} (the engine's share of what the trainer "
            f"leaves on each GPU during the rollout: {plan.kv_tokens} tokens of KV cache per rank)",
        )
    if scale != 1.0:
        derived.append(
            f"the plan is for GPUs of {gpu_bytes / M.GB:.1f} GB (--gpu-memory-gb) on this {real / M.GB:.1f} GB GPU: "
            f"vLLM's --gpu-memory-utilization {args.gpu_memory_utilization:.2f} is of the whole card "
            f"({args.gpu_memory_utilization * real / M.GB:.1f} GB); mem_*_gb show what the phases used"
        )
    if plan.on_gpu:  # what the run's mem_*_gb metrics should read, in its config.json record
        predicted = {p: plan.total(p) for p in M.PHASE_METRICS if p in plan.phases}
        predicted["sync"] = max(predicted["sync"], predicted["rollout"])  # it ends after the KV cache wakes
        args.memory_plan_gb = {M.PHASE_METRICS[p]: round(v / M.GB, 1) for p, v in predicted.items()}
    master = launcher_rank() == 0
    if master:
        text = format_plan(plan, inputs) if args.dry_run else format_summary(plan)
        launch = (world + engines, gpu_bytes)  # (--rollout-gpus: the engines' GPUs too)
        if args.dry_run and gpu_bytes is not None and launch != (H100_NODE["world"], H100_NODE["gpu_bytes"]):
            text += "\n" + other_machine_line(inputs, **H100_NODE, engines=engines)
        print("\n".join(line for line in [text] + [f"derived: {d}" for d in derived] if line), flush=True)
    refused = [(phase, stage) for level, phase, stage in plan.problems() if level == "refuse"]
    refusal = refusal_message(plan, refused, inputs, args.dry_run, engines=engines) if refused else None
    capacity, place = (plan.device_bytes, "per GPU") if plan.on_gpu else (plan.capacity, "per rank")
    for level, phase, stage in plan.problems():
        if level == "warn" and master:
            print(
                f"warning: the {phase} phase needs {stage.total(phase) / M.GB:.1f} GB of {capacity / M.GB:.1f} GB "
                f"{place} ({stage.total(phase) / capacity:.0%}): close to the limit",
                flush=True,
            )
    # a dry run for GPUs elsewhere compares with this machine's host memory only as a hint
    elsewhere = args.dry_run and args.gpu_memory_gb and not args.host_memory_gb
    for level, what, need, have in plan.host_problems():
        if level == "refuse" and not elsewhere:
            refusal = refusal or host_refusal(plan, what, need, have)
        elif level == "refuse" and master:
            print(
                f"warning: {host_refusal(plan, what, need, have)}. That is this machine's memory: "
                "--host-memory-gb plans for the nodes of the run",
                flush=True,
            )
        elif master:
            print(
                f"warning: host memory: the {plan.ranks_per_node} ranks of a node may use {need / M.GB:.1f} GB "
                f"(pinned buffers, the save's gather, ~{M.PROCESS_HOST / M.GB:.0f} GB per process) of "
                f"{have / M.GB:.1f} GB",
                flush=True,
            )
    if refusal:
        raise UsageError(refusal)
    return plan


def _critic_spec(critic_dir, spec):
    """The critic's HFModelSpec: --critic-model's config.json (checked by preflight), else the policy's."""
    if critic_dir is None:
        return spec
    import json

    with open(os.path.join(critic_dir, "config.json")) as f:
        return parse_hf_config(json.load(f))


# ---------------------------------------------------------------------------------------
# What a phase that does not fit would need: the same plan with one flag changed
# ---------------------------------------------------------------------------------------
def alternatives(inputs, engines=0):
    """[(flags, plan)]: the plan again with one change each: recompute, smaller micro-batches
    (the largest power of two that fits), sequence parallelism, more tensor parallelism, the
    offloads, the engine's share derived, a larger engine TP, twice the GPUs. engines: --rollout-gpus
    (the plan is the trainer ranks'; twice the GPUs means twice the trainer's, the engines' added)."""
    layout_ok = _layout_check(inputs)
    out = []

    def candidate(flags, **changes):
        new = dict(inputs, **changes)
        if layout_ok(new):
            out.append((flags, M.plan_memory(**new)))
            return True
        return False

    if inputs["recompute"] != "full":
        candidate("--recompute full", recompute="full", recompute_layers=1)
    tokens = fitting_micro_batch_tokens(inputs)
    if tokens is not None:
        candidate(
            f"--micro-batch-tokens {tokens}",
            update_tokens=tokens,
            logprob_tokens=min(inputs["logprob_tokens"], tokens),
        )
    tp, rollout_tp, world = inputs["tp"] * 2, inputs["rollout_tp"] * 2, inputs["world"] * 2
    if inputs["tp"] > 1 and not inputs["sp"]:
        candidate("--sp", sp=True)
    wider = candidate(f"--tp {tp}", tp=tp)
    for flag in ("offload_params", "offload_optimizer"):
        if not inputs[flag] and inputs["engine"] == "vllm":
            candidate(f"--{flag.replace('_', '-')}", **{flag: True})
    if inputs["engine_share"] is not None:
        candidate("no --gpu-memory-utilization (the plan derives it)", engine_share=None)
    if inputs["engine"] == "vllm":
        candidate(f"--rollout-tp {rollout_tp}", rollout_tp=rollout_tp)
    more = dict(world=world, gpus_per_node=min(inputs["gpus_per_node"] * 2, 8))
    gpus = f"{world} GPUs" if not engines else f"{world} trainer GPUs (a launch of {world + engines})"
    candidate(gpus, **more)
    if not wider and inputs["engine"] is None:  # no engine on these ranks (--rollout-gpus, --load-rollouts)
        candidate(f"{gpus} with --tp {tp}", tp=tp, **more)
    elif not wider:
        candidate(
            f"{gpus} with --tp {tp} --rollout-tp {max(rollout_tp, tp)}", tp=tp, rollout_tp=max(rollout_tp, tp), **more
        )
    return out


def fitting_micro_batch_tokens(inputs):
    """The largest power of two >= 1024 below the plan's update tokens per pass with which every phase
    stays within the plan's margin (WARN_AT of the GPU: the plan is an estimate), else the largest with
    which none is refused (the forward-only passes capped alike); None if neither exists."""
    top = 2 ** int(math.log2(max(inputs["update_tokens"] - 1, 1)))
    for acceptable in (lambda plan: not _pass_problems(plan), lambda plan: not _refused(plan)):
        tokens = top
        while tokens >= 1024:
            smaller = dict(inputs, update_tokens=tokens, logprob_tokens=min(inputs["logprob_tokens"], tokens))
            if acceptable(M.plan_memory(**smaller)):
                return tokens
            tokens //= 2
    return None


def _pass_problems(plan):
    """The plan's problems in the phases whose size the tokens per pass set."""
    return [problem for problem in plan.problems() if problem[1] in ("logprob", "critic", "update")]


def _refused(plan):
    return any(level == "refuse" for level, _, _ in plan.problems())


def _layout_check(inputs):
    def ok(new):
        engine_tp = new["rollout_tp"] if new["engine"] else 1  # (no engine among these ranks: --rollout-gpus)
        if new["world"] % (new["tp"] * new["pp"] * new["cp"]) or new["world"] % engine_tp:
            return False
        try:
            check_parallel_layout(
                new["spec"],
                tp=new["tp"],
                pp=new["pp"],
                vpp=new["vpp"],
                ep=new["ep"],
                etp=new["etp"],
                first_stage_layers=new["first_stage_layers"],
                last_stage_layers=new["last_stage_layers"],
            )
        except ValueError:
            return False
        return True

    return ok


def refusal_message(plan, refused, inputs, dry_run=False, engines=0):
    """One line: the first phase that does not fit, the place, the shortfall, its largest items, the
    other phases over, and the single changes that make every phase fit (engines: --rollout-gpus)."""
    phase, stage = refused[0]
    fixes = [
        flags + ("" if phase == "kv cache" else f" ({max(s.total(phase) for s in other.stages) / M.GB:.1f} GB)")
        for flags, other in alternatives(inputs, engines)
        if not _refused(other)
    ]
    if fixes:
        advice = "try " + ", ".join(fixes[:4])
    else:
        advice = "no single change makes every phase fit: combine them (--dry-run shows each plan)"
    also = [f"{p} {s.total(p) / M.GB:.1f} GB" for p, s in refused[1:] if p != "kv cache"]
    also = f"; also over: {', '.join(also)}" if also else ""
    end = f"; {advice}" + ("" if dry_run else " (--dry-run prints the plan)")
    if phase == "kv cache":
        weights = next(i for i in stage.items if i.name.startswith("engine weights")).device["rollout"]
        return (
            f"the rollout phase: the engine's --gpu-memory-utilization {plan.engine_share:.2f} of each GPU "
            f"({plan.engine_share * plan.device_bytes / M.GB:.1f} GB) holds its weights ({weights / M.GB:.1f} GB) "
            f"and workspace ({M.ENGINE_WORKSPACE / M.GB:.1f} GB) and leaves KV cache for {plan.kv_tokens} tokens, "
            f"less than one sequence of {plan.max_model_len} (--max-prompt-len + --max-new-tokens){also}{end}"
        )
    need, capacity = stage.total(phase), plan.capacity
    place = "each GPU" if plan.on_gpu else "the host memory of each rank"
    largest = sorted((i for i in stage.items if i.device.get(phase, 0) > 0.05 * M.GB), key=lambda i: -i.device[phase])
    parts = ", ".join(f"{_short(i.name)} {i.device[phase] / M.GB:.1f}" for i in largest[:6])
    where = f" (pipeline stage {stage.stage})" if len(plan.stages) > 1 else ""
    return (
        f"the {phase} phase needs {need / M.GB:.1f} GB on {place}{where} of {capacity / M.GB:.1f} GB ({parts}): "
        f"short by {(need - capacity) / M.GB:.1f} GB{also}{end}"
    )


def host_refusal(plan, what, need, have):
    n = plan.ranks_per_node
    if what == "pinned":
        parts = plan.host_parts()
        detail = ", ".join(f"{k} {n * v / M.GB:.1f} GB" for k, v in parts.items() if v)
        return (
            f"the {n} rank(s) of a node would pin {need / M.GB:.1f} GB of host memory ({detail}) of "
            f"{have / M.GB:.1f} GB available: pinned memory cannot be swapped, and running out kills the job "
            "without a message; use fewer GPUs per node, free host memory, or keep the state on the GPUs where "
            "the plan allows (--no-offload-optimizer, --no-offload-params)"
        )
    gather = n * plan.host_stage.host_save
    return (
        f"a checkpoint save would need {need / M.GB:.1f} GB of host memory on each node of {have / M.GB:.1f} GB "
        f"available: the pinned buffers and the distributed optimizer's gather of --save-any-layout "
        f"({gather / M.GB:.1f} GB); pass --no-save-any-layout (checkpoints then resume at this TP/PP, any DP)"
    )


def _short(name):
    return name.split(" (")[0]


def other_machine_line(inputs, world, gpus_per_node, gpu_bytes, engines=0):
    """One line: the same flags on another machine (8 x 80 GB GPUs; engines: --rollout-gpus of them)."""
    what = f"{world} x {gpu_bytes / M.GB:.0f} GB GPUs (--world-size {world} --gpus-per-node {gpus_per_node} "
    what += f"--gpu-memory-gb {gpu_bytes / M.GB:.0f})"
    if engines:
        what += f", {world - engines} of them training (--rollout-gpus {engines})"
        world -= engines
    new = dict(inputs, world=world, gpus_per_node=min(gpus_per_node, world), gpu_bytes=gpu_bytes)
    if not _layout_check(inputs)(new):
        return f"on {what}: this layout does not divide {world} ranks"
    plan = M.plan_memory(**new)
    totals = ", ".join(f"{p} {max(s.total(p) for s in plan.stages) / M.GB:.1f}" for p in plan.phases)
    over = [p for level, p, _ in plan.problems() if level == "refuse"]
    return f"on {what}: {totals} GB per GPU: " + (f"{', '.join(over)} over" if over else "fits")
