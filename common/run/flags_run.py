"""The run's command-line flags that train_grpo.py and train_ppo.py share, in groups (what --help shows
under each title): the data, the run (steps, seeds, outputs, checkpoints, logging), the memory plan,
benchmarks; and what is derived from them: the default --out, the embedded model's defaults. The
model, parallel, batch and optimisation groups are in common/run/flags.py."""

import argparse
import os

from common.run.flags import fitting_size


def data_flags(p):
    """Prompts, their format, and held-out validation."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default=None,
        help=(
            "prompts with prompt+answer fields: .jsonl / .parquet, a datasets dir, or a hub dataset ORG/NAME (e.g. "
            "openai/gsm8k --data-config main); default: the synthetic arithmetic task"
        ),
    )
    g.add_argument(
        "--data-config",
        default=None,
        help="config of a --data dataset repository that has several (gsm8k: main or socratic)",
    )
    g.add_argument(
        "--data-split",
        default=None,
        help="split of a --data dataset directory or hub dataset to train on (default: train; a file has none)",
    )
    g.add_argument(
        "--eval-data",
        default=None,
        help=(
            "held-out prompts for validation, as --data (its --data-config); default: the embedded task's prompts "
            "without --data, else none"
        ),
    )
    g.add_argument(
        "--eval-split",
        default=None,
        help="split of an --eval-data dataset directory or hub dataset (default: test; a file has none)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help=(
            "validate at step 0 (before any update), every N steps and at the last step, on the rollout engine (0: off)"
        ),
    )
    g.add_argument(
        "--eval-samples", type=int, default=1, help="responses per held-out prompt: k of eval_pass@k and eval_maj@k"
    )
    g.add_argument(
        "--eval-temperature",
        type=float,
        default=0.0,
        help="sampling temperature of validation (0: greedy, with --eval-samples 1)",
    )
    g.add_argument("--prompt-key", default=None, help="prompt field of --data (auto-detected when unset)")
    g.add_argument(
        "--answer-key",
        default=None,
        help=(
            "answer field of --data (auto-detected when unset); none: prompts without reference answers, for a "
            "reward that needs none (--teacher with --rule-reward-weight 0, or --reward-model alone)"
        ),
    )
    g.add_argument("--system-prompt", default=None, help="system message put before every prompt")
    g.add_argument(
        "--raw-prompts",
        action="store_true",
        help="tokenize prompts as they are, without the chat template (always so for the synthetic task)",
    )
    g.add_argument("--max-prompt-len", type=int, default=1024, help="prompts longer than this (in tokens) are dropped")
    return g


def run_flags(p, out_prefix):
    """Steps, seeds, output, checkpoints, logging. out_prefix: the default --out without the model's
    name (resolve_out)."""
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=200, help="training steps (rollout batches)")
    g.add_argument("--seed", type=int, default=1234, help="seed of everything")
    g.add_argument(
        "--out",
        default=None,
        help=f"output dir: metrics.jsonl, curves.png, checkpoints/ (default: {out_prefix}-<model name>, e.g. "
        f"{out_prefix}-Qwen2-7B for --model /models/Qwen2-7B, {out_prefix}-embedded without --model)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also checkpoint every N steps (0: by time only); the last step and a stop signal always save",
    )
    g.add_argument(
        "--save-every-minutes",
        type=float,
        default=30.0,
        help="checkpoint when this many minutes passed since the last save (0: off)",
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many step checkpoints to keep")
    g.add_argument(
        "--stall-dump-minutes",
        type=float,
        default=20.0,
        help="a step running longer than this writes every rank's Python stacks to <out>/stacks/ and the run goes on "
        "(a hang's diagnosis: a collective one rank never joined, a stuck engine); 0: off",
    )
    g.add_argument(
        "--save-any-layout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "write the distributed optimizer's state per parameter, so that the checkpoint resumes at any TP/PP/DP "
            "layout (at data parallel > 1 every save gathers 12 bytes per parameter of the rank's TP x PP slice "
            "in host memory and blocks the loop meanwhile); --no-save-any-layout writes each DP rank's shard as it "
            "is, resumable at the same TP/PP only (any DP); default: on at data parallel 1 (nothing to gather), "
            "off above"
        ),
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        choices=["yes", "auto"],
        default=None,
        help=(
            "continue the run in --out from its latest checkpoint (refused when there is none); --resume auto: "
            "continue if there is a checkpoint, else start over (launch/slurm.sh's requeue)"
        ),
    )
    g.add_argument(
        "--start-over",
        action="store_true",
        help="start a new run in a non-empty --out: its old contents are moved to <out>.old-<time>",
    )
    g.add_argument(
        "--log-samples-every",
        type=int,
        default=10,
        help=(
            "every N steps print 3 decoded (prompt, response, reward) samples, append them to --out/samples.jsonl "
            "and wandb (0: off)"
        ),
    )
    g.add_argument(
        "--wandb",
        choices=["online", "offline", "disabled"],
        default=None,
        help="default: online if a wandb key is set, else disabled",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's and megatron-core's INFO logging, on every rank (default: their warnings on rank 0 only)",
    )
    g.add_argument("--wandb-project", default="mcore-rl", help="wandb project")
    g.add_argument("--run-name", default=None, help="wandb run name")
    g.add_argument("--save-rollouts", default=None, help="write each step's samples and rewards to this dir")
    g.add_argument(
        "--load-rollouts",
        default=None,
        help="train on samples saved by --save-rollouts instead of generating (no engine)",
    )
    return g


def bench_flags(p):
    """Benchmark modes of the script (bench/e2e.py runs them)."""
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--bench-response-lengths",
        default=None,
        metavar="SPEC",
        help=(
            "throughput benchmark (bench/e2e.py): every sample gets exactly the number of tokens drawn for it from "
            "SPEC, EOS ignored (the same draws on every rank, by --seed and step): fixed:L, uniform:min=A,max=B or "
            "lognormal:mean=M,sigma=S,max=B[,min=A] (M the mean before clipping to [A, B]; "
            "common/rollout/lengths.py); B must be <= --max-new-tokens. No checkpoint is written at the last step. "
            "With --off-policy-steps each group draws its lengths when it starts"
        ),
    )
    return g


def eval_only_flag(g):
    """--eval-only (train_grpo.py) into the script's run group g; check_eval_only says what it rules out,
    eval_only_resume what it validates with --resume."""
    g.add_argument(
        "--eval-only",
        action="store_true",
        help=(
            "no training: validate the weights of --model, --mcore-ckpt (a converted or a training checkpoint step) "
            "or, with --resume, --out's newest checkpoint, once, as the run's validation does (--eval-*); writes "
            "<out>/eval_only/step_N.jsonl and appends the metrics to <out>/eval_only/metrics.jsonl"
        ),
    )


def check_eval_only(p, args):
    """--eval-only samples with the engine and writes into <out>/eval_only/ and nothing else: what that rules
    out, before the run's checks (they may move --out aside). Exits 2 on a mistake."""
    if not args.eval_only:
        return
    if args.lora:  # (a LoRA checkpoint holds adapters, the engine needs whole weights)
        p.error(
            "--eval-only with --lora-rank: merge the LoRA checkpoint first (python merge_to_hf.py --ckpt STEP "
            "--out DIR), then --eval-only --model DIR"
        )
    if args.start_over or args.resume == "auto" or args.load_rollouts:
        p.error(
            "--eval-only samples with the engine and writes into <out>/eval_only/ only: drop --start-over, "
            "--resume auto and --load-rollouts"
        )
    if args.data and not args.eval_data:
        p.error("--eval-only validates held-out prompts: pass --eval-data (with --data there are none by default)")


