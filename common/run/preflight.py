"""Checks of a training run's arguments and inputs, before anything heavy is built.

    args = parser.parse_args(argv)
    check_training_run(parser, args, min_group=2, critic_model=None)   # exits 2 on a mistake

A mistake a user can make on the command line ends the run here, in a second, with one line
that says what is wrong and how to fix it (rank 0 prints it; exit code 2, as argparse),
instead of a per-rank traceback after the models and the engine were built. Every rank runs
the same checks on the same files, so every rank exits alike: no collective, no hang.

The output directory's rules (the run lock, what counts as a run, --resume / --start-over):
common/run/out_dir.py, applied here.
"""

import json
import math
import os

from common.model.bridge import parse_hf_config
from common.run.dist import launcher_rank, launcher_world_size
from common.run.layout_checks import check_layout
from common.run.model_checks import (
    check_mcore_ckpt,
    check_model_dir,
    check_reward_model,
    check_teacher,
    model_differences,
)
from common.run.out_dir import check_out, has_run, move_aside, requeued_start_over
from common.train.guard import UsageError


def check_training_run(parser, args, *, min_group=1, critic_model=None):
    """Validate train_grpo.py / train_ppo.py arguments and inputs; parser.error() (one line on
    rank 0, exit 2) on the first problem. Rank 0 locks --out for the run; with args.start_over
    it moves a non-empty --out aside (after every check passed)."""
    dry_run = getattr(args, "dry_run", False)  # reads config.json alone; no data read, nothing written
    try:
        requeued_start_over(args)
        _check_numbers(args, min_group)
        if not dry_run:
            _check_services(args)
        critic_model = _resolve_hub_names(args, critic_model)
        spec, critic = _check_model(args, critic_model)
        teacher = _check_teacher(args, spec)
        check_layout(args, spec, critic, teacher)  # common/run/layout_checks.py
        if not dry_run:
            _check_inputs(args)
            check_out(args, critic_model)
            if args.resume:
                _check_resumed_model(args, os.path.join(args.out, "checkpoints"), spec)
    except UsageError as e:
        parser.error(str(e))
    if args.start_over and not dry_run and has_run(args.out) and launcher_rank() == 0:
        try:
            aside = move_aside(args.out)
        except UsageError as e:
            parser.error(str(e))
        print(f"--start-over: the previous contents of {args.out} are now in {aside}", flush=True)
    return spec


