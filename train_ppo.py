"""PPO with a learned critic and GAE on Megatron-Core, with a colocated rollout engine: the whole loop in one file.

PPO for language models (Schulman et al. 2017; Ouyang et al. 2022, InstructGPT): sample
responses, score them with a rule-based reward placed on the last response token, subtract
a per-token KL penalty to a frozen reference (or put the KL in the loss), estimate each
token's advantage with GAE (Schulman et al. 2015) from a learned value function (the
critic: the same transformer with a scalar head), then take PPO-clipped policy steps and
clipped value-regression steps. Not GRPO (no groups needed, no group-normalised reward:
that is train_grpo.py). The reward: a rule, a reward model (--reward-model) or both.

Every rank runs this same program (SPMD): it builds its shard of the actor, the critic and the
frozen reference (Megatron-Core GPTModels, sharded alike by TP/PP) from the HF config.json, hosts
a rollout engine, and each step does: weight sync -> rollout -> reward -> old/ref logprobs and
values -> token rewards -> GAE -> PPO epochs of actor and critic updates -> log -> checkpoint.
The first --critic-warmup-steps steps train only the critic.
On-policy distillation: --teacher DIR adds coef x (teacher - student logprob) to each token's advantage
after GAE (--rule-reward-weight 0: the teacher alone; docs/distillation.md).

Launch:
  1 CPU, no downloads (embedded tiny model, synthetic task):
      python train_ppo.py
      python train_ppo.py --env game --max-turns 2 --steps 60   # multi-turn episodes (docs/agentic.md)
  1 GPU:
      python train_ppo.py --model Qwen/Qwen2-1.5B --data openai/gsm8k --data-config main   # hub ids, or local paths
  8 GPUs (Megatron TP=4 x DP=2 for actor and critic; vLLM TP=2 x 4 replicas):
      torchrun --nproc_per_node 8 train_ppo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4 --rollout-tp 2
  Slurm, several nodes (same flags):
      sbatch launch/slurm.sh train_ppo.py --model /models/Qwen2-7B --data gsm8k.parquet --tp 4
  On CPUs, torchrun works the same on gloo: torchrun --nproc_per_node 2 train_ppo.py --tp 2
"""

import functools
import math
import sys
import time

import torch

from common.run import flags as F
from common.run import flags_algo as FL
from common.run import flags_async as FA
from common.run import flags_rollout as FR
from common.run import flags_run
from common.run.cli import Parser, finish_training, parse_with_defaults, run_training
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
        help=(
            "start the actor and reference from this megatron checkpoint (convert_hf_to_mcore.py output) instead of "
            "the HF weights of --model"
        ),
    )
    F.lora_flags(p, trained="actor")
    m.add_argument(
        "--critic-model",
        default=None,
        help=(
            "HF causal-LM dir or hub id to initialise the critic's body from (a score.weight/score.bias value head "
            "in it is used too); default: --model"
        ),
    )
    flags_run.data_flags(p)
    F.parallel_flags(p)  # the critic is sharded like the actor
    FR.rollout_flags(p, group_help="responses sampled per prompt", models="actor, critic, reference")
    a = p.add_argument_group("algorithm (PPO)")
    # advantages
    a.add_argument("--gamma", type=float, default=1.0, help="GAE discount (1: no discount within a response)")
    a.add_argument("--lam", type=float, default=0.95, help="GAE lambda (1: Monte-Carlo returns, 0: one-step TD)")
    a.add_argument(
        "--kl-coef",
        type=float,
        default=0.001,
        help="KL penalty to the frozen reference (0 disables it and the reference model)",
    )
    a.add_argument(
        "--kl-mode",
        choices=["reward", "loss"],
        default="reward",
        help=(
            "reward: -kl_coef * KL added to every token's reward (InstructGPT); loss: a KL term in the actor loss "
            "(GRPO-style)"
        ),
    )
    a.add_argument(
        "--kl-estimator",
        choices=["k1", "k2", "k3"],
        default=None,
        help=(
            "per-token KL estimator; default k1 (log pi/ref) in the reward, k3 in the loss (k1's gradient as a loss "
            "is 0 in expectation)"
        ),
    )
    # losses
    FL.policy_loss_flags(a, agg_help="policy loss aggregation (the value loss is always token_mean)")
    a.add_argument(
        "--vf-clip",
        type=float,
        default=0.2,
        help="value clip: new values stay within this distance of the rollout's values",
    )
    a.add_argument(
        "--critic-warmup-steps",
        type=int,
        default=0,
        help="the first N steps update only the critic (the actor is left unchanged)",
    )
    FR.correction_flags(p)
    FA.async_flags(p)
    FR.reward_flags(p)
    FR.distill_flags(p)
    FR.env_flags(p)
    FR.chat_template_flags(p)
    b = F.batch_flags(p)
    b.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch (actor and critic)")
    o = F.optim_flags(
        p,
        "optimisation (two optimizers: actor and critic)",
        lr_help="actor peak learning rate",
        scope=" (actor and critic)",
    )
    o.add_argument("--critic-lr", type=float, default=1e-5, help="critic peak learning rate")
    o.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm (each model separately)")
    flags_run.plan_flags(p)
    flags_run.run_flags(p, out_prefix=OUT_PREFIX)
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
    spec = check_training_run(p, args, critic_model=args.critic_model)  # every mistake, before anything is built
    # GPU and host memory per rank and phase (common/run/memory_plan.py): derives the defaults it
    # can (--gpu-memory-utilization, --save-any-layout), refuses what cannot fit (exit 2)
    check_memory(p, args, spec, has_critic=True)
    if args.dry_run:  # the plan printed is all a dry run does
        sys.exit(0)
    if args.kl_estimator is None:
        args.kl_estimator = {"reward": "k1", "loss": "k3"}[args.kl_mode]
    return args