def eval_only_resume(p, args):
    """--eval-only --resume: --out's newest checkpoint as args.mcore_ckpt, after the run's checks (they made sure
    there is one). Exits 2 when none is complete."""
    if not (args.eval_only and args.resume):
        return
    from common.train.checkpoint_dirs import latest_complete

    args.mcore_ckpt = latest_complete(os.path.join(args.out, "checkpoints"))
    if args.mcore_ckpt is None:
        p.error(f"--eval-only --resume: no complete checkpoint in {args.out}/checkpoints")


def plan_flags(p):
    """The memory plan (common/run/memory_check.py): --dry-run, and the machine a plan is for."""
    g = p.add_argument_group("memory plan")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help=(
            "print the memory plan (per rank and phase: GPU and pinned host memory; per node) and exit: builds "
            "nothing, needs only the model's config.json, runs on any machine (exit 2 where a phase does not fit)"
        ),
    )
    g.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="memory of each GPU to plan for, in GB (10^9 bytes; default: the visible GPU's; without one: a CPU "
        "run). On a larger GPU the run keeps to it: an 80 GB plan tried on a 141 GB card, or a shared GPU",
    )
    g.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node, for the node's host memory (default: torchrun's --nproc_per_node, else 1)",
    )
    g.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="host memory available on each node, in GB (default: what this machine has available now)",
    )
    g.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --dry-run: the number of ranks to plan for (default: torchrun's WORLD_SIZE, else 1)",
    )
    return g


