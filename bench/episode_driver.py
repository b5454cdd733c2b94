"""The agentic episode driver's own cost (common/rollout/episodes.py), without a model: what it adds to every engine
step at a given number of episodes.

    python bench/episode_driver.py                                   # any machine, no GPU: 256 and 2048 episodes
    python bench/episode_driver.py --episodes 4096 --step-ms 5 --tool-ms 100
    python bench/episode_driver.py --host-bound --episodes 256 2048 --turn-tokens 64   # vLLM's host-bound steps

The engine is a stand-in for vLLM at rollout TP 1 (request by request): each engine step sleeps --step-ms, as a
GPU-bound step leaves the host, and a turn finishes --turn-tokens steps after it was added. Each episode has --turns
turns, and after each its environment sleeps --tool-ms in a worker thread (--tool-workers of them, default one per
episode), then answers with a short tool message, tokenised by the chat template as in training.

Reported per episode count (the median of --reps rollouts): the rollout's seconds, the engine's steps and the
seconds measured inside them, and the rollout's seconds beyond the steps' nominal time (steps x --step-ms) and the
tool time no work hides (all episodes start together, so each turn's tools run while the engine has nothing to do:
--turns x --tool-ms): the driver's seconds, and those per engine step. That is the time vLLM's steps would wait for
the driver thread: its bookkeeping, handing steps to worker threads and taking their results, and the worker
threads' share of the interpreter (a step's sleep that ends while another thread holds it waits for it too).

--host-bound models vLLM where its steps are bound by the host rather than the GPU (docs/agentic.md: decode steps of
1024 sequences, 40-66 ms of vLLM's Python, on H200s): each engine step runs --seq-us microseconds of Python for each
running sequence, holding the interpreter as vLLM's scheduling and output processing do, with at most --batch
sequences running (the others wait, as in vLLM's queue). Then every microsecond the driver and the environments'
threads spend in the interpreter is one the engine does not have, and each run is compared with single-turn
generation of the same tokens on the same stand-in (each episode's turns as one request): reported as the
single-turn seconds over the episodes' seconds, bench/agentic.py's ratio, where the tools are the only difference.
vLLM's own work for each new turn (adding the request, prefilling its new tokens) is not modelled: what the ratio
counts is the driver's and the tools' threads' share of the interpreter.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from agentic import SleepingTool  # noqa: E402 (bench/agentic.py's: each item's delays, then a short tool message)

from common.rollout.engine import Sample  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, nargs="+", default=[256, 2048], help="episode counts to measure, each")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--turn-tokens", type=int, default=128, help="engine steps a turn takes")
    p.add_argument("--step-ms", type=float, default=5.0, help="milliseconds an engine step takes (a sleep)")
    p.add_argument("--tool-ms", type=float, default=100.0, help="milliseconds each environment step sleeps")
    p.add_argument("--tool-workers", type=int, default=None, help="environment steps at once (default: --episodes)")
    p.add_argument("--reps", type=int, default=3, help="rollouts per episode count (the median is reported)")
    p.add_argument(
        "--host-bound", action="store_true",
        help="engine steps spend --seq-us of Python per running sequence, at most --batch running, instead of "
        "sleeping --step-ms; each rollout is compared with single-turn generation of the same tokens",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=1024, help="--host-bound: sequences running at once (vLLM's batch)")
    p.add_argument("--seq-us", type=float, default=20.0, help="--host-bound: Python microseconds per sequence a step")
    return p


class StandInEngine:
    """Request by request, as VLLMEngine at rollout TP 1: add_turn queues a turn, each finished_turns() is one
    engine step (a sleep of step_s) and returns the turns that reached turn_tokens steps."""

    turns_in_waves, wave_follower = False, False

    def __init__(self, step_s, turn_tokens):
        self.step_s, self.turn_tokens = step_s, turn_tokens
        self.ends, self.now, self.steps, self.engine_s = {}, 0, 0, 0.0

    def add_turn(self, key, prompt_ids, max_tokens, temperature, top_p, seed):
        self.ends[key] = self.now + min(self.turn_tokens, max_tokens)

    def finished_turns(self):
        start = time.perf_counter()
        time.sleep(self.step_s)
        self.now, self.steps = self.now + 1, self.steps + 1
        done = [key for key, end in self.ends.items() if end <= self.now]
        for key in done:
            del self.ends[key]
        self.engine_s += time.perf_counter() - start
        return [(key, Sample([], [7] * self.turn_tokens, [0.0] * self.turn_tokens, "length")) for key in done]

    def end_waves(self):
        pass


class HostBoundEngine(StandInEngine):
    """--host-bound: each finished_turns() admits waiting turns up to `batch` running, then spends seq_s of Python
    on each running one (one token each), as vLLM's per-sequence host work does; a turn ends after turn_tokens."""

    def __init__(self, seq_s, batch, turn_tokens):
        super().__init__(0.0, turn_tokens)
        self.seq_s, self.batch, self.waiting, self.running = seq_s, batch, collections.deque(), {}

    def add_turn(self, key, prompt_ids, max_tokens, temperature, top_p, seed):
        self.waiting.append((key, min(self.turn_tokens, max_tokens)))

    def finished_turns(self):
        start = time.perf_counter()
        while self.waiting and len(self.running) < self.batch:
            key, tokens = self.waiting.popleft()
            self.running[key] = [tokens, []]
        done = []
        for key, (tokens, out) in self.running.items():
            until = time.perf_counter() + self.seq_s
            out.append(7)
            while time.perf_counter() < until:
                pass
            if len(out) >= tokens:
                done.append(key)
        self.steps += 1
        self.engine_s += time.perf_counter() - start
        finished = [(key, self.running.pop(key)[1]) for key in done]
        return [(key, Sample([], out, [0.0] * len(out), "length")) for key, out in finished]

    def generate_all(self, count, tokens):
        """Single-turn generation on this engine: `count` requests of `tokens` each, to their ends -> seconds."""
        self.turn_tokens = tokens
        start = time.perf_counter()
        for key in range(count):
            self.add_turn(key, [], tokens, 1.0, 1.0, 0)
        left = count
        while left:
            left -= len(self.finished_turns())
        return time.perf_counter() - start


