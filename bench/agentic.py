"""Benchmark multi-turn agentic rollouts against single-turn generation, same engine, same run.

    python bench/agentic.py --shape qwen2-1.5b                       # 1 GPU (vLLM)
    python bench/agentic.py --shape tiny --episodes 4 --turns 2 --turn-tokens 4 --tool-ms 10 --reps 1   # CPU smoke

Random weights of a Qwen2 shape (bench/harness.py) in the run's engine (VLLMEngine on a GPU, built
with eos_token_ids=[] so that every turn has exactly --turn-tokens tokens; HFEngine on a CPU).
--episodes episodes, each --turns turns of --turn-tokens tokens (common/rollout/episodes.py),
whose environment sleeps --tool-ms before answering each turn with a short tool message (at most
--tool-workers at once: 256 episodes' 100-ms tools through 32 workers take 0.8 s a turn), against:
(--tool-ms as a distribution, e.g. lognormal:mean=100,sigma=0.8,max=2000: each episode's tools take
their own times, drawn once, the same in every comparison; episodes then reach their tools apart, as
real tools make them, where equal times make all of them wait together)

  single     engine.generate of the same first prompts, one sample each, --turns x --turn-tokens
             tokens, logprobs on (the episodes ask for them too): the same generated tokens in one turn
  episodes   the episodes as train_grpo.py --env runs them: at rollout TP 1 on vLLM each turn is its
             own request, added when its observation is ready (tool time hidden behind the others'
             decoding)
  lockstep   the same episodes in waves (VLLMEngine.lockstep_turns): every tool waited for, then all
             the ready turns generate together (the CPU engine always runs so)

tokens/s counts the model's tokens only. Where the episodes' time goes: engine_s (inside the engine's steps,
engine.finished_turns), engine_steps (their number) and driver_s (the rest: waiting for tools with the
engine idle, the driver's own work), add_s (of it, handing turns to the engine). On vLLM, both sides' engine
steps: their number, median time, the seconds in slow steps (over 3x the median: prefills, mixed batches) and
the share of finished requests' prompt tokens that vLLM's prefix cache held (a turn's prompt is the episode so
far). Each rollout's line, as it ends, gives these for that rollout, and the seconds the interpreter spent in
its garbage collections (gc.callbacks; any thread's), with the number of full ones. Paired rounds
(harness.run_pairs), one warm-up pair.
Reported: episodes / single and lockstep / single, median of the per-pair ratios with min and max, and each side's
ceiling (ceilings(): what it could reach with no overhead at all, the tools it cannot hide counted; median over pairs).
Target (docs/agentic.md): episodes >= 0.9x single with 100 ms tools.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import SHAPES, paired_ratios, run_pairs, shared_config_dir  # noqa: E402

from common.env.base import Environment, Step  # noqa: E402
from common.rollout.lengths import draw_lengths  # noqa: E402

STEP_KEYS = ("vllm_steps", "vllm_step_ms_median", "vllm_slow_steps_s", "prompt_cached_share")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2-1.5b", help="model shape (bench/harness.py)")
    p.add_argument("--episodes", type=int, default=256, help="episodes per rollout")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--turn-tokens", type=int, default=128, help="tokens per turn (EOS ignored)")
    p.add_argument("--prompt-len", type=int, default=64, help="characters of the first user message")
    p.add_argument(
        "--tool-ms",
        default="100",
        help="milliseconds each environment step sleeps: a number, or a distribution as --bench-response-lengths "
        "takes one (uniform:min=A,max=B, lognormal:mean=M,sigma=S,max=B[,min=A]), drawn per episode and turn",
    )
    p.add_argument(
        "--tool-workers",
        type=int,
        default=32,
        help="environment steps running at once (the training scripts' --tool-workers, default 32; --episodes: "
        "every tool at once, as I/O-bound tools can)",
    )
    p.add_argument(
        "--sides", nargs="+", choices=("episodes", "lockstep"), default=["episodes", "lockstep"],
        help="the multi-turn sides to compare with single-turn (each its own pairs)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=3, help="timed pairs per comparison (after one warm-up pair)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share of the GPU")
    p.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="vLLM's batch: requests it runs at once (default: vLLM's, by GPU: docs/agentic.md)",
    )  # fmt: skip
    p.add_argument(
        "--gc-freeze", action="store_true",
        help="freeze the interpreter's heap for each rollout (gc.freeze, gc.unfreeze after; both sides): its "
        "collections then look at the rollout's new objects only",
    )  # fmt: skip
    p.add_argument(
        "--dummy-weights", action="store_true",
        help="vLLM starts on its own random weights (load_format dummy) instead of loading random HF weights this "
        "script writes first (minutes at 7B); the work per token is the same",
    )  # fmt: skip
    return p


class SleepingTool(Environment):
    """Answers every turn after its item's next delay (seconds) with a short tool message (the driver's
    --max-turns ends the episode)."""

    def reset(self, item):
        self.delays = list(item["delays"])
        return super().reset(item)

    def step(self, text):
        time.sleep(self.delays.pop(0))
        return Step(observation=[{"role": "tool", "content": "ok"}], tool_calls=1)


def tool_delays(spec, episodes, turns):
    """Each episode's `turns` tool times in seconds: spec a number of milliseconds, or a distribution of them
    (common/rollout/lengths.py), drawn once (seed 0)."""
    try:
        return [[float(spec) / 1000] * turns for _ in range(episodes)]
    except ValueError:
        return [[ms / 1000 for ms in row] for row in draw_lengths(spec, episodes, turns, seed=0, step=0)]


def ceilings(delays, single_seconds):
    """The best tokens/s ratio each side can reach against a single-turn rollout of single_seconds, where a decode
    step takes as long whatever the batch and every tool runs as soon as its turn ends: an episode cannot finish
    before its own turns and tools, so request by request the rollout takes at least single_seconds + the longest
    episode's sum of tool times; in waves every turn waits for the slowest tool of the wave. -> (request by
    request, lock-step)."""
    request = max(map(sum, delays))
    waves = sum(max(row[t] for row in delays) for t in range(len(delays[0])))
    return single_seconds / (single_seconds + request), single_seconds / (single_seconds + waves)


def main():
    args = build_parser().parse_args()
    import torch

    from common.env.chat import ChatCodec
    from common.rollout.episodes import run_episodes
    from common.run.dist import init_distributed, print0
    from common.run.embedded import build_tokenizer

    info = init_distributed(tp=1)
    on_gpu = info.device.type == "cuda"
    dummy = on_gpu and args.dummy_weights
    hf_dir = shared_config_dir(args.shape, "bench_agentic_", info.master_process, with_weights=not dummy)
    # the chat template's observation and header tokens: the embedded byte tokenizer (ids < 259 exist in every shape)
    codec = ChatCodec(build_tokenizer())
    delays = tool_delays(args.tool_ms, args.episodes, args.turns)
    items = [{"prompt": "q" * args.prompt_len, "delays": row} for row in delays]
    prompts = [codec.prompt_ids(SleepingTool().reset(item)) for item in items]
    context = max(map(len, prompts)) + args.turns * (args.turn_tokens + 32)  # (+ the observations)
    if on_gpu:
        from common.rollout.vllm_engine import VLLMEngine

        batch = {} if args.max_num_seqs is None else dict(max_num_seqs=args.max_num_seqs)
        engine = VLLMEngine(
            hf_dir,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=context,
            eos_token_ids=[],
            load_format="dummy" if dummy else "auto",
            **batch,
        )
        if dummy:  # vLLM's random weights are the engine's: no sync comes
            engine._weights_valid = True
    else:
        from common.rollout.hf_engine import HFEngine

        engine = HFEngine(hf_dir, dtype=torch.float32, eos_token_ids=[], max_model_len=context)
    sampling = dict(temperature=1.0, top_p=1.0)

    collections, gc_started = dict(gc_s=0.0, gc_full=0), []

    def on_gc(phase, info):  # the interpreter's collections (any thread's; it holds the GIL throughout one)
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            collections["gc_s"] += time.perf_counter() - gc_started.pop()
            collections["gc_full"] += info["generation"] == 2

    gc.callbacks.append(on_gc)

    def rollout(run):
        """run() timed, the interpreter's collections during it counted (--gc-freeze: the heap frozen for it)
        -> (its result, seconds, dict(gc_s, gc_full: seconds in collections, full ones))."""
        collections.update(gc_s=0.0, gc_full=0)
        start = time.perf_counter()
        if args.gc_freeze:
            gc.freeze()
        try:
            out = run()
        finally:
            if args.gc_freeze:
                gc.unfreeze()
        return out, time.perf_counter() - start, dict(collections)

    def report(name, pair, d):
        """A rollout's line, as it ends: its seconds and where they went."""
        parts = []
        if "engine_s" in d:
            parts.append(f"engine {d['engine_s']:.2f} s in {d['engine_steps']} steps, driver {d['driver_s']:.2f} s "
                         f"(adding turns {d['add_s']:.2f} s)")  # fmt: skip
        if "vllm_steps" in d:
            parts.append(f"{d['vllm_steps']} vLLM steps, median {d['vllm_step_ms_median']:.1f} ms, "
                         f"{d['vllm_slow_steps_s']:.2f} s in slow ones")  # fmt: skip
        parts.append(f"collections {d['gc_s']:.2f} s, {d['gc_full']} full")
        print0(f"  {name} rollout (pair {pair}): {d['seconds']:.2f} s ({'; '.join(parts)})")

    def single(pair):
        steps.clear()
        samples, seconds, gc_stats = rollout(
            lambda: engine.generate(prompts, n=1, max_tokens=args.turns * args.turn_tokens, seed=pair, **sampling)
        )
        tokens = sum(len(s.response_ids) for s in samples)
        measured = dict(tokens=tokens, seconds=seconds, **gc_stats, **step_stats())
        report("single-turn", pair, measured)
        return measured

    clock = dict(engine_s=0.0, engine_steps=0, add_s=0.0)
    steps = []  # vLLM: each engine step of the current side (seconds, prompt tokens, of them cached) of finished turns
    if on_gpu:
        vllm_step = engine.llm.llm_engine.step

        def timed_vllm_step():  # both sides' engine steps (engine.generate's loop and the episodes' turns)
            start = time.perf_counter()
            outs = vllm_step()
            seconds = time.perf_counter() - start  # the step alone, not this accounting
            done = [o for o in outs if o.finished]
            prompt = sum(len(o.prompt_token_ids or ()) for o in done)
            steps.append((seconds, prompt, sum(o.num_cached_tokens or 0 for o in done)))
            return outs

        engine.llm.llm_engine.step = timed_vllm_step
    finished_turns, add_turn = engine.finished_turns, engine.add_turn

    def timed_finished_turns():  # the episodes' engine steps, timed (the instance's attribute shadows the method)
        start = time.perf_counter()
        done = finished_turns()
        clock["engine_s"] += time.perf_counter() - start
        clock["engine_steps"] += 1
        return done

    engine.finished_turns = timed_finished_turns

    def timed_add_turn(*a):  # the driver's time handing turns to the engine
        start = time.perf_counter()
        add_turn(*a)
        clock["add_s"] += time.perf_counter() - start

    engine.add_turn = timed_add_turn

    def step_stats():
        """The side's vLLM steps: their number, median ms, seconds in steps over 3x the median (prefills,
        mixed batches), the share of finished requests' prompt tokens the prefix cache held."""
        if not steps:
            return {}
        times = sorted(t for t, _, _ in steps)
        median = times[len(times) // 2]
        prompt = sum(p for _, p, _ in steps)
        return dict(
            vllm_steps=len(steps),
            vllm_step_ms_median=1000 * median,
            vllm_slow_steps_s=sum(t for t in times if t > 3 * median),
            prompt_cached_share=sum(c for _, _, c in steps) / prompt if prompt else None,
        )

    def episodes(pair, lockstep=False):
        engine.lockstep_turns = lockstep  # (HFEngine: waves either way)
        clock.update(engine_s=0.0, engine_steps=0, add_s=0.0)
        steps.clear()
        samples, seconds, gc_stats = rollout(
            lambda: run_episodes(
                engine,
                codec,
                SleepingTool,
                items,
                n=1,
                max_tokens=args.turn_tokens,
                max_turns=args.turns,
                max_episode_tokens=context,
                step_timeout_s=60,
                seed=pair,
                max_workers=args.tool_workers,
                **sampling,
            )
        )
        engine.lockstep_turns = False
        tool_s = sum(s.episode["tool_s"] for s in samples) / sum(s.episode["turns"] for s in samples)
        tokens = sum(sum(s.response_mask) for s in samples)
        driver_s = seconds - clock["engine_s"]
        measured = dict(tokens=tokens, seconds=seconds, tool_s=tool_s, driver_s=driver_s, **clock, **gc_stats)
        measured.update(step_stats())
        report("lockstep" if lockstep else "episodes", pair, measured)
        return measured

    result = dict(vars(args), engine="vllm" if on_gpu else "cpu")
    if on_gpu:  # the batch vLLM chose (or was given)
        result["max_num_seqs"] = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    result["tool_ms_drawn_mean"] = 1000 * sum(map(sum, delays)) / (args.episodes * args.turns)
    sides = (("episodes", episodes), ("lockstep", lambda pair: episodes(pair, lockstep=True)))
    for name, side in (side for side in sides if side[0] in args.sides):
        multi, base = run_pairs(side, single, args.reps)
        equal = all(m["tokens"] == b["tokens"] for m, b in zip(multi, base))
        stats = paired_ratios([m["tokens"] / m["seconds"] for m in multi], [b["tokens"] / b["seconds"] for b in base])
        result[f"{name}_tokens"] = multi[0]["tokens"]
        result[f"{name}_tool_ms_per_turn"] = 1000 * sum(m["tool_s"] for m in multi) / len(multi)  # as measured
        for key in ("seconds", "engine_s", "driver_s", "engine_steps", "add_s", "gc_s", "gc_full", *STEP_KEYS):
            if key in multi[0] and multi[0][key] is not None:
                result[f"{name}_{key}"] = sum(m[key] for m in multi) / len(multi)
        for key in ("seconds", "gc_s", "gc_full", *STEP_KEYS):  # this comparison's baseline (means over pairs)
            if key in base[0] and base[0][key] is not None:
                result[f"{name}_single_{key}"] = sum(b[key] for b in base) / len(base)
        result[f"{name}_over_single"] = stats["median"] if equal else None  # unequal work: no ratio
        ceiling = statistics.median(ceilings(delays, b["seconds"])[name == "lockstep"] for b in base)
        result[f"{name}_ceiling"] = ceiling
        result[f"{name}_over_single_range"] = [stats["min"], stats["max"]]
        result[f"{name}_seconds_per_pair"] = [[m["seconds"], b["seconds"]] for m, b in zip(multi, base)]
        result[f"{name}_tok_s"], result[f"{name}_single_tok_s"] = stats["a_median"], stats["b_median"]
        print0(
            f"{name}: {stats['a_median']:.0f} tok/s, single-turn {stats['b_median']:.0f} tok/s: "
            f"{stats['median']:.3f}x (min {stats['min']:.3f}, max {stats['max']:.3f})"
            + ("" if equal else "; UNEQUAL token counts, no ratio")
            + f"; ceiling {ceiling:.3f}x (no overhead, the tools it cannot hide counted)"
            + f"; {result[f'{name}_seconds']:.2f} s a rollout: engine {result[f'{name}_engine_s']:.2f} s in "
            f"{result[f'{name}_engine_steps']:.0f} steps, driver {result[f'{name}_driver_s']:.2f} s (adding turns "
            f"{result[f'{name}_add_s']:.2f} s); single {result[f'{name}_single_seconds']:.2f} s"
        )
        if f"{name}_vllm_steps" in result:
            print0(
                "  vLLM steps: {:.0f} (median {:.2f} ms, {:.2f} s in slow ones), prompt tokens cached {:.2f}; "
                "single-turn {:.0f} (median {:.2f} ms, {:.2f} s slow)".format(
                    *(result[f"{name}_{k}"] for k in STEP_KEYS), *(result[f"{name}_single_{k}"] for k in STEP_KEYS[:3])
                )
            )
    print0("BENCH_JSON " + json.dumps(result))
    sys.stdout.flush()
    unequal = any(result[f"{name}_over_single"] is None for name in args.sides)
    os._exit(1 if unequal else 0)  # os._exit: vLLM's in-process engine can block interpreter exit


if __name__ == "__main__":
    main()
