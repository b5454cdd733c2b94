"""End-to-end GRPO throughput: whole train_grpo.py steps with response lengths drawn from a distribution.

    python tests/gpu/make_random_model.py /models/rand-7b --shape 7b --full-vocab
    python bench/e2e.py --model /models/rand-7b --nproc 4 -- --tp 2 --rollout-tp 2 \\
        --prompts-per-step 16 --samples-per-prompt 32 --mini-batch-size 128            # 4 GPUs
    python bench/e2e.py --response-lengths fixed:16 --prompt-len 8 --warmup 1 --steps 2 -- \\
        --prompts-per-step 4 --samples-per-prompt 4 --mini-batch-size 16              # CPU smoke run

Runs train_grpo.py's own loop (weight sync, rollout, reward, old/reference logprob passes, PPO
update, with offload/reload around the engine) for --warmup + --steps steps, through torchrun
with --nproc > 1, else plain python, on --model (random weights: tests/gpu/make_random_model.py;
default: the embedded tiny model). Flags after `--` go to train_grpo.py as they are (layout,
batch, micro-batches, ...). What this driver sets:
  --bench-response-lengths SPEC  every sample gets exactly its drawn number of tokens, EOS ignored
                                 (common/rollout/lengths.py; the same draws on every rank and run);
                                 --max-new-tokens = SPEC's max unless given after `--`
  prompts                        random letters, --prompt-len characters each (one token each with
                                 the random models' byte-level tokenizer), as --data --raw-prompts
  no validation, sample printing, wandb or checkpoints; --out moved aside if it holds a run
The reward is the math reward of the random text: irrelevant to the throughput.

Reported over the timed steps (the warm-up steps pay for compilation, CUDA graphs, allocator):
  tokens_per_s_per_gpu   prompt + response tokens of all samples / step seconds / world size,
                         the steps summed (NeMo-RL's "Tokens / sec / GPU"); also per step
  phases                 every *_s metric of the scripts (sync, wake, offload, rollout, reward,
                         old_logprob, ref, reload, train, ...; other_s: the rest of step_s): mean
                         seconds, share of the step, tokens / phase seconds / world size
  steady_state           --rollout-gpus: the engines' rate over their busy seconds, a step's engine and trainer
                         seconds, which bounds it, and the tokens/s/GPU of that bound (timed steps that train
                         samples banked during the warm-up can run faster than the engines allow: run more steps)
  within_s               mean seconds of the *_sec metrics, which are not phases of the step: engine_busy_sec
                         (--rollout-gpus: the engines' own), sync_wait_sec (the optimizer step's wait for a
                         weight sync sent behind, within train_s)
  lengths                the response lengths drawn (count, mean, std, min, p50, p90, p99, max);
                         lengths_exact: each step's response tokens equal the sum of its draws (None with
                         --off-policy-steps after `--`: groups draw when they start, a step trains older ones)
  device, world size, layout, the command
Output: a table, one `BENCH_JSON {...}` line and --out/e2e.json. Step seconds are rank 0's (the
step ends with a collective: every rank is within a metric reduction of it).

What a flag costs, end to end: `--ab FLAGS` runs --pairs pairs of whole runs, A as given and B with FLAGS added
after `--` (each its own process: flags read at start-up, such as --true-on-policy's batch-invariant engine, can
be compared), the order alternating (A B, B A, ...; bench/harness.py run_pairs). Reported: B / A of the mean step
seconds, of each phase's mean seconds and of tokens/s/GPU (and of the steady-state estimates where both sides have
one), as the median (min, max) of the per-pair ratios; each
run's own report is kept (--out/a0, b0, a1, ...). Output: a table, `BENCH_JSON {...}` and --out/e2e_ab.json.
    python bench/e2e.py --model /models/rand-0.5b --response-lengths lognormal:mean=500,sigma=0.6,max=2000 \
        --ab --true-on-policy --pairs 3 -- --prompts-per-step 8 --samples-per-prompt 16
"""

import argparse
import json
import math
import os
import random
import shlex
import shutil
import string
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.rollout.lengths import draw_lengths, parse_lengths  # noqa: E402
from common.run.plots import is_seconds  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import paired_ratios, run_pairs  # noqa: E402