def rollout(args, episodes, codec):
    """One rollout of `episodes` episodes -> dict(seconds, engine_steps, engine_s, and driver_s, driver_ms_per_step;
    --host-bound: single_seconds, over_single instead of the driver's)."""
    from common.rollout.episodes import run_episodes

    tool_s = args.tool_ms / 1000
    if args.host_bound:
        engine = HostBoundEngine(args.seq_us / 1e6, args.batch, args.turn_tokens)
    else:
        engine = StandInEngine(args.step_ms / 1000, args.turn_tokens)
    items = [{"prompt": "q" * 64, "delays": [tool_s] * args.turns}] * episodes
    start = time.perf_counter()
    samples = run_episodes(
        engine, codec, SleepingTool, items, n=1, temperature=1.0, top_p=1.0, max_tokens=args.turn_tokens,
        max_turns=args.turns, max_episode_tokens=1 << 20, step_timeout_s=600, seed=0,
        max_workers=args.tool_workers or episodes,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert all(s.episode["turns"] == args.turns for s in samples), "an episode ended early"
    result = dict(seconds=seconds, engine_steps=engine.steps, engine_s=engine.engine_s)
    if args.host_bound:  # the same tokens single-turn, on a fresh stand-in: each episode one request
        single = HostBoundEngine(args.seq_us / 1e6, args.batch, args.turn_tokens)
        result["single_seconds"] = single.generate_all(episodes, args.turns * args.turn_tokens)
        return dict(result, over_single=result["single_seconds"] / seconds)
    # beyond the steps' nominal time: a sleeping step that finds the interpreter busy when it wakes waits for it too
    driver_s = seconds - engine.steps * engine.step_s - args.turns * tool_s
    return dict(result, driver_s=driver_s, driver_ms_per_step=1000 * driver_s / engine.steps)


def main():
    args = build_parser().parse_args()
    from common.env.chat import ChatCodec
    from common.run.embedded import build_tokenizer

    codec = ChatCodec(build_tokenizer())
    result = dict(vars(args), per_episodes={})
    for episodes in args.episodes:
        runs = [rollout(args, episodes, codec) for _ in range(args.reps)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ranged = "over_single" if args.host_bound else "driver_ms_per_step"
        result["per_episodes"][str(episodes)] = dict(median, **{
            f"{ranged}_range": [min(r[ranged] for r in runs), max(r[ranged] for r in runs)]
        })  # fmt: skip
        if args.host_bound:
            print(
                f"{episodes} episodes (host-bound, batch {args.batch}): {median['seconds']:.2f} s a rollout, "
                f"single-turn {median['single_seconds']:.2f} s: {median['over_single']:.3f}x",
                flush=True,
            )
            continue
        print(
            f"{episodes} episodes: {median['seconds']:.2f} s a rollout, engine {median['engine_s']:.2f} s in "
            f"{median['engine_steps']:.0f} steps of {args.step_ms:g} ms nominal; driver {median['driver_s']:.2f} s "
            f"beyond those and the unhidden tools: {median['driver_ms_per_step']:.2f} ms per engine step",
            flush=True,
        )
    print("BENCH_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