def _check_numbers(args, min_group):
    a = vars(args)
    positive = [
        "tp",
        "pp",
        "cp",
        "ep",
        "etp",
        "rollout_tp",
        "prompts_per_step",
        "samples_per_prompt",
        "max_new_tokens",
        "steps",
        "ppo_epochs",
        "keep_checkpoints",
        "sync_bucket_mb",
        "max_prompt_len",
        "recompute_layers",
    ]
    for name in positive:
        if a[name] < 1:
            raise UsageError(f"--{_flag(name)} must be >= 1, not {a[name]}")
    optional = (
        "vpp",
        "first_stage_layers",
        "last_stage_layers",
        "mini_batch_size",
        "micro_batch_size",
        "logprob_micro_batch_size",
    )
    for name in optional:
        if a[name] is not None and a[name] < 1:
            raise UsageError(f"--{_flag(name)} must be >= 1, not {a[name]}")
    non_negative = [
        "save_every",
        "save_every_minutes",
        "log_samples_every",
        "eval_every",
        "eval_temperature",
        "max_sampling_rounds",
        "overlong_buffer",
        "overlong_penalty_factor",
        "micro_batch_tokens",
        "logprob_micro_batch_tokens",
        "lr",
        "min_lr",
        "weight_decay",
        "kl_coef",
        "entropy_coef",
        "tis_cap",
        "dual_clip",
        "lr_warmup_steps",
        "clip_low",
        "clip_high",
        "clip_grad",
        "critic_lr",
        "critic_warmup_steps",
        "vf_clip",
    ]
    for name in non_negative:
        if name in a and a[name] is not None and not (a[name] >= 0 and math.isfinite(a[name])):
            raise UsageError(f"--{_flag(name)} must be a finite number >= 0, not {a[name]}")
    if args.dual_clip and not args.dual_clip > 1:
        raise UsageError(f"--dual-clip must be > 1 (verl uses 3) or 0 (off), not {args.dual_clip}")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UsageError(
            f"--temperature must be > 0, not {args.temperature}: the policy gradient needs a "
            "sampling distribution (logprobs are of logits / temperature; greedy decoding has none)"
        )
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], not {args.top_p}")
    for name in ("world_size", "gpus_per_node", "gpu_memory_gb", "host_memory_gb"):  # the memory plan's machine
        if a.get(name) is not None and not (a[name] > 0 and math.isfinite(a[name])):
            raise UsageError(f"--{_flag(name)} must be > 0, not {a[name]}")
    if a.get("world_size") and not a.get("dry_run") and a["world_size"] != launcher_world_size():
        raise UsageError(
            f"--world-size {a['world_size']} is for --dry-run; this run has {launcher_world_size()} ranks "
            "(torchrun's --nproc_per_node x --nnodes): drop the flag"
        )
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], not {args.gpu_memory_utilization}")
    if args.samples_per_prompt < min_group:
        raise UsageError(
            f"--samples-per-prompt must be >= {min_group}, not {args.samples_per_prompt}: group-"
            "normalised advantages of a group of one are all zero (nothing would be learned)"
        )
    if a.get("overlong_buffer", 0) >= args.max_new_tokens:
        raise UsageError(
            f"--overlong-buffer {args.overlong_buffer} must be below --max-new-tokens {args.max_new_tokens} "
            "(the penalty grows over the last N tokens before the limit; DAPO: 4096 of 20480)"
        )
    if a.get("reward_model") and (args.load_rollouts or a.get("dynamic_sampling")):
        raise UsageError(
            "--reward-model scores fresh samples once the engine sleeps: not with --load-rollouts (their saved "
            "rewards already hold the scores) nor --dynamic-sampling (which decides while the engine is awake)"
        )
    if a.get("dynamic_sampling") and args.load_rollouts:
        raise UsageError(
            "--dynamic-sampling samples more prompts on the rollout engine, which --load-rollouts does without"
        )
    if a.get("answer_key") == "none" and args.rule_reward_weight != 0:
        raise UsageError(
            "--answer-key none: the prompts have no reference answers for the rule-based reward; pass "
            "--rule-reward-weight 0 (with --teacher or --reward-model as the signal)"
        )
    if args.eval_samples < 1:
        raise UsageError(f"--eval-samples must be >= 1, not {args.eval_samples}")
    if args.eval_temperature == 0 and args.eval_samples > 1:
        raise UsageError(
            f"--eval-temperature 0 is greedy decoding: every sample is the same; pass --eval-samples 1 "
            f"(not {args.eval_samples}) or a temperature > 0 for pass@k / maj@k"
        )
    if args.eval_data is not None and args.load_rollouts:
        raise UsageError("--eval-data needs the rollout engine, which --load-rollouts does without")
    if args.resume and args.start_over:
        raise UsageError("--resume continues the run in --out, --start-over begins a new one there: pass one")


def _check_services(args):
    """What the run will use besides the model: the rollout engine it was asked for, --gdn-kernel fla's kernels,
    wandb."""
    from common.model.gdn_kernels import resolve_gdn_kernel
    from common.rollout.engines import vllm_available
    from common.run.log import default_wandb_mode, wandb_credentials

    try:
        resolve_gdn_kernel(args.gdn_kernel)  # refuses fla where it cannot train (no GPU, no package, fla's refusal)
    except ValueError as e:
        raise UsageError(str(e)) from None

    if args.rollout == "vllm" and not args.load_rollouts and not vllm_available():
        raise UsageError(
            "--rollout vllm: vLLM is not installed in this environment (GPU installs: pip install -r "
            "requirements-gpu.txt); or pass --rollout cpu (the CPU engine: tiny models only)"
        )
    mode = args.wandb or default_wandb_mode()
    if mode == "disabled":
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise UsageError(f"--wandb {mode}: wandb is not installed (pip install wandb), or pass --wandb disabled")
    if mode == "online" and not wandb_credentials():
        raise UsageError(
            "--wandb online: no wandb API key found (WANDB_API_KEY, a ~/.netrc entry, wandb's settings): run "
            "`wandb login` or set WANDB_API_KEY; or pass --wandb offline (upload later: wandb sync) or --wandb disabled"
        )