# NeMo-RL's Llama-3.1-8B GRPO recipe has ~1k-token responses (1,019 mean) within 4,096 tokens of
# prompt + response: a lognormal of mean 1,000 capped so that 128-token prompts fit 4,096 positions
DEFAULT_LENGTHS = "lognormal:mean=1000,sigma=0.6,min=16,max=3968"
# train_grpo.py flags this driver sets or whose use breaks its accounting of the draws
OWN_FLAGS = (
    "--bench-response-lengths",
    "--data",
    "--steps",
    "--seed",
    "--out",
    "--dynamic-sampling",
    "--resume",
    "--load-rollouts",
)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        usage="%(prog)s [options] [-- train_grpo.py flags]",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir (random weights: tests/gpu/make_random_model.py); default: the embedded tiny model",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="processes, one per GPU (default: every visible GPU, else 1)"
    )
    p.add_argument(
        "--response-lengths",
        default=DEFAULT_LENGTHS,
        metavar="SPEC",
        help="response length distribution: fixed:L, uniform:min=A,max=B, lognormal:mean=M,sigma=S,max=B[,min=A]",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="characters per prompt (tokens with a byte tokenizer)")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and left out of the numbers")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--seed", type=int, default=1234, help="train_grpo.py's --seed: the prompts, the draws, sampling")
    p.add_argument("--out", default="runs/bench_e2e", help="train_grpo.py's --out; e2e.json is written there")
    p.add_argument(
        "--ab",
        default=None,
        metavar="FLAGS",
        help="compare: pairs of whole runs, A as given and B with these train_grpo.py flags added (one quoted "
        "string, e.g. '--true-on-policy'); reports B / A per phase, the median of the per-pair ratios",
    )
    p.add_argument("--pairs", type=int, default=3, help="with --ab: pairs of runs (the order alternating)")
    return p


def split_argv(argv):
    """(this driver's flags, train_grpo.py's flags after `--`). `--ab X` becomes `--ab=X`: argparse would read a
    value that starts with a dash (`--ab --true-on-policy`) as a flag of its own."""
    own, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    for i in range(len(own) - 1):
        if own[i] == "--ab":
            own = own[:i] + [f"--ab={own[i + 1]}"] + own[i + 2 :]
            break
    return own, passthrough


def write_prompts(path, count, length, seed):
    """count rows {"prompt": `length` random letters and spaces, "answer": "0"} as JSON lines."""
    rng = random.Random(f"e2e-prompts/{seed}")
    alphabet = string.ascii_letters + "      "  # words of ~9 letters
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(rng.choice(alphabet) for _ in range(length)), "answer": "0"}) + "\n")


def max_positions(model):
    """The model's max_position_embeddings (the embedded model's without --model)."""
    if model is None:
        from common.run.embedded import DEFAULT_CONFIG

        return DEFAULT_CONFIG["max_position_embeddings"]
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f).get("max_position_embeddings") or math.inf


def length_stats(lengths):
    """count, mean, std (population), min, nearest-rank p50 / p90 / p99, max of a list of lengths."""
    ordered, n = sorted(lengths), len(lengths)
    mean = sum(ordered) / n

    def rank(q):
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return dict(
        count=n,
        mean=mean,
        std=math.sqrt(sum((x - mean) ** 2 for x in ordered) / n),
        min=ordered[0],
        p50=rank(0.5),
        p90=rank(0.9),
        p99=rank(0.99),
        max=ordered[-1],
    )


