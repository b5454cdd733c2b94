"""What both training scripts build at start-up, in the order they build it: the process group, the
model's source, the rollout engine, the models (trained and frozen), the run's records.

    info, dtype = start_distributed(args)
    if info.serves_rollouts:                  # --rollout-gpus: an engine rank runs serve_rollouts, nothing else
        return serve_rollouts(args, info)
    hf_dir, spec = model_source(args.model, args.out, args.embedded_model, info)
    engine, rollout_tp = start_engine(args, hf_dir, info.device, use_vllm, max_model_len=...)
    layout = model_layout(args)
    model = load_model(spec, dtype, layout, hf_dir, args.mcore_ckpt)
    ...

Like flags.py, some take the parsed args (those that read many flags, each named in the docstring); a
script edits what it builds by editing its call, or by writing the few lines of a function out in place.
All ranks call every function here (each builds its own shard; several run collectives).
"""

import os
from dataclasses import dataclass

import torch

from common.run.dist import print0, role_store


def start_distributed(args):
    """(info, dtype): torch.distributed and megatron's parallel groups from --tp --pp --vpp --cp --ep --etp
    (common/run/dist.py), --seed; the trainer's dtype (--dtype, default bf16 on GPUs, fp32 on CPUs), said in
    one line; --out made."""
    from common.run.dist import init_distributed
    from common.run.flags_async import remote_mode

    info = init_distributed(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        seed=args.seed,
        rollout_gpus=getattr(args, "rollout_gpus", 0),
    )
    on_gpu = info.device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_gpu else "fp32")]
    print0(
        f"world {info.world_size}: tp {info.tp_size} pp {info.pp_size} dp {info.dp_size}"
        + (f" ep {info.ep_size} etp {info.etp_size}" if args.ep * args.etp > 1 else "")
        + f" on {info.device}, {dtype}"
        + (
            f"; {info.rollout_gpus} more rank(s) run the rollout engine only: {remote_mode(args)}"
            if info.rollout_gpus
            else ""
        )
    )
    os.makedirs(args.out, exist_ok=True)
    return info, dtype


def model_source(model, out, embedded_model, info):
    """(hf_dir, spec): --model's directory, or without it the embedded tiny model, made in code into
    <out>/embedded_model by the first rank (needs a shared --out across nodes); spec: its config."""
    import torch.distributed as dist

    from common.model.gpt import load_hf_spec
    from common.run.embedded import EMBEDDED_MODELS, write_embedded_model

    hf_dir = model or os.path.join(out, "embedded_model")
    if model is None and info.master_process:
        write_embedded_model(hf_dir, **EMBEDDED_MODELS[embedded_model])
    dist.barrier()
    return hf_dir, load_hf_spec(hf_dir)


def wants_vllm(rollout, device):
    """--rollout: vllm, cpu, or auto (vLLM where there is a GPU and vLLM is installed)."""
    from common.rollout.engines import vllm_available

    return rollout == "vllm" or (rollout == "auto" and device.type == "cuda" and vllm_available())


def context_len(args, task):
    """The engine's context: the longest prompt (at most --max-prompt-len) + a whole response, or with --env a
    whole episode's (--max-episode-tokens, capped at the model's positions)."""
    if args.env:
        return args.max_episode_tokens
    return max(map(len, task.prompt_ids + task.eval_prompt_ids)) + args.max_new_tokens