def _resolve_hub_names(args, critic_model):
    """--model / --critic-model / --data given as hub ids (ORG/NAME) -> their local snapshot
    directories in the HuggingFace cache, downloaded on first use (common/run/hub.py); args now
    hold the local paths (config.json records them). Returns the critic model's path."""
    from common.run import hub

    given = (args.model, args.data, critic_model)
    # a dry run needs the models' config.json only, and no data
    files = hub.CONFIG_FILES if getattr(args, "dry_run", False) else None
    args.model = hub.resolve(args.model, "--model", files=files)
    if files is None:
        args.data = hub.resolve(args.data, "--data", repo_type="dataset")
        args.eval_data = hub.resolve(args.eval_data, "--eval-data", repo_type="dataset")
    if getattr(args, "reward_model", None):
        args.reward_model = hub.resolve(args.reward_model, "--reward-model", files=files)
        check_reward_model(args.reward_model, need_tokenizer=files is None)
    if critic_model is not None:
        critic_model = args.critic_model = hub.resolve(critic_model, "--critic-model", files=files)
    if getattr(args, "teacher", None):
        args.teacher = hub.resolve(args.teacher, "--teacher", files=files)
    if launcher_rank() == 0:
        for flag, name, path in zip(
            ("--model", "--data", "--critic-model"), given, (args.model, args.data, critic_model)
        ):
            if name != path:
                print(f"{flag} {name}: {path}", flush=True)
    return critic_model


def _check_model(args, critic_model):
    """The HFModelSpecs of --model (the embedded model's without it) and of --critic-model
    (None without it), after checking the dirs."""
    if args.model is None:
        from common.run.embedded import DEFAULT_CONFIG, EMBEDDED_MODELS, hf_config

        spec = parse_hf_config(hf_config({**DEFAULT_CONFIG, **EMBEDDED_MODELS[args.embedded_model]}))
    else:
        if args.embedded_model != "dense":
            raise UsageError("--embedded-model chooses the model used without --model: give one or the other")
        full = not getattr(args, "dry_run", False)  # a dry run reads config.json alone
        spec = check_model_dir(
            args.model, "--model", need_weights=full and args.mcore_ckpt is None, need_tokenizer=full
        )
    critic = None
    if critic_model is not None:
        critic = check_model_dir(
            critic_model, "--critic-model", need_weights=not getattr(args, "dry_run", False), need_tokenizer=False
        )
        if critic.vocab_size < spec.vocab_size:  # the critic reads the policy's token ids
            raise UsageError(
                f"--critic-model {critic_model}: vocabulary {critic.vocab_size} < the policy's "
                f"{spec.vocab_size}; the critic must read every token id of the policy"
            )
    if args.mcore_ckpt is not None and not getattr(args, "dry_run", False):
        check_mcore_ckpt(args.mcore_ckpt, spec)
    return spec, critic


def _check_teacher(args, spec):
    """--teacher's HFModelSpec (None without one) once its directory and vocabulary passed; --distill-coef."""
    topk = getattr(args, "distill_topk", 0)
    if topk and not getattr(args, "teacher", None):
        raise UsageError(f"--distill-topk {topk} distils a teacher's top-K tokens: give --teacher, or drop it")
    if not getattr(args, "teacher", None):
        return None
    if not 0 <= topk < min(spec.vocab_size, 1 << 24):
        raise UsageError(f"--distill-topk {topk}: give 0 (the sampled token) or K in 1..{spec.vocab_size - 1}")
    if not args.distill_coef > 0:
        raise UsageError(f"--distill-coef must be > 0, not {args.distill_coef} (drop --teacher to train without one)")
    if getattr(args, "eval_only", False):
        raise UsageError("--eval-only validates the policy alone: drop --teacher")
    return check_teacher(args.teacher, args.model, spec, dry_run=getattr(args, "dry_run", False))