def engines_bound(timed, world):
    """--rollout-gpus: what the timed steps say of the steady state (None without engines of their own, or when
    the engines did nothing in them). The engines' rate: the tokens they generated (generated_tokens; whole
    requests: the step's response tokens) over their busy seconds (engine_busy_sec); a step's engine seconds: its
    response tokens at that rate; its trainer seconds: step_s less the wait for samples (rollout_s). Steps that
    train samples banked earlier (the warm-up's) can run at the trainer's pace; in steady state a step takes the
    longer of the two, and tokens/s/GPU follows."""
    busy = sum(r.get("engine_busy_sec", 0.0) for r in timed)
    if busy <= 0:
        return None
    rate = sum(r.get("generated_tokens", r["response_tokens"]) for r in timed) / busy
    n = len(timed)
    engine_s = sum(r["response_tokens"] for r in timed) / n / rate
    trainer_s = sum(r["step_s"] - r.get("rollout_s", 0.0) for r in timed) / n
    step_s = max(engine_s, trainer_s)
    return dict(
        engine_tokens_per_s=rate,
        engine_s_per_step=engine_s,
        trainer_s_per_step=trainer_s,
        bound="engines" if engine_s > trainer_s else "trainer",
        tokens_per_s_per_gpu=sum(r["tokens"] for r in timed) / n / step_s / world,
    )


def summarize(rows, run_args, layout, spec_text, warmup):
    """The report (module docstring) of metrics.jsonl rows of steps >= warmup; run_args and
    layout: the run's config.json."""
    world = layout["world_size"] + layout.get("rollout_gpus", 0)  # per GPU: --rollout-gpus' engines' included
    prompts, group = run_args["prompts_per_step"], run_args["samples_per_prompt"]
    timed = [r for r in rows if r["step"] >= warmup]
    drawn = {
        r["step"]: [
            n for row in draw_lengths(spec_text, prompts, group, seed=run_args["seed"], step=r["step"]) for n in row
        ]
        for r in timed
    }
    if run_args.get("off_policy_steps"):  # groups draw when they start (common/rollout/partial.py): the n-th's
        drawn = {
            r["step"]: [
                n
                for g in range(i * prompts, (i + 1) * prompts)
                for n in draw_lengths(spec_text, 1, group, seed=run_args["seed"], step=g, round_=-1)[0]
            ]
            for i, r in enumerate(timed)
        }
    tokens, step_s = sum(r["tokens"] for r in timed), sum(r["step_s"] for r in timed)
    response_tokens = sum(r["response_tokens"] for r in timed)
    # seconds per phase: the seconds keys but step_s (common/run/plots.py's rule: gen_tokens_per_s is a rate)
    phase_keys = sorted({k for r in timed for k in r if is_seconds(k) and k != "step_s"})
    phase_s = {k: sum(r.get(k, 0.0) for r in timed) for k in phase_keys}
    phase_s["other_s"] = step_s - sum(phase_s.values())  # advantages, packing, metric reduction, ...
    rollout_s = phase_s.get("rollout_s", 0.0)
    return dict(
        tokens_per_s_per_gpu=tokens / step_s / world,
        tokens_per_s_per_gpu_per_step=[r["tokens"] / r["step_s"] / world for r in timed],
        step_s_mean=step_s / len(timed),
        step_s_per_step=[r["step_s"] for r in timed],
        tokens_per_step=[r["tokens"] for r in timed],
        response_tokens_per_step=[r["response_tokens"] for r in timed],
        prompt_tokens_per_sample=(tokens - response_tokens) / (len(timed) * prompts * group),
        gen_tokens_per_s_per_gpu=response_tokens / rollout_s / world if rollout_s else None,
        phases={
            k: dict(s=v / len(timed), share=v / step_s, tokens_per_s_per_gpu=tokens / v / world if v > 0 else None)
            for k, v in phase_s.items()
        },
        lengths=length_stats([n for step in drawn.values() for n in step]),
        # per step only when synchronous: with --off-policy-steps a step trains groups started at earlier steps
        lengths_exact=None
        if run_args.get("off_policy_steps")
        else all(sum(drawn[r["step"]]) == r["response_tokens"] for r in timed),
        memory_gb={
            k: max(r[k] for r in timed if k in r) for k in sorted({k for r in timed for k in r}) if k.startswith("mem_")
        },
        # seconds that are not phases of the step (engine_busy_sec: the engines' own; sync_wait_sec: within train_s)
        within_s={
            k: sum(r.get(k, 0.0) for r in timed) / len(timed)
            for k in sorted({k for r in timed for k in r})
            if k.endswith("_sec")
        },
        steady_state=engines_bound(timed, world) if layout.get("rollout_gpus") else None,
        world_size=world,
        layout=layout,
        prompts_per_step=prompts,
        samples_per_prompt=group,
        samples_per_step=prompts * group,
        mini_batch_size=run_args["mini_batch_size"] or prompts * group,
        response_lengths=spec_text,
        warmup_steps=warmup,
        steps=len(timed),
    )