def resolve_out(args, out_prefix):
    """--out when not given (said on rank 0): one directory per model, so that a run of another
    model never lands in a directory an earlier run holds: <out_prefix>-Qwen2-7B for --model
    /models/Qwen2-7B or Qwen/Qwen2-7B (the name as given, before a hub id is resolved),
    <out_prefix>-embedded (-moe, -deepseek) without --model. Call it before the hub ids are
    resolved (common/run/preflight.py)."""
    from common.run.dist import launcher_rank

    if args.out is not None:
        return
    args.out = default_out(out_prefix, args.model, args.embedded_model)
    if launcher_rank() == 0:
        print(f"--out {args.out} (the default for this model)", flush=True)


def default_out(out_prefix, model, embedded_model="dense"):
    """The --out a run of this --model gets when none is given (resolve_out; launch/torchrun.py's
    last words look for its checkpoints there)."""
    if model is None:
        name = "embedded" + ("" if embedded_model == "dense" else f"-{embedded_model}")
    else:
        name = os.path.basename(os.path.abspath(model))  # (a hub id's NAME; `--model .`: the directory's)
    return f"{out_prefix}-{name}"


def embedded_defaults(defaults, known):
    """A script's defaults of the embedded model, with its batch sizes taken as caps and fitted
    to the run (known: the arguments as parsed with the usual defaults): --mini-batch-size to
    the largest that divides the rollout batch, --micro-batch-size to the largest that divides
    each data-parallel rank's share of a mini-batch. So `python train_grpo.py --prompts-per-step
    2 --samples-per-prompt 2` runs instead of being refused for a mini-batch of 64. A size
    given on the command line is kept as given (and checked)."""
    from common.run.dist import launcher_rank, launcher_world_size

    fitted, notes = dict(defaults), []
    rollout_batch = known.prompts_per_step * known.samples_per_prompt
    if "mini_batch_size" in defaults and known.mini_batch_size is None and rollout_batch > 0:
        fitted["mini_batch_size"] = fitting_size(rollout_batch, defaults["mini_batch_size"])
        if fitted["mini_batch_size"] != defaults["mini_batch_size"]:
            notes.append(
                f"--mini-batch-size {fitted['mini_batch_size']} (the embedded default {defaults['mini_batch_size']} "
                f"does not divide the rollout batch of {rollout_batch} samples)"
            )
    mini_batch = known.mini_batch_size or fitted.get("mini_batch_size") or rollout_batch
    dp = launcher_world_size() // max(1, known.tp * known.pp * known.cp)
    if "micro_batch_size" in defaults and known.micro_batch_size is None and 0 < dp <= mini_batch:
        fitted["micro_batch_size"] = fitting_size(mini_batch // dp, defaults["micro_batch_size"])
        if fitted["micro_batch_size"] != defaults["micro_batch_size"] and not known.micro_batch_tokens:
            notes.append(
                f"--micro-batch-size {fitted['micro_batch_size']} (the embedded default "
                f"{defaults['micro_batch_size']} does not divide the {mini_batch // dp} samples each data-parallel "
                "rank gets of a mini-batch)"
            )
    if notes and launcher_rank() == 0:
        print("; ".join(notes), flush=True)
    return fitted