def _check_inputs(args):
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{flag} {path}: no such file or directory")
    # flags that would be silently ignored: a file has no splits or configs, the synthetic task no chat
    for flag, value, datasets, what in (
        ("--data-split", args.data_split, [("--data", args.data)], "splits"),
        ("--eval-split", args.eval_split, [("--eval-data", args.eval_data)], "splits"),
        ("--data-config", args.data_config, [("--data", args.data), ("--eval-data", args.eval_data)], "configs"),
    ):
        given = [(data_flag, path) for data_flag, path in datasets if path is not None]
        if value is None or any(not os.path.isfile(path) for _, path in given):
            continue
        if not given:
            raise UsageError(f"{flag} {value} chooses part of a {datasets[0][0]} dataset, and there is none: drop it")
        raise UsageError(
            f"{flag} {value}: {' and '.join(f'{f} {p}' for f, p in given)} "
            f"{'is a file, which has' if len(given) == 1 else 'are files, which have'} no {what}: "
            f"drop {flag} (it applies to a dataset directory or a hub dataset)"
        )
    if args.system_prompt is not None and args.raw_prompts:
        raise UsageError(
            "--system-prompt goes into the chat template, which --raw-prompts skips: pass one or the other"
        )
    if args.system_prompt is not None and args.data is None and args.eval_data is None:
        raise UsageError(
            "--system-prompt applies to --data's prompts; the synthetic task (no --data) is not a chat: drop it"
        )
    chat = not args.raw_prompts and (args.data is not None or args.eval_data is not None)
    if args.chat_template_kwargs and not (chat or args.env):
        raise UsageError(
            "--chat-template-kwargs applies to chat-formatted prompts (--data without --raw-prompts, or --env); "
            "these prompts go in as plain text: drop it"
        )
    if args.load_rollouts is not None:
        last = os.path.join(args.load_rollouts, f"step_{args.steps - 1:06d}.pt")
        if not os.path.isfile(last):
            have = (
                len([n for n in os.listdir(args.load_rollouts) if n.startswith("step_")])
                if os.path.isdir(args.load_rollouts)
                else 0
            )
            raise UsageError(
                f"--load-rollouts {args.load_rollouts} has {have} saved steps, not the {args.steps} "
                f"--steps asks for (no {os.path.basename(last)})"
            )
        if getattr(args, "routing_replay", "none") == "rollout":  # the engine's routes are part of each sample
            import torch

            if any(getattr(s, "routes", None) is None for s in torch.load(last, weights_only=False)["samples"]):
                raise UsageError(
                    f"--routing-replay rollout: the rollouts in {args.load_rollouts} carry no MoE routes (saved by a "
                    "run without it); replay the old-logprob pass's routes (--routing-replay old) or none"
                )


def _check_resumed_model(args, ckpt_root, spec):
    """--resume: the newest checkpoint was written for this model (its hf/config.json, which the
    scripts save with every checkpoint), else say which model it was written for."""
    from common.train.checkpoint_dirs import candidates

    names = candidates(ckpt_root)
    config = os.path.join(ckpt_root, names[0], "hf", "config.json") if names else None
    if config is None or not os.path.isfile(config):
        return  # (none readable: the loader reports the checkpoints it cannot use)
    _check_resumed_lora(args, os.path.join(ckpt_root, names[0]))
    differ = model_differences(config, spec)
    if not differ:
        return
    try:  # the run record of the run that wrote it: its --model
        with open(os.path.join(os.path.dirname(ckpt_root), "config.json")) as f:
            model = _model_name(json.load(f)["args"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        model = "another model"
    this = _model_name(vars(args))
    raise UsageError(
        f"--resume: the checkpoint {os.path.join(ckpt_root, names[0])} was written for {model}, not {this} "
        f"(their config.json differs: {'; '.join(differ)}; checkpoint vs now). Resume with the model it was "
        "written for, or train this one from the start with --start-over or another --out"
    )


def _check_resumed_lora(args, step_dir):
    """--resume: the checkpoint holds adapters of the same --lora-rank/--lora-alpha/--lora-targets, or a
    whole model and this run has no --lora-rank (rl_meta.json's "lora" against args.lora)."""
    try:
        with open(os.path.join(step_dir, "rl_meta.json")) as f:
            saved = json.load(f).get("lora")
    except (OSError, ValueError):
        return
    now = getattr(args, "lora", None)
    saved = saved and (saved["rank"], saved["alpha"], list(saved["targets"]))
    now = now and (now["rank"], now["alpha"], list(now["targets"]))
    if saved != now:
        said = lambda lora: (  # noqa: E731
            f"--lora-rank {lora[0]} --lora-alpha {lora[1]:g} --lora-targets {','.join(lora[2])}" if lora else "no LoRA"
        )
        raise UsageError(
            f"--resume: the checkpoint {step_dir} was written with {said(saved)}, this run has {said(now)}: resume "
            "with the same LoRA flags, or start afresh with --start-over or another --out"
        )


def _model_name(args):
    """The model a run's arguments (vars(args), or a run record's "args") name, for messages."""
    if args.get("model"):
        return f"--model {args['model']}"
    embedded = args.get("embedded_model") or "dense"
    return "the embedded tiny model" + (f" (--embedded-model {embedded})" if embedded != "dense" else "")


def _flag(name):
    return name.replace("_", "-")