def device_name(layout, nproc):
    if not layout["device"].startswith("cuda"):
        return layout["device"]
    import torch

    return f"{nproc} x {torch.cuda.get_device_name(0)}"


def print_table(r):
    lengths = r["lengths"]
    print(
        f"\ne2e GRPO on {r['device']}: {r['samples_per_step']} samples/step ({r['prompts_per_step']} prompts x "
        f"{r['samples_per_prompt']}), mini-batch {r['mini_batch_size']}, {r['steps']} timed steps after "
        f"{r['warmup_steps']}"
    )
    print(
        f"response lengths {r['response_lengths']}: drawn mean {lengths['mean']:.0f}, p50 {lengths['p50']}, p90 "
        f"{lengths['p90']}, p99 {lengths['p99']}, max {lengths['max']}"
        + (
            ""
            if r["lengths_exact"] is not False
            else "  (NOT EXACT: the responses' token counts differ from the draws)"
        )
        + f"; prompts {r['prompt_tokens_per_sample']:.0f} tokens"
    )
    print(f"tokens/s/GPU over the whole step: {r['tokens_per_s_per_gpu']:.1f}, step {r['step_s_mean']:.2f} s")
    print(f"  {'phase':16s} {'s':>9s} {'share':>7s} {'tokens/s/GPU':>14s}")
    for name, p in sorted(r["phases"].items(), key=lambda kv: -kv[1]["s"]):
        rate = f"{p['tokens_per_s_per_gpu']:14.1f}" if p["tokens_per_s_per_gpu"] else f"{'-':>14s}"
        print(f"  {name:16s} {p['s']:9.3f} {100 * p['share']:6.1f}% {rate}")
    steady = r.get("steady_state")
    if steady:
        print(
            f"steady state (estimate, --rollout-gpus): the engines generate {steady['engine_tokens_per_s']:.0f} "
            f"tokens/s; a step needs {steady['engine_s_per_step']:.2f} s of them and {steady['trainer_s_per_step']:.2f}"
            f" s of the trainer: bound by the {steady['bound']}, ~{steady['tokens_per_s_per_gpu']:.1f} tokens/s/GPU"
        )


def ab_report(a, b, flags):
    """B / A of two sides' reports (summarize) measured in pairs: the mean step seconds, tokens/s/GPU and each
    phase both sides have, each as paired_ratios (median, min, max, per pair) with each side's median."""

    def b_over_a(key):
        r = paired_ratios([key(x) for x in b], [key(x) for x in a])
        r["a_median"], r["b_median"] = r["b_median"], r["a_median"]  # paired_ratios names its arguments a, b
        return r

    ratios = {"step_s": b_over_a(lambda r: r["step_s_mean"])}
    ratios["tokens_per_s_per_gpu"] = b_over_a(lambda r: r["tokens_per_s_per_gpu"])
    if all(r.get("steady_state") for r in a + b):  # --rollout-gpus on both sides: the steady-state estimates too
        ratios["steady_tokens_per_s_per_gpu"] = b_over_a(lambda r: r["steady_state"]["tokens_per_s_per_gpu"])
    phases = set(a[0]["phases"]).intersection(*(r["phases"] for r in a + b))
    for name in sorted(phases):
        ratios[name] = b_over_a(lambda r, name=name: r["phases"][name]["s"])
    return dict(ab_flags=flags, pairs=len(a), ratios=ratios, a=a, b=b, device=a[0]["device"])


def print_ab(report):
    print(f"\nB / A over {report['pairs']} pairs on {report['device']}, B = A + {report['ab_flags']}:")
    print(f"  {'':22s} {'median':>8s} {'min':>8s} {'max':>8s} {'A':>10s} {'B':>10s}")
    for name, r in report["ratios"].items():
        spread = f"{r['median']:8.3f} {r['min']:8.3f} {r['max']:8.3f}"
        print(f"  {name:22s} {spread} {r['a_median']:10.3f} {r['b_median']:10.3f}")


