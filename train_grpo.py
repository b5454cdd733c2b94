"""GRPO on Megatron-Core with a colocated rollout engine: the whole loop in one file.

GRPO (Shao et al. 2024, DeepSeekMath): sample a group of responses per prompt, score them
with a rule-based reward, use the group-normalised reward as every token's advantage, and
take PPO-clipped policy-gradient steps, optionally with a KL penalty to a frozen
reference. No value function (that is train_ppo.py). Variants are flags:
  Dr.GRPO (Liu et al. 2025): --no-std-norm --loss-agg seq_mean_token_sum_norm --kl-coef 0
  DAPO (Yu et al. 2025):     --clip-high 0.28 --loss-agg token_mean --kl-coef 0 --dynamic-sampling
                             --overlong-buffer N --mask-truncated (common/rl/dapo.py)
  GSPO (Zheng et al. 2025):  --gspo --clip-low 3e-4 --clip-high 4e-4 --loss-agg seq_mean_token_mean
  dual-clip PPO (Ye et al. 2020, verl's c = 3): --dual-clip 3
  on-policy distillation:    --teacher DIR [--rule-reward-weight 0] (per-token teacher - student advantage,
                             docs/distillation.md)

Every rank runs this same program (SPMD): it builds its shard of the Megatron-Core
GPTModel from the HF config.json, loads only its slice of the HF weights, hosts a rollout
engine, and each step does: weight sync -> rollout -> reward -> advantages -> old/ref
logprobs -> PPO epochs of forward-backward + optimizer step -> log -> checkpoint.

Launch:
  1 CPU, no downloads (embedded tiny model, synthetic arithmetic task):
      python train_grpo.py
      python train_grpo.py --env game --max-turns 2 --steps 60   # multi-turn episodes (docs/agentic.md)
  1 GPU:
      python train_grpo.py --model Qwen/Qwen2-1.5B --data openai/gsm8k --data-config main   # hub ids, or local paths
  8 GPUs (Megatron TP=4 x DP=2; vLLM TP=2 x 4 replicas):
      torchrun --nproc_per_node 8 train_grpo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4 --rollout-tp 2
  8 GPUs, vLLM on 4 of them generating all the time while the other 4 train, samples at most 2 steps old
  and continued across weight updates (docs/async.md):
      torchrun --nproc_per_node 8 train_grpo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4 \
          --rollout-gpus 4 --off-policy-steps 2 --partial-chunk-tokens 512
  Slurm, several nodes (same flags):
      sbatch launch/slurm.sh train_grpo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4
  On CPUs, torchrun works the same on gloo: torchrun --nproc_per_node 2 train_grpo.py --tp 2
"""

import functools
import json
import sys
import time

import torch

from common.run import flags as F
from common.run import flags_algo as FL
from common.run import flags_async as FA
from common.run import flags_rollout as FR
from common.run import flags_run
from common.run.cli import Parser, finish_evaluation, finish_training, parse_with_defaults, run_training
from common.run.memory_check import check_memory
from common.run.preflight import check_training_run