def start_engine(args, hf_dir, device, use_vllm, *, max_model_len):
    """(engine, rollout TP size): one replica per rank (CPU / vLLM TP=1) or per vLLM TP group of
    --rollout-tp ranks (common/rollout/engines.py), asleep; with --load-rollouts no engine (None: replayed
    samples). Reads --rollout-tp --gpu-memory-utilization --seed --routing-replay --rollout-eager.

    Started before the trainer's state exists: vLLM takes --gpu-memory-utilization of the GPU and checks at
    start that so much is free; it then sleeps (weights and KV cache freed) until the first rollout's weight
    sync wakes it (common/train/colocation.py Colocation.rollout)."""
    from common.rollout.engines import make_engine

    if args.load_rollouts:
        return None, args.rollout_tp
    if getattr(args, "rollout_gpus", 0):  # the engines on their own ranks: this side sends them requests
        import torch.distributed as dist

        from common.rollout.remote import Link, RemoteEngine

        trainers = dist.get_world_size()  # (the trainer ranks' group)
        link = Link(role_store(), trainers, args.rollout_gpus, dist.get_rank(), device)
        engine = RemoteEngine(link, bucket_mb=args.sync_bucket_mb, behind=args.sync_overlap == "on")
        engine.start(hf_dir=hf_dir, max_model_len=max_model_len)  # (stopped as the run ends: common/run/cli.py)
        return engine, trainers  # the trainer ranks are one replica to the loop: the first one's samples count
    engine, rollout_tp = make_engine(
        use_vllm,
        hf_dir,
        rollout_tp=args.rollout_tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_model_len,
        seed=args.seed,
        device=device,
        return_routes=args.routing_replay == "rollout",  # R3: the experts of every token, to replay
        enforce_eager=args.rollout_eager,
        batch_invariant=args.true_on_policy,
    )
    if args.true_on_policy:
        from common.model.exact import bind

        bind(engine)  # the trainer repeats the engine's start-up choices (common/model/exact.py)
    engine.sleep()
    return engine, rollout_tp


def serve_rollouts(args, info):
    """--rollout-gpus: an engine rank's whole run. Waits for the first trainer rank's start-up settings (the model's
    directory, prompt + response tokens), builds the engine (--rollout, --rollout-tp, --gpu-memory-utilization,
    default 0.85 of its own GPU, --seed, --rollout-eager), answers the trainer's requests until it says stop
    (common/rollout/remote.py), then leaves (with vLLM: os._exit, as the trainer ranks do)."""
    import sys

    from common.rollout.engine import rollout_replica
    from common.rollout.engines import make_engine
    from common.rollout.remote import Link, serve

    use_vllm = wants_vllm(args.rollout, info.device)
    rollout_tp = args.rollout_tp if use_vllm else 1
    trainers = info.global_world_size - info.rollout_gpus
    link = Link(role_store(), trainers, info.rollout_gpus, info.global_rank, info.device)

    if use_vllm and "VLLM_CACHE_ROOT" not in os.environ:
        # vLLM keeps its compiled kernels per vLLM rank and they stay bound to the GPU they were built on: this
        # rank's vLLM rank 0 sits on GPU LOCAL_RANK, a colocated run's on GPU 0, and loading the other's kernels
        # fails ("CUDA driver error: invalid argument", seen on two H200s): a cache of the engine ranks' own
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(cache, "vllm", f"rollout-gpu{info.local_rank}")

    def build(hf_dir, max_model_len):
        engine, _ = make_engine(
            use_vllm,
            hf_dir,
            rollout_tp=rollout_tp,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.85,
            max_model_len=max_model_len,
            seed=args.seed,
            device=info.device,
            enforce_eager=args.rollout_eager,
        )
        return engine

    replica, num_replicas = rollout_replica(info.rank, rollout_tp, info.world_size)
    serve(link, build, replica, num_replicas, first_of_replica=info.rank % rollout_tp == 0)
    sys.stdout.flush(), sys.stderr.flush()
    if use_vllm:  # vLLM's in-process engine can block interpreter exit
        os._exit(0)


def engine_weights(model, spec, engine, *, use_vllm, bucket_mb):
    """The policy's weights as the engine loads them: (HF name, full tensor) in buckets of bucket_mb
    (--sync-bucket-mb), bf16 for vLLM, fp32 for the CPU engine (common/model/weights.py). All ranks
    iterate it (the export runs collectives)."""
    from common.model.weights import export_hf_weights

    return export_hf_weights(
        model,
        spec,
        dtype=torch.bfloat16 if use_vllm else torch.float32,
        bucket_mb=bucket_mb,
        expert_blocks=engine.expert_blocks,
        local_reads=engine.local_reads,
    )


def model_layout(args):
    """How the policy, reference, teacher (and critic) are built (build_model's keywords): the parallel layout
    (--tp --pp --vpp --cp --ep --etp --sp --first/last-stage-layers; MoE: experts over ep x etp), the MoE
    flags (--moe-*), --recompute*, Qwen3.5's --gdn-kernel."""
    from common.model.bridge import recompute_config
    from common.run.flags import moe_overrides

    return dict(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sequence_parallel=args.sp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        moe_aux_loss_coef=args.moe_aux_loss_coef,
        gdn_kernel=args.gdn_kernel,
        **moe_overrides(args),
        **recompute_config(args.recompute, args.recompute_modules, args.recompute_layers),
    )