class RunFailed(Exception):
    """A train_grpo.py run that gave no numbers; args[0]: the exit status to return."""


def run_once(args, spec, data, out, passthrough):
    """One train_grpo.py run into `out`: its report (summarize, with device and command), also written to
    out/e2e.json. RunFailed: the run exited non-zero or wrote too few steps."""
    train = [
        "train_grpo.py",
        *(["--model", args.model] if args.model else []),
        "--bench-response-lengths",
        args.response_lengths,
        "--max-new-tokens",
        str(spec.high),
        "--data",
        data,
        "--raw-prompts",
        "--max-prompt-len",
        str(args.prompt_len),
        "--steps",
        str(args.warmup + args.steps),
        "--seed",
        str(args.seed),
        "--eval-every",
        "0",
        "--log-samples-every",
        "0",
        "--save-every-minutes",
        "0",
        "--wandb",
        "disabled",
        "--out",
        out,
        "--start-over",
        *passthrough,
    ]
    launcher = (
        [sys.executable]
        if args.nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    )
    command = launcher + train
    print("running: " + shlex.join(command), flush=True)
    rc = subprocess.run(command, cwd=ROOT).returncode
    if rc != 0:
        print(f"train_grpo.py exited with status {rc}: no numbers", file=sys.stderr)
        raise RunFailed(rc)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if sum(r["step"] >= args.warmup for r in rows) < args.steps:
        print(
            f"{out}/metrics.jsonl holds {len(rows)} steps, not {args.warmup + args.steps}: no numbers", file=sys.stderr
        )
        raise RunFailed(1)
    result = summarize(rows, config["args"], config["layout"], args.response_lengths, args.warmup)
    result.update(
        device=device_name(config["layout"], args.nproc), command=shlex.join(command), prompt_len=args.prompt_len
    )
    print_table(result)
    with open(os.path.join(out, "e2e.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None):
    p = build_parser()
    own, passthrough = split_argv(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(own)
    try:
        spec = parse_lengths(args.response_lengths)
    except ValueError as e:
        p.error(str(e).replace("--bench-response-lengths", "--response-lengths"))
    extra = shlex.split(args.ab) if args.ab else []
    given = [a for a in passthrough + extra if a.split("=")[0] in OWN_FLAGS]
    if given:
        p.error(f"{given[0]} after `--` or in --ab: this driver sets it (use its own flags, see --help)")
    if args.ab is not None and (not extra or args.pairs < 1):
        p.error("--ab needs train_grpo.py flags for B (e.g. --ab '--true-on-policy') and --pairs >= 1")
    positions = max_positions(args.model)
    if args.prompt_len + spec.high > positions:
        p.error(
            f"--prompt-len {args.prompt_len} + the longest response {spec.high} > the model's {positions} positions: "
            "lower one of them"
        )
    if args.nproc is None:
        import torch

        args.nproc = max(1, torch.cuda.device_count())
    args.out = os.path.abspath(args.out)  # train_grpo.py runs in the repository's root
    args.model = args.model and os.path.abspath(args.model)

    prompts_dir = tempfile.mkdtemp(prefix="e2e_prompts_")
    data = os.path.join(prompts_dir, "prompts.jsonl")
    write_prompts(data, 1024, args.prompt_len, args.seed)
    try:
        if args.ab is None:  # its report written to --out/e2e.json
            result = run_once(args, spec, data, args.out, passthrough)
        else:  # each run's report in --out/a<pair> and b<pair>, the comparison in --out/e2e_ab.json
            a, b = run_pairs(
                lambda pair: run_once(args, spec, data, os.path.join(args.out, f"a{pair}"), passthrough),
                lambda pair: run_once(args, spec, data, os.path.join(args.out, f"b{pair}"), passthrough + extra),
                args.pairs,
                warmup=0,
            )
            result = ab_report(a, b, args.ab)
            print_ab(result)
            with open(os.path.join(args.out, "e2e_ab.json"), "w") as f:
                json.dump(result, f, indent=1)
    except RunFailed as failed:
        return failed.args[0]
    finally:
        shutil.rmtree(prompts_dir, ignore_errors=True)
    print("BENCH_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