def build_parser():
    p = Parser(
        description=__doc__.split("\n\n")[0],
        epilog="Without --model (the embedded tiny model) these defaults change, unless set: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in EMBEDDED_DEFAULTS.items())
        + " (batch sizes: the largest up to these that divide the run's batches)",
    )
    m = F.model_flags(p)
    m.add_argument(
        "--mcore-ckpt",
        default=None,
        help="start from this megatron checkpoint (convert_hf_to_mcore.py output) instead of the HF weights of --model",
    )
    F.lora_flags(p)
    flags_run.data_flags(p)
    F.parallel_flags(p)
    FR.rollout_flags(p, group_help="group size G", models="policy, reference")
    a = p.add_argument_group("algorithm (GRPO)")
    FL.policy_loss_flags(a, agg_help="loss aggregation (DAPO / GRPO / Dr.GRPO)")
    FL.dapo_flags(a)  # --dynamic-sampling, --overlong-buffer, --mask-truncated (common/rl/dapo.py)
    a.add_argument(
        "--no-std-norm", action="store_true", help="advantages r - mean without dividing by the group std (Dr.GRPO)"
    )
    a.add_argument(
        "--kl-coef",
        type=float,
        default=0.001,
        help="KL penalty to the frozen reference (0 disables it and the reference model)",
    )
    a.add_argument("--kl-estimator", choices=["k1", "k2", "k3"], default="k3", help="per-token KL estimator")
    FR.correction_flags(p)
    FA.async_flags(p)
    FR.reward_flags(p)
    FR.distill_flags(p)
    FR.env_flags(p)
    FR.chat_template_flags(p)
    b = F.batch_flags(p)
    b.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
    o = F.optim_flags(p, "optimisation", lr_help="peak learning rate")
    o.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm")
    flags_run.plan_flags(p)
    r = flags_run.run_flags(p, out_prefix=OUT_PREFIX)
    flags_run.eval_only_flag(r)  # validation of given weights, no training
    flags_run.bench_flags(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    # without --model, the flags the user did not give take the embedded task's values
    args = parse_with_defaults(
        p, argv, lambda known: flags_run.embedded_defaults(EMBEDDED_DEFAULTS, known) if known.model is None else None
    )
    flags_run.resolve_out(args, OUT_PREFIX)  # default: one directory per model
    try:  # what the flags imply for one another: --off-policy-steps, --true-on-policy, corrections, --env, LoRA
        FL.resolve_training_flags(args)
    except ValueError as e:
        p.error(str(e))
    flags_run.check_eval_only(p, args)  # what --eval-only rules out
    spec = check_training_run(p, args, min_group=2)  # every mistake found here, before anything is built
    flags_run.eval_only_resume(p, args)  # --eval-only --resume: the newest checkpoint
    # GPU and host memory per rank and phase (common/run/memory_plan.py): derived defaults, refusals (exit 2)
    check_memory(p, args, spec)
    if args.dry_run:  # the plan printed is all a dry run does
        sys.exit(0)
    return args


OUT_PREFIX = "runs/grpo"  # the default --out: runs/grpo-<model name>

# The embedded tiny model starts from random weights: it needs a large step size, an
# entropy bonus against early collapse onto one digit, several optimizer steps per rollout
# batch, and one-token answers. Measured: see README (reward 0 -> ~0.9 in ~60 steps).
EMBEDDED_DEFAULTS = dict(lr=3e-3, entropy_coef=0.02, mini_batch_size=64, max_new_tokens=1, steps=100)


def main():
    from common.run.console import quiet_known_warnings, quiet_third_party_logging
    from common.run.startup import StartupClock
    from common.run.user_code import load_env, load_reward

    clock = StartupClock()  # where the start-up goes, said in one line before the first step
    quiet_known_warnings()  # first: some fire while megatron is imported (common/run/console.py says which and why)
    args = parse_args()
    quiet_third_party_logging(verbose=args.verbose)  # before vllm is imported: it reads its log level then
    user_reward = load_reward(args.reward) if args.reward else None  # checked now: exit 2 before anything is built
    env_class = load_env(args.env) if args.env else None  # --env NAME | FILE.py:CLASS, checked now too
    from megatron.core import parallel_state as mpu

    from common.model import moe
    from common.model import routing_replay as RR
    from common.model.flops import step_throughput
    from common.model.lora import adapters_disabled, add_lora
    from common.rl import batch as B
    from common.rl.advantages import group_advantages
    from common.rl.corrections import correction_weights, loss_weights, uses_old_logprobs
    from common.rl.distill import distill_advantages, reverse_kl_sum, teacher_topk_kl
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss, kl_penalty, masked_sum, policy_loss, policy_metrics
    from common.rollout.evaluate import evaluate_once
    from common.run import build
    from common.run.console import progress_bar
    from common.run.data import PromptSampler
    from common.run.dist import print0
    from common.run.sampling import StepRollouts
    from common.run.step import StepBatches, StepCheckpoints, teacher_pass
    from common.run.task import load_task, make_evaluator
    from common.train import passes, schedule
    from common.train.checkpoint import checkpoint_step
    from common.train.colocation import Colocation, PhaseMemory, Timer
    from common.train.guard import RunControl, check_finite, gate_on_policy
    from common.train.save import CheckpointWriter
    from common.train.setup import setup_training

    # torch.distributed and megatron's groups (torchrun / Slurm: common/run/dist.py); bf16 on GPUs, fp32 on CPUs
    info, dtype = build.start_distributed(args)
    if info.serves_rollouts:  # --rollout-gpus: this rank runs the rollout engine for the trainer ranks, nothing else
        return build.serve_rollouts(args, info)

    # ---- model source, tokenizer, prompts, reward ---------------------------------------
    hf_dir, spec = build.model_source(args.model, args.out, args.embedded_model, info)  # (or the embedded model)
    clock.mark("set-up")
    # --data's prompts, or the embedded task: repeat the digit ("7=" -> "7"), reward 1 when right; held-out
    # prompts for validation; --env: episodes of the environment (docs/agentic.md)
    task = load_task(args, hf_dir, spec, user_reward, env_class)
    tokenizer, pad_id = task.tokenizer, task.pad_id

    # ---- batch geometry (checked in common/run/preflight.py): rollout batch -> mini-batches -> micro-batches
    group = args.samples_per_prompt
    rollout_batch = args.prompts_per_step * group  # samples per step, global
    mini_batch = args.mini_batch_size or rollout_batch

    # ---- rollout engine, started first and asleep (with --load-rollouts: replayed samples, no engine) ----
    use_vllm = build.wants_vllm(args.rollout, info.device)
    max_model_len = build.context_len(args, task)  # the longest prompt + a response, or --env: an episode
    engine, rollout_tp = build.start_engine(args, hf_dir, info.device, use_vllm, max_model_len=max_model_len)
    clock.mark("engine")

    # ---- policy (trained), reference and teacher (frozen) ----------------------------
    layout = build.model_layout(args)  # parallel layout (MoE: experts over ep x etp), aux loss, recompute
    model = build.load_model(spec, dtype, layout, hf_dir, args.mcore_ckpt, exact=args.true_on_policy)
    optimizer, scheduler = None, None  # --eval-only: the weights alone, no optimizer
    if args.lora:  # the base frozen, adapters (B = 0: the base itself) trained: the optimizer sees only those
        add_lora(model, **args.lora, seed=args.seed)
    if not args.eval_only:
        model, optimizer, scheduler = setup_training(
            model,
            lr=args.lr,
            total_steps=args.steps * args.ppo_epochs * (rollout_batch // mini_batch),
            **build.optimizer_settings(args),
        )
    clock.mark("policy")
    # the frozen reference (with LoRA: the policy itself with its adapters off, no second copy) and --teacher's
    # model of on-policy distillation, sharded like the policy and offloaded between their passes
    use_reference = args.kl_coef > 0 and not args.eval_only
    reference, teacher, teacher_spec = build.load_frozen(
        args, spec, dtype, layout, hf_dir, use_reference=use_reference, clock=clock
    )

    folder = "eval_only" if args.eval_only else "eval"
    evaluator = make_evaluator(args, task, info, rollout_tp, user_reward, folder=folder)  # held-out validation
    weights = functools.partial(
        build.engine_weights, model, spec, engine, use_vllm=use_vllm, bucket_mb=args.sync_bucket_mb
    )  # the policy's weights, as the engine loads them
    if args.eval_only:  # the weights loaded above into the engine, validated once, as at that step of a run
        step = checkpoint_step(args.mcore_ckpt) if args.mcore_ckpt else 0
        metrics = evaluate_once(
            engine, evaluator, weights(), step, source=args.mcore_ckpt or hf_dir, master_process=info.master_process
        )
        print0(json.dumps({"step": step, **metrics}))
        return finish_evaluation(exit_hard=use_vllm)
    # Memory choreography on a shared GPU (common/train/colocation.py): what the rollout does not use waits in
    # pinned host memory, the reference but for its logprob pass. No-ops for tensors already on the CPU.
    offload_params = use_vllm if args.offload_params is None else args.offload_params
    colo = Colocation(
        engine,
        model,
        [(optimizer, model)],
        frozen=[reference, teacher],
        params=offload_params,
        optimizer_state=use_vllm if args.offload_optimizer is None else args.offload_optimizer,
        weights=weights,
    )
    # a model-based reward (common/train/reward_model.py): frozen, sharded like the policy, offloaded like the reference
    reward_model = build.load_reward_model(args, dtype, offload=offload_params) if args.reward_model else None
    clock.mark("reward model")

    checkpointed = [(model, optimizer)]  # what a checkpoint holds (staged in the offload's host buffers)
    build.check_pinned_memory(colo, checkpointed)  # this node's ranks within what it has, before pinning any
    clock.mark("set-up")
    colo.allocate()  # the pinned pool now (the first steps would pay seconds for it); the reference moves there
    clock.mark("pinned host memory")

    # ---- logging, resume ---------------------------------------------------------------
    sampler = PromptSampler(len(task.items), args.prompts_per_step, seed=args.seed)
    # steps 2 and 3: samples and rewards; carry: --off-policy-steps' groups in flight (common/rollout/partial.py)
    rollouts = StepRollouts(args, task, engine, info, rollout_tp, sampler, reward_model)
    carry = rollouts.carry
    start_step = build.resume_training(args, sampler, model, optimizer, scheduler, carry=carry)  # 0 unless --resume
    clock.mark("resume")
    logger = build.open_logger(args, info, dtype, engine=engine, use_vllm=use_vllm, rollout_tp=rollout_tp, colo=colo)
    logger.truncate_after(start_step)
    # the groups and length multiples of the trainer's passes (SP, CP, the experts' all-to-all)
    groups = build.pass_layout(spec, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp)
    tp_group, cp_group, multiple = groups.tp_group, groups.cp_group, groups.multiple
    # Dr.GRPO's constant length normaliser (--env: the model's tokens of a whole episode at most)
    norm_len = args.max_new_tokens * (args.max_turns if env_class else 1)
    # forward-only logprobs into a (N, T) store (common/train/passes.py): old, reference, teacher
    logprob_pass = functools.partial(
        passes.logprob_pass,
        vocab_size=spec.vocab_size,
        tp_group=tp_group,
        temperature=args.temperature,
        device=info.device,
    )

    memory = PhaseMemory()  # peak GPU memory per phase (mem_*_gb), sampled in the background
    # SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C, Slurm's time limit): finish the step, save, exit 0
    control = RunControl(
        save_every=args.save_every,
        save_every_minutes=args.save_every_minutes,
        stall_minutes=args.stall_dump_minutes,  # a step longer than this: every rank's stacks
        out=args.out,
        steps=None if args.bench_response_lengths else args.steps,  # a benchmark saves no last checkpoint
    )
    writer = CheckpointWriter(models=checkpointed, shared=colo.host_buffers)  # background saves
    saves = StepCheckpoints(writer, args, spec=spec, dtype=dtype, sampler=sampler, carry=carry, hf_dir=hf_dir)
    clock.mark("pinned host memory")
    print0(clock.line())
    progress = progress_bar(range(start_step, args.steps), "grpo", enabled=info.master_process)
    for step in progress:
        times, t0, side_metrics = {}, time.time(), {}  # side: validation, dynamic sampling
        timer = Timer(times)  # seconds per phase (*_s), for the metrics

        # ---- 1. weight sync -> 2. rollout -> 3. reward: each replica samples G responses for its share of the
        # prompts, then every rank has all of them, and their rewards (common/run/sampling.py)
        if engine is None:  # --load-rollouts: a saved run's samples and rewards
            samples, rewards = rollouts.load(step)
        else:  # weights synced first (all ranks: the export runs collectives); after the block the engine sleeps
            with colo.rollout(timer, memory):
                samples, rewards, group_prompts = rollouts.sample(step, timer, side_metrics)
                if evaluator.due(step):  # held-out validation with the weights this step samples with
                    with timer("eval"):
                        side_metrics.update(evaluator.run(engine, step))
            rewards = rollouts.add_reward_model(samples, rewards, group_prompts, timer, side_metrics)
        rollouts.check(step, samples, rewards, side_metrics)  # finite, --env's metrics, --save-rollouts

        # ---- 4. advantages: group-normalised reward, the same for every token of a sample
        advantages = group_advantages(rewards, group, normalize_std=not args.no_std_norm)  # (N,)
        # (N, T) tensors; --routing-replay rollout: + the engine's routes (N, T, MoE layers, top-k)
        batch = B.pack_sequences(samples, pad_id, length_multiple=multiple, routes=args.routing_replay == "rollout")
        if args.mask_truncated:  # DAPO's overlong filtering: a cut-off response says nothing of its answer
            batch["mask"][torch.tensor([s.finish_reason == "length" for s in samples])] = 0.0
            batch["rollout_mask"] *= batch["mask"]  # logprob_mismatch: the trainer's passes skip those rows
        batch["advantages"] = advantages[:, None] * batch["mask"]
        batch["row"] = torch.arange(len(samples))
        num_rows, seq_len = batch["tokens"].shape

        # this rank's micro-batches: .of(order, m) of mini-batch m, .forward_only() of all rows (common/run/step.py)
        micro = StepBatches(batch, args, info, groups, mini_batch=mini_batch, rollout_batch=rollout_batch)

        # ---- 5. old (behaviour) and reference logprobs, recomputed by the trainer
        memory.start()  # vLLM is asleep and the policy back: the trainer's passes from here
        all_mine = micro.forward_only()
        # On-policy (one epoch, one mini-batch, no correction that weighs old against engine logprobs): the old
        # logprobs are the update's own forward (detached; dropout is 0), so that pass is skipped (~8% of a 1.5B
        # step); not when --routing-replay old must record the routes the reference pass replays
        record_routes = args.routing_replay == "old"
        on_policy = args.ppo_epochs == 1 and mini_batch == rollout_batch and not (record_routes and use_reference)
        on_policy = on_policy and not uses_old_logprobs(args.rollout_correction)
        batch["old_logprobs"] = torch.zeros(num_rows, seq_len)
        if not on_policy:
            with timer("old_logprob"):
                routes = RR.route_store(num_rows, seq_len, spec, info.device) if record_routes else None
                logprob_pass(model, all_mine, batch["old_logprobs"], routes)
                if routes is not None:  # R2: the reference pass and the updates route as this pass did
                    batch["routes"] = RR.gathered_routes(routes)
                    all_mine = micro.forward_only()
            check_finite("old logprobs", batch["old_logprobs"], batch["mask"], step)  # the same on every rank
        batch["ref_logprobs"] = torch.zeros(num_rows, seq_len)
        if use_reference:  # LoRA: the policy's own chunks with the adapters off, else the frozen copy
            with timer("ref"), adapters_disabled(model) if args.lora else colo.frozen_model(reference):
                logprob_pass(model if args.lora else reference, all_mine, batch["ref_logprobs"])
            check_finite("reference logprobs", batch["ref_logprobs"], batch["mask"], step)
        if teacher is not None:  # on-policy distillation: the teacher scores every sampled token (+ its top-K)
            with timer("teacher"), colo.frozen_model(teacher):
                teacher_pass(teacher, teacher_spec, all_mine, batch, args, tp_group, info.device)
            check_finite("teacher logprobs", batch["teacher_logprobs"], batch["mask"], step)
        memory.end("logprob")
        # --rollout-correction's per-token weights of the policy term (common/rl/corrections.py), and their metrics
        batch["is_weights"], correction = correction_weights(
            args.rollout_correction,
            None if on_policy else batch["old_logprobs"],
            batch["rollout_logprobs"],
            batch["rollout_mask"],
            batch["mask"],
            low=args.correction_low,
            high=args.correction_high,
        )

        # ---- 6. policy update: PPO epochs over mini-batches, one optimizer step each
        colo.reload_optimizers(timer)  # on a GPU its copies overlap the passes below, up to the first optimizer step
        tick = time.time()
        train_metrics, grad_norms, lrs = [], [], []  # lrs: what each optimizer step used
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(args.seed + step * 31 + epoch))
            for m in range(rollout_batch // mini_batch):
                rows = order[m * mini_batch : (m + 1) * mini_batch]
                # global normalisers of this mini-batch (all DP ranks, all micro-batches)
                norm = dict(num_tokens=batch["mask"][rows].sum().clamp(min=1), num_seqs=len(rows), max_len=norm_len)
                mbs = micro.of(order, m)  # how many depends on the lengths with --micro-batch-tokens
                scale = len(mbs) * info.dp_size  # undo megatron's 1/num_micro and DDP's DP averaging

                def loss_fn(mb, logits):
                    mask = mb["mask"]
                    norm_mb = dict(norm, seq_ids=mb.get("seq"), seq_counts=mb.get("seq_counts"))  # packing / CP
                    logprobs, entropy = vocab_parallel_logprobs(
                        logits, mb["targets"], spec.vocab_size, tp_group, args.temperature, compute_entropy=True
                    )
                    old = logprobs.detach() if on_policy else mb["old_logprobs"]
                    advantages = mb["advantages"]  # (b, T): the group-normalised reward on every token
                    if teacher is not None and not args.distill_topk:  # + coef x (teacher - student) per token
                        advantages = advantages + distill_advantages(
                            mb["teacher_logprobs"], old, mask, args.distill_coef
                        )
                    # seq-offpolicy-mask: DeepSeek-V3.2's mask against this pass's policy (+ its metrics)
                    is_weights, masked = loss_weights(
                        args.rollout_correction, mb, logprobs, args.correction_delta, cp_group
                    )
                    per_token, clipped = policy_loss(
                        logprobs,
                        old,
                        advantages,
                        args.clip_low,
                        args.clip_high,
                        is_weights=is_weights,
                        dual_clip=args.dual_clip,
                        sequence_mask=mask if args.gspo else None,
                        seq_ids=mb.get("seq"),
                        cp_group=cp_group,
                    )
                    loss = aggregate_loss(per_token, mask, args.loss_agg, **norm_mb)
                    if use_reference:
                        kl = kl_penalty(logprobs, mb["ref_logprobs"], args.kl_estimator)
                        loss = loss + args.kl_coef * aggregate_loss(kl, mask, args.loss_agg, **norm_mb)
                    if args.entropy_coef:
                        loss = loss - args.entropy_coef * aggregate_loss(entropy, mask, args.loss_agg, **norm_mb)
                    if args.distill_topk:  # + coef x forward KL from the teacher's top-K to the student, per token
                        topk_kl = teacher_topk_kl(mb, logits, logprobs, tp_group, args.temperature)
                        loss = loss + args.distill_coef * aggregate_loss(topk_kl, mask, args.loss_agg, **norm_mb)
                    n = mask.sum()  # the policy loss's metrics; first: before any update, old = new but for rounding
                    first = epoch == 0 and m == 0 and not on_policy  # (else the two passes disagree with each other)
                    drift = old - logprobs.detach()
                    metrics = policy_metrics(loss, entropy, clipped, drift, mask, norm["num_tokens"], first=first)
                    metrics.update(masked)  # --rollout-correction's masked shares
                    if use_reference:
                        metrics.update(kl=masked_sum(kl.detach(), mask), kl__n=n)
                    if teacher is not None:  # mean student - teacher logprob: the sampled reverse KL per token
                        rkl = reverse_kl_sum(mb["teacher_logprobs"], old, mask)
                        metrics.update(distill_reverse_kl=rkl, distill_reverse_kl__n=n)
                    if args.distill_topk:
                        metrics.update(distill_topk_kl=masked_sum(topk_kl.detach(), mask), distill_topk_kl__n=n)
                    if on_policy and args.rollout_logprobs != "none":  # the one update's forward = old logprobs
                        mismatch = (mb["rollout_logprobs"] - logprobs.detach()).abs()
                        has_lp = mb["rollout_mask"]  # the samples that brought the engine's logprobs
                        metrics.update(logprob_mismatch=masked_sum(mismatch, has_lp), logprob_mismatch__n=has_lp.sum())
                    return loss * scale, metrics

                lrs.append(optimizer.param_groups[0]["lr"])  # the scheduler moves it after the step
                mb_metrics, grad_norm = schedule.train_step(
                    model,
                    optimizer,
                    scheduler,
                    mbs,
                    loss_fn,
                    info.device,
                    step=step,
                    before_step=lambda: colo.wait_optimizers(timer),
                )  # no update from a NaN/Inf loss or grad
                train_metrics += mb_metrics
                grad_norms.append(grad_norm)
        times["train_s"] = time.time() - tick
        memory.end("train")

        if not on_policy and args.rollout_logprobs != "none" and mpu.is_pipeline_last_stage(ignore_virtual=True):
            # |engine - trainer| on the samples that brought logprobs (old logprobs: on the last stage only)
            has_lp = batch["rollout_mask"]
            train_metrics.append(
                {
                    "logprob_mismatch": masked_sum((batch["rollout_logprobs"] - batch["old_logprobs"]).abs(), has_lp),
                    "logprob_mismatch__n": has_lp.sum(),
                    **correction,  # the same on every DP rank: their mean is the number
                }
            )

        # ---- 7. log (every rank joins the metric reduction), then checkpoint
        metrics = schedule.reduce_metrics(train_metrics, info.device)
        if spec.moe:  # expert load (max/mean routed tokens per layer) and the aux loss of the updates
            metrics.update(moe.step_metrics(model, spec, info.device))
        metrics.update(
            reward_mean=rewards.mean().item(),
            reward_std=rewards.std().item(),
            grad_norm=sum(grad_norms) / len(grad_norms),
            lr=sum(lrs) / len(lrs),  # this step's (the optimizer holds the next step's by now)
            response_len_mean=batch["response_len"].mean().item(),
            truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples),
        )
        if not batch["rollout_mask"].any():  # no engine logprob in the loss this step: no number, not a 0
            metrics.pop("logprob_mismatch", None)
        if writer.poll():  # a background save finished on every rank: published, `latest` moved
            metrics["save_total_sec"] = writer.last["total_s"]  # its whole time, mostly hidden
        save, stop = control.step_end(step, info.device)  # --save-every(-minutes), last step, a signal
        if save:  # in the background: the loop waits for checks, planning and copies to host memory (save_s)
            saves.save(step + 1, model, optimizer, scheduler, times, metrics)
        times["step_s"] = time.time() - t0
        metrics.update(
            times,
            **memory.metrics,
            **side_metrics,
            **step_throughput(  # tokens/s, MFU; passes per token: a backward is 2
                spec,
                samples,
                times,
                forward_passes=1 + use_reference + 3 * args.ppo_epochs,
                other_models=[teacher_spec] if teacher is not None else [],  # its own size
                world_size=info.global_world_size,  # per GPU: the engines' own (--rollout-gpus) included
                device=info.device,
            ),
        )
        logger.log_samples(step, tokenizer, samples, rewards, every=args.log_samples_every, stride=group)  # rank 0
        logger.log(step, metrics)
        if info.master_process:
            progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics.get('kl', 0):.4f}")
        if args.check_on_policy is not None and step == start_step:  # slime's CI gate on the run's first update
            gate_on_policy(metrics, args.check_on_policy, step, flush=lambda: (writer.wait(), logger.close()))
        if stop:
            print0(control.stop_message(step))
            break

    control.close()  # no more steps: the stall timer off
    # the last save awaited and published, the last metrics printed; with vLLM: os._exit (common/run/cli.py)
    finish_training(
        writer, logger, summary=metrics if start_step < args.steps else None, exit_hard=use_vllm and engine is not None
    )


if __name__ == "__main__":
    run_training(main)