def optimizer_settings(args):
    """setup_training's keywords of the learning-rate schedule and optimizer but the peak lr and the
    total steps: --min-lr --weight-decay --clip-grad --lr-warmup-steps --lr-decay --distributed-optimizer."""
    return dict(
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        warmup_steps=args.lr_warmup_steps,
        decay_style=args.lr_decay,
        use_distributed_optimizer=args.distributed_optimizer,
    )


def load_model(spec, dtype, layout, hf_dir, mcore_ckpt=None, *, frozen=False, exact=False):
    """This rank's chunks of the GPTModel of spec, built with `layout` (model_layout), weights from a megatron
    checkpoint (--mcore-ckpt) or else the HF safetensors of hf_dir (only this rank's slices are read).
    frozen: eval mode, no gradients (a reference or a teacher). exact: --true-on-policy, the forward on the
    rollout engine's kernels (common/model/exact.py)."""
    from common.model.gpt import build_model
    from common.model.weights_load import load_hf_weights
    from common.train.checkpoint import load_model_checkpoint

    chunks = build_model(spec, dtype=dtype, **layout)
    if spec.gdn is not None and not frozen:
        print0(f"gated delta nets: the {layout.get('gdn_kernel', 'torch')} recurrence (--gdn-kernel)")
    if mcore_ckpt:
        load_model_checkpoint(mcore_ckpt, chunks)
    else:
        load_hf_weights(chunks, spec, hf_dir)
    if frozen:
        for chunk in chunks:
            chunk.eval().requires_grad_(False)
    if exact:
        from common.model.exact import convert

        convert(chunks)
    return chunks


def load_teacher(teacher_dir, dtype, layout):
    """(teacher, teacher_spec) of on-policy distillation (--teacher): a frozen model of its own
    architecture and size, sharded like the policy (its vocabulary was checked against the policy's in
    common/run/preflight.py)."""
    from common.model.gpt import load_hf_spec

    teacher_spec = load_hf_spec(teacher_dir)
    return load_model(teacher_spec, dtype, layout, teacher_dir, frozen=True), teacher_spec


def load_frozen(args, spec, dtype, layout, hf_dir, *, use_reference, clock):
    """The frozen models beside the policy, each sharded like it, and their start-up seconds (clock): the KL's
    reference when use_reference (None with LoRA: the policy with its adapters off is the base) and on-policy
    distillation's teacher (--teacher) with its spec. (reference, teacher, teacher_spec); None where absent."""
    reference, teacher, teacher_spec = None, None, None
    if use_reference and not args.lora:
        reference = load_model(spec, dtype, layout, hf_dir, args.mcore_ckpt, frozen=True, exact=args.true_on_policy)
    clock.mark("reference")
    if args.teacher and not getattr(args, "eval_only", False):  # (train_grpo.py --eval-only: the policy alone)
        teacher, teacher_spec = load_teacher(args.teacher, dtype, layout)
    clock.mark("teacher")
    return reference, teacher, teacher_spec


def load_critic(args, hf_dir, dtype, layout, *, total_steps, lr_schedule):
    """PPO's critic, (critic_spec, chunks, optimizer, scheduler): the body of --critic-model (default the actor's
    model; its vocabulary checked in common/run/preflight.py), a GPTModel sharded like the actor, with a scalar
    value head on the last pipeline stage (its forward returns values (B, T, 1) where the actor's returns logits);
    the body from HF, the head zero unless the directory has one; its own Adam at --critic-lr."""
    from common.model.critic import build_critic, load_critic_weights
    from common.model.gpt import load_hf_spec
    from common.train.setup import setup_training

    critic_dir = args.critic_model or hf_dir
    critic_spec = load_hf_spec(critic_dir)
    chunks = build_critic(critic_spec, dtype=dtype, **layout)
    load_critic_weights(chunks, critic_spec, critic_dir)
    return critic_spec, *setup_training(chunks, lr=args.critic_lr, total_steps=total_steps, **lr_schedule)