OUT_PREFIX = "runs/ppo"  # the default --out: runs/ppo-<model name>

# As train_grpo.py's, plus the critic's learning rate and micro-batches of 32 (the same math;
# per-micro-batch overheads dominate a model this small: 2.5x faster steps; docs/algorithms.md).
EMBEDDED_DEFAULTS = dict(
    lr=3e-3, critic_lr=3e-3, entropy_coef=0.02, mini_batch_size=64, micro_batch_size=32, max_new_tokens=1, steps=100
)


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

    from common.model import moe
    from common.model import routing_replay as RR
    from common.model.flops import step_throughput
    from common.model.lora import adapters_disabled, add_lora
    from common.rl import batch as B
    from common.rl.advantages import gae, masked_whiten
    from common.rl.corrections import correction_weights, loss_weights
    from common.rl.distill import distill_advantages, teacher_topk_kl
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import (
        aggregate_loss,
        explained_variance,
        kl_penalty,
        masked_mean,
        masked_sum,
        policy_loss,
        policy_metrics,
        value_loss,
    )
    from common.run import build
    from common.run.console import progress_bar
    from common.run.data import PromptSampler
    from common.run.dist import print0
    from common.run.sampling import StepRollouts
    from common.run.step import StepBatches, StepCheckpoints, teacher_pass
    from common.run.task import load_task, make_evaluator
    from common.train import passes, schedule
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

    # ---- batch geometry: rollout batch -> mini-batches (optimizer steps) -> micro-batches
    group = args.samples_per_prompt
    rollout_batch = args.prompts_per_step * group  # samples per step, global
    mini_batch = args.mini_batch_size or rollout_batch
    updates_per_step = args.ppo_epochs * (rollout_batch // mini_batch)  # optimizer steps per model per step

    # ---- rollout engine, started first and asleep (with --load-rollouts: replayed samples, no engine) ----
    use_vllm = build.wants_vllm(args.rollout, info.device)
    max_model_len = build.context_len(args, task)  # the longest prompt + a response, or --env: an episode
    engine, rollout_tp = build.start_engine(args, hf_dir, info.device, use_vllm, max_model_len=max_model_len)
    clock.mark("engine")

    # ---- actor (trained), critic (trained), reference and teacher (frozen) ------------
    layout = build.model_layout(args)  # parallel layout (MoE: experts over ep x etp), aux loss, recompute
    lr_schedule = build.optimizer_settings(args)  # all but the peak lr and the total steps, for both models
    model = build.load_model(spec, dtype, layout, hf_dir, args.mcore_ckpt, exact=args.true_on_policy)
    if args.lora:  # the actor's base frozen, adapters (B = 0: the base itself) trained; the critic is trained whole
        add_lora(model, **args.lora, seed=args.seed)
    model, optimizer, scheduler = setup_training(
        model,
        lr=args.lr,
        total_steps=max(args.steps - args.critic_warmup_steps, 1) * updates_per_step,
        **lr_schedule,
    )
    clock.mark("policy")
    # the critic: a GPTModel body sharded like the actor with a scalar value head (values where the actor has logits)
    critic_spec, critic, critic_optimizer, critic_scheduler = build.load_critic(
        args, hf_dir, dtype, layout, total_steps=args.steps * updates_per_step, lr_schedule=lr_schedule
    )
    clock.mark("critic")
    # the frozen reference (with LoRA: the actor itself with its adapters off, no second copy) and --teacher's
    # model of on-policy distillation, sharded like the actor and offloaded between their passes
    use_reference = args.kl_coef > 0
    reference, teacher, teacher_spec = build.load_frozen(
        args, spec, dtype, layout, hf_dir, use_reference=use_reference, clock=clock
    )

    evaluator = make_evaluator(args, task, info, rollout_tp, user_reward)  # held-out validation
    # Memory choreography on a shared GPU (common/train/colocation.py, as in train_grpo.py): the critic
    # idles from its update until the next values pass, the reference but for its logprob
    # pass, both Adam states but for the updates. No-ops for tensors already on the CPU.
    offload_params = use_vllm if args.offload_params is None else args.offload_params
    colo = Colocation(
        engine,
        model,
        [(optimizer, model), (critic_optimizer, critic)],
        idle=[critic],
        frozen=[reference, teacher],
        params=offload_params,
        optimizer_state=use_vllm if args.offload_optimizer is None else args.offload_optimizer,
        # the actor's weights, as the engine loads them
        weights=functools.partial(
            build.engine_weights, model, spec, engine, use_vllm=use_vllm, bucket_mb=args.sync_bucket_mb
        ),
    )
    # a model-based reward (common/train/reward_model.py): frozen, sharded like the policy, offloaded like the reference
    reward_model = build.load_reward_model(args, dtype, offload=offload_params) if args.reward_model else None
    clock.mark("reward model")

    # what a checkpoint holds (staged in the offload's host buffers)
    checkpointed = [(model, optimizer), (critic, critic_optimizer)]
    build.check_pinned_memory(colo, checkpointed)  # this node's ranks within what it has, before pinning any
    clock.mark("set-up")
    colo.allocate()  # the pinned pool now (the first steps would pay seconds for it); the reference moves there
    clock.mark("pinned host memory")

    # ---- logging, resume (the critic is saved in the actor's step directory) -------------
    sampler = PromptSampler(len(task.items), args.prompts_per_step, seed=args.seed)
    # steps 2 and 3: samples and rewards; carry: --off-policy-steps' groups in flight (common/rollout/partial.py)
    rollouts = StepRollouts(args, task, engine, info, rollout_tp, sampler, reward_model)
    carry = rollouts.carry
    critic_state = {"critic": (critic, critic_optimizer, critic_scheduler)}
    # 0 unless --resume: then the newest checkpoint's step
    start_step = build.resume_training(
        args, sampler, model, optimizer, scheduler, extra_models=critic_state, carry=carry
    )
    clock.mark("resume")
    logger = build.open_logger(args, info, dtype, engine=engine, use_vllm=use_vllm, rollout_tp=rollout_tp, colo=colo)
    logger.truncate_after(start_step)
    # the groups and length multiples of the trainer's passes (SP, CP, the experts' all-to-all)
    groups = build.pass_layout(spec, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp)
    tp_group, cp_group, multiple = groups.tp_group, groups.cp_group, groups.multiple
    # Dr.GRPO's constant length normaliser (--env: the model's tokens of a whole episode at most)
    norm_len = args.max_new_tokens * (args.max_turns if env_class else 1)
    # forward-only per-token numbers into a (N, T) store on every rank (common/train/passes.py)
    forward_pass = functools.partial(passes.forward_pass, device=info.device)

    def logprobs_of(mb, logits, vocab_size=spec.vocab_size):  # logits (b, T, V/tp) -> (b, T)
        return vocab_parallel_logprobs(logits, mb["targets"], vocab_size, tp_group, args.temperature)[0]

    memory = PhaseMemory()  # peak GPU memory per phase (mem_*_gb), sampled in the background
    # SIGTERM/SIGINT/SIGUSR1 (preemption, Ctrl-C, Slurm's time limit): finish the step, save, exit 0
    control = RunControl(
        save_every=args.save_every,
        save_every_minutes=args.save_every_minutes,
        steps=args.steps,
        stall_minutes=args.stall_dump_minutes,  # a step longer than this: every rank's stacks
        out=args.out,
    )
    writer = CheckpointWriter(models=checkpointed, shared=colo.host_buffers)  # background saves
    clock.mark("pinned host memory")
    print0(clock.line())

    def save_turn(name):  # before each model's part of a save ("": the actor, then "critic")
        colo.turn(critic_optimizer if name else optimizer, timer)
        colo.wait_optimizers(timer)

    saves = StepCheckpoints(
        writer,
        args,
        spec=spec,
        dtype=dtype,
        sampler=sampler,
        carry=carry,
        hf_dir=hf_dir,
        extra_models=critic_state,
        before_model=save_turn,  # one optimizer state on the GPU at a time, as in the update
    )

    progress = progress_bar(range(start_step, args.steps), "ppo", enabled=info.master_process)
    for step in progress:
        times, t0, eval_metrics = {}, time.time(), {}  # eval_metrics: validation, reward model scores
        timer = Timer(times)  # seconds per phase (*_s), for the metrics

        # ---- 1. weight sync -> 2. rollout -> 3. reward: each replica samples G responses for its share of the
        # prompts, then every rank has all of them, and their rewards (common/run/sampling.py)
        if engine is None:  # --load-rollouts: a saved run's samples and rewards
            samples, rewards = rollouts.load(step)
        else:  # weights synced first (all ranks: the export runs collectives); after the block the engine sleeps
            with colo.rollout(timer, memory):  # optimizer states, critic and actor out, weights in, then the KV cache
                samples, rewards, group_prompts = rollouts.sample(step, timer, eval_metrics)
                if evaluator.due(step):  # held-out validation with the weights this step samples with
                    with timer("eval"):
                        eval_metrics.update(evaluator.run(engine, step))
            rewards = rollouts.add_reward_model(samples, rewards, group_prompts, timer, eval_metrics)
        rollouts.check(step, samples, rewards, eval_metrics)  # finite, --env's metrics (the critic values the
        # model's tokens only), --save-rollouts

        # (N, T) tensors; --routing-replay rollout: + the engine's routes (N, T, MoE layers, top-k)
        batch = B.pack_sequences(samples, pad_id, length_multiple=multiple, routes=args.routing_replay == "rollout")
        batch["row"] = torch.arange(len(samples))
        num_rows, seq_len = batch["tokens"].shape
        mask = batch["mask"]  # (N, T): 1 where the target is a response token

        # this rank's micro-batches: .of(order, m) of mini-batch m, .forward_only() of all rows (common/run/step.py)
        micro = StepBatches(batch, args, info, groups, mini_batch=mini_batch, rollout_batch=rollout_batch)

        # ---- 4. old (behaviour) and reference logprobs, and the critic's values V(s_t)
        memory.start()  # vLLM is asleep and the policy back: the trainer's passes from here
        all_mine = micro.forward_only()
        batch["old_logprobs"] = torch.zeros(num_rows, seq_len)
        with timer("old_logprob"):
            routes = RR.route_store(num_rows, seq_len, spec, info.device) if args.routing_replay == "old" else None
            forward_pass(model, all_mine, logprobs_of, batch["old_logprobs"], routes)
            if routes is not None:  # R2: the reference, values and update passes route as this pass did
                batch["routes"] = RR.gathered_routes(routes)
                all_mine = micro.forward_only()
        check_finite("old logprobs", batch["old_logprobs"], batch["mask"], step)  # the same on every rank
        batch["ref_logprobs"] = torch.zeros(num_rows, seq_len)
        if use_reference:  # LoRA: the actor's own chunks with the adapters off, else the frozen copy
            with timer("ref"), adapters_disabled(model) if args.lora else colo.frozen_model(reference):
                forward_pass(model if args.lora else reference, all_mine, logprobs_of, batch["ref_logprobs"])
            check_finite("reference logprobs", batch["ref_logprobs"], batch["mask"], step)
        if teacher is not None:  # on-policy distillation: the teacher scores every sampled token (+ its top-K)
            with timer("teacher"), colo.frozen_model(teacher):
                teacher_pass(teacher, teacher_spec, all_mine, batch, args, tp_group, info.device)
            check_finite("teacher logprobs", batch["teacher_logprobs"], batch["mask"], step)
        batch["old_values"] = torch.zeros(num_rows, seq_len)  # V(s_t), s_t = the tokens up to position t
        with timer("values"):
            colo.reload_idle()  # the critic, back for its values pass and its update
            forward_pass(critic, all_mine, lambda mb, values: values.squeeze(-1), batch["old_values"])
        check_finite("critic values", batch["old_values"], batch["mask"], step)
        memory.end("logprob")
        # --rollout-correction's per-token weights of the policy term (common/rl/corrections.py), and their metrics
        batch["is_weights"], correction = correction_weights(
            args.rollout_correction,
            batch["old_logprobs"],
            batch["rollout_logprobs"],
            batch["rollout_mask"],
            mask,
            low=args.correction_low,
            high=args.correction_high,
        )

        # ---- 5. token rewards and GAE. The score sits on the last response token (the episode's
        # end); with --kl-mode reward every response token also gets -kl_coef * its KL(pi_old || ref).
        token_rewards = torch.zeros(num_rows, seq_len)
        last = seq_len - 1 - mask.flip(1).argmax(1)  # (N,) position of each row's last response token
        token_rewards[torch.arange(num_rows), last] = rewards * (mask.sum(1) > 0)
        if use_reference:
            kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], args.kl_estimator) * mask  # (N, T)
            if args.kl_mode == "reward":
                token_rewards -= args.kl_coef * kl
        advantages, batch["returns"] = gae(token_rewards, batch["old_values"], mask, gamma=args.gamma, lam=args.lam)
        batch["advantages"] = masked_whiten(advantages, mask)  # over the whole rollout batch: every rank holds all rows
        if teacher is not None:  # on-policy distillation (common/rl/distill.py), after GAE: each token its own return
            no_reward = args.rule_reward_weight == 0 and reward_model is None and not env_class
            if no_reward and not (use_reference and args.kl_mode == "reward"):  # pure distillation: no task
                batch["advantages"].zero_()  # term (whitened values of a critic fitting zero returns are noise)
            if not args.distill_topk:  # (--distill-topk: a loss term instead, in actor_loss_fn)
                batch["advantages"] += distill_advantages(
                    batch["teacher_logprobs"], batch["old_logprobs"], mask, args.distill_coef
                )

        # ---- 6. PPO epochs over mini-batches: the critic's optimizer steps, then the actor's (the two
        # are independent: the same steps as interleaved), each with only its own optimizer state on
        # the GPU when the optimizers are offloaded (common/train/colocation.py turn)
        def actor_loss_fn(mb, logits, norm, scale, first):  # first: this step's first mini-batch
            mb_mask = mb["mask"]
            norm_mb = dict(norm, seq_ids=mb.get("seq"), seq_counts=mb.get("seq_counts"))  # packing / CP
            logprobs, entropy = vocab_parallel_logprobs(
                logits, mb["targets"], spec.vocab_size, tp_group, args.temperature, compute_entropy=True
            )
            # seq-offpolicy-mask: DeepSeek-V3.2's mask against this pass's policy (+ its metrics)
            is_weights, masked = loss_weights(args.rollout_correction, mb, logprobs, args.correction_delta, cp_group)
            per_token, clipped = policy_loss(
                logprobs,
                mb["old_logprobs"],
                mb["advantages"],
                args.clip_low,
                args.clip_high,
                is_weights=is_weights,
                dual_clip=args.dual_clip,
                sequence_mask=mb_mask if args.gspo else None,
                seq_ids=mb.get("seq"),
                cp_group=cp_group,
            )
            loss = aggregate_loss(per_token, mb_mask, args.loss_agg, **norm_mb)
            if use_reference and args.kl_mode == "loss":
                kl_loss = kl_penalty(logprobs, mb["ref_logprobs"], args.kl_estimator)
                loss = loss + args.kl_coef * aggregate_loss(kl_loss, mb_mask, args.loss_agg, **norm_mb)
            if args.entropy_coef:
                loss = loss - args.entropy_coef * aggregate_loss(entropy, mb_mask, args.loss_agg, **norm_mb)
            if args.distill_topk:  # + coef x forward KL from the teacher's top-K to the student, per token
                topk_kl = teacher_topk_kl(mb, logits, logprobs, tp_group, args.temperature)
                loss = loss + args.distill_coef * aggregate_loss(topk_kl, mb_mask, args.loss_agg, **norm_mb)
            drift = mb["old_logprobs"] - logprobs.detach()  # (b, T) old - new; first: before any update of the step
            metrics = policy_metrics(loss, entropy, clipped, drift, mb_mask, norm["num_tokens"], first=first)
            metrics.update(masked)  # --rollout-correction's masked shares
            if args.distill_topk:
                metrics.update(distill_topk_kl=masked_sum(topk_kl.detach(), mb_mask), distill_topk_kl__n=mb_mask.sum())
            return loss * scale, metrics

        def critic_loss_fn(mb, values, norm, scale, first):  # values: (b, T, 1) from the value head
            mb_mask = mb["mask"]
            per_token, clipped = value_loss(
                values.squeeze(-1).float(), mb["old_values"], mb["returns"], mb_mask, clip=args.vf_clip
            )
            loss = aggregate_loss(per_token, mb_mask, "token_mean", num_tokens=norm["num_tokens"])
            n = mb_mask.sum()
            return loss * scale, {
                "value_loss": loss.detach(),
                "value_loss__n": n / norm["num_tokens"],
                "vf_clip_frac": masked_sum(clipped.float(), mb_mask),
                "vf_clip_frac__n": n,
            }

        def optimizer_steps(chunks, opt, sched, loss_fn, lrs_seen, norms_seen):
            """One model's optimizer steps: one per mini-batch of each PPO epoch."""
            for epoch in range(args.ppo_epochs):
                order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(args.seed + step * 31 + epoch))
                for m in range(rollout_batch // mini_batch):
                    rows = order[m * mini_batch : (m + 1) * mini_batch]
                    # global normalisers of this mini-batch (all DP ranks, all micro-batches)
                    norm = dict(num_tokens=mask[rows].sum().clamp(min=1), num_seqs=len(rows), max_len=norm_len)
                    mbs = micro.of(order, m)  # how many depends on the lengths with --micro-batch-tokens
                    scale = len(mbs) * info.dp_size  # undo megatron's 1/num_micro and DDP's DP averaging
                    lrs_seen.append(opt.param_groups[0]["lr"])
                    mb_metrics, grad_norm = schedule.train_step(
                        chunks,
                        opt,
                        sched,
                        mbs,
                        functools.partial(loss_fn, norm=norm, scale=scale, first=epoch == 0 and m == 0),
                        info.device,
                        step=step,
                        before_step=lambda: colo.wait_optimizers(timer),  # the state's copies have landed
                    )
                    train_metrics.extend(mb_metrics)
                    norms_seen.append(grad_norm)

        tick = time.time()
        train_actor = step >= args.critic_warmup_steps  # critic warmup: the actor is left as it is
        train_metrics, grad_norms, critic_grad_norms = [], [], []
        lrs, critic_lrs = [], []  # what each optimizer step used (the scheduler moves it after the step)
        colo.turn(critic_optimizer, timer)  # on a GPU its copies overlap the passes, up to its first step
        optimizer_steps(critic, critic_optimizer, critic_scheduler, critic_loss_fn, critic_lrs, critic_grad_norms)
        memory.end("critic")
        if train_actor:
            colo.turn(optimizer, timer)  # the critic's state to host memory, the actor's back
            optimizer_steps(model, optimizer, scheduler, actor_loss_fn, lrs, grad_norms)
        times["train_s"] = time.time() - tick
        memory.end("train")

        # ---- 7. log (every rank joins the metric reduction), then checkpoint
        metrics = schedule.reduce_metrics(train_metrics, info.device)
        if spec.moe:  # expert load (max/mean routed tokens per layer) of the actor's and the critic's updates
            metrics.update(moe.step_metrics(model, spec, info.device, aux=False))
        if critic_spec.moe:
            metrics.update(moe.step_metrics(critic, critic_spec, info.device, prefix="critic_", aux=False))
        metrics.update(
            reward_mean=rewards.mean().item(),
            reward_std=rewards.std().item(),
            critic_grad_norm=sum(critic_grad_norms) / len(critic_grad_norms),
            critic_lr=sum(critic_lrs) / len(critic_lrs),  # this step's (the optimizers hold the next step's)
            lr=sum(lrs) / len(lrs) if lrs else optimizer.param_groups[0]["lr"],  # (critic warmup: the actor's next)
            value_mean=masked_mean(batch["old_values"], mask).item(),
            return_mean=masked_mean(batch["returns"], mask).item(),
            response_len_mean=batch["response_len"].mean().item(),
            truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples),
        )
        explained = explained_variance(batch["old_values"], batch["returns"], mask)
        if math.isfinite(explained):  # nan when all returns are equal (e.g. no reward yet): left out
            metrics["explained_variance"] = explained
        if args.rollout_logprobs != "none":  # |engine - trainer| logprob on the samples that brought them
            metrics["logprob_mismatch"] = masked_mean(
                (batch["rollout_logprobs"] - batch["old_logprobs"]).abs(), batch["rollout_mask"]
            ).item()
            metrics.update(correction)  # every rank holds every row: the same numbers everywhere
        if use_reference:
            metrics["kl"] = masked_mean(kl, mask).item()  # KL(pi_old || ref) of this rollout
        if teacher is not None:  # mean student - teacher logprob: the sampled reverse KL per token
            metrics["distill_reverse_kl"] = masked_mean(batch["old_logprobs"] - batch["teacher_logprobs"], mask).item()
        if train_actor:
            metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if writer.poll():  # a background save finished on every rank: published, `latest` moved
            metrics["save_total_sec"] = writer.last["total_s"]  # its whole time, mostly hidden
        save, stop = control.step_end(step, info.device)  # --save-every(-minutes), last step, a signal
        if save:  # in the background: the loop waits for checks, planning and copies to host memory (save_s)
            saves.save(step + 1, model, optimizer, scheduler, times, metrics)
        times["step_s"] = time.time() - t0
        metrics.update(
            times,
            **memory.metrics,
            **eval_metrics,
            **step_throughput(  # tokens/s, MFU; passes per token: a backward is 2
                spec,
                samples,
                times,
                forward_passes=2 + use_reference + 6 * args.ppo_epochs,
                other_models=[teacher_spec] if teacher is not None else [],  # its own size
                world_size=info.global_world_size,  # per GPU: the engines' own (--rollout-gpus) included
                device=info.device,
            ),
        )
        logger.log_samples(step, tokenizer, samples, rewards, every=args.log_samples_every, stride=group)  # rank 0
        logger.log(step, metrics)
        if info.master_process:
            progress.set_postfix(
                reward=f"{metrics['reward_mean']:.3f}", ev=f"{metrics.get('explained_variance', math.nan):.2f}"
            )
        if args.check_on_policy is not None and step == max(start_step, args.critic_warmup_steps):  # the first update
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