def load_reward_model(args, dtype, *, offload):
    """--reward-model's frozen scorer (common/train/reward_model.py), sharded like the policy (--tp --pp
    --vpp --cp --sp), scoring --micro-batch-size samples a pass; offload: kept in host memory but for its
    pass, like the reference."""
    from common.train.reward_model import RewardModel

    return RewardModel.load(
        args.reward_model,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        sequence_parallel=args.sp,
        dtype=dtype,
        micro_batch_size=args.micro_batch_size,
        offload=offload,
    )


def check_pinned_memory(colo, checkpointed):
    """Pinned host memory of this node's ranks within what it has (else a SIGKILL, no message): the offload's
    one pool and the checkpoint staging's own buffer for what the pool does not hold, by arithmetic.
    checkpointed: what a checkpoint holds, [(chunks, optimizer)]."""
    from common.run.host_memory import check_host_memory
    from common.train.save import CheckpointWriter

    check_host_memory(
        {
            "offload buffers": colo.host_bytes(),
            "checkpoint staging": CheckpointWriter.host_bytes(checkpointed, colo.host_buffers),
        }
    )


@dataclass
class PassLayout:
    """What the trainer's passes need of the parallel layout."""

    tp_group: object  # the vocabulary-parallel logprobs' group
    cp_group: object  # context parallel's (None without CP): GSPO's ratio sums each sample's CP chunks
    expert_peers: object  # ranks whose passes meet in the experts' all-to-all: equally many micro-batches
    multiple: int  # rows' length multiple (SP and CP)
    sample_multiple: int  # packed samples' length multiple (CP)


def pass_layout(spec, *, tp, cp, ep, etp):
    """The groups and length multiples of the trainer's passes, from megatron's parallel state."""
    from megatron.core import parallel_state as mpu

    from common.rl.batch import length_multiples

    multiple, sample_multiple = length_multiples(tp, cp)
    return PassLayout(
        tp_group=mpu.get_tensor_model_parallel_group(),
        cp_group=mpu.get_context_parallel_group() if cp > 1 else None,
        expert_peers=mpu.get_data_parallel_group() if spec.moe and ep * etp > 1 else None,
        multiple=multiple,
        sample_multiple=sample_multiple,
    )


def resume_training(args, sampler, model, optimizer, scheduler, *, extra_models=None, carry=None):
    """The step to start from: 0, or with --resume the newest checkpoint of <out>/checkpoints loaded into the
    model, optimizer, scheduler (and extra_models, {name: (chunks, optimizer, scheduler)}), the prompt sampler
    and carry (--off-policy-steps' samples in flight, common/rollout/partial.py, their versions included); the
    schedule flags that changed since, said (the schedule follows this run's flags from the resumed step on)."""
    from common.run.flags import schedule_flags
    from common.train.resume import changed_flags, load_training_checkpoint

    if not args.resume:
        return 0
    ckpt_root = os.path.join(args.out, "checkpoints")  # (common/run/preflight.py made sure there is one)
    extra = load_training_checkpoint(ckpt_root, model, optimizer, scheduler, extra_models=extra_models)
    start_step = extra["step"]
    sampler.load_state_dict(extra["sampler"])  # (refused if the data or --seed changed)
    if carry is not None:
        carry.load_state_dict(extra.get("partial", {"groups": []}))
    print0(f"resumed from step {start_step}")
    for line in changed_flags(extra.get("flags", {}), schedule_flags(args), start_step):
        print0(line)
    return start_step


def open_logger(args, info, dtype, *, engine, use_vllm, rollout_tp, colo):
    """metrics.jsonl (and wandb: --wandb --wandb-project --run-name) under --out, written by the first rank;
    its run record holds the arguments as resolved (what ran: dtype, engine, offloads, wandb) and the
    command line as given. colo: the run's Colocation (what it offloads)."""
    from common.run.log import MetricsLogger, default_wandb_mode, run_record

    return MetricsLogger(
        args.out,
        run_record(
            dict(
                vars(args),
                dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
                rollout="none (--load-rollouts)" if engine is None else "vllm" if use_vllm else "cpu",
                rollout_tp=rollout_tp,
                offload_params=colo.params,
                offload_optimizer=colo.optimizer_state,
                wandb=args.wandb or default_wandb_mode(),
            ),
            dict(info.layout(), dtype=str(dtype)),
        ),
        wandb_mode=args.wandb or default_wandb_mode(),
        project=args.wandb_project,
        run_name=args.run_name,
        enabled=info.master_process,
        resume=bool(args.resume),
    )
