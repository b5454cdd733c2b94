"""Worker of tests/test_episodes.py: agentic episodes on the two ranks of one replica (rollout TP = 2), whose
environment answers differently on each rank (as a tool that reads the clock or times out can).

    torchrun --nproc_per_node 2 tests/episodes_worker.py follow   # rank 0 runs the episodes, rank 1 follows
    torchrun --nproc_per_node 2 tests/episodes_worker.py alone    # each rank runs its own (the control)

Each rank's engine records every generate call (prompts, seed). Rank 0 prints one JSON line: whether the
two ranks' engines were given the same calls, how many calls and samples each rank had, and the
observation text of rank 0's first sample.
"""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.env.base import Environment, Step  # noqa: E402 (after the path)
from common.env.chat import ChatCodec  # noqa: E402
from common.rollout.engine import RolloutEngine, Sample  # noqa: E402
from common.rollout.episodes import run_episodes  # noqa: E402
from tests.chat_templates import template_tokenizer  # noqa: E402


class RecordingEngine(RolloutEngine):
    """Each turn: two tokens that depend on the call's index and the prompt's length, then the stop id."""

    def __init__(self, stop_id):
        self.stop_id, self.calls = stop_id, []

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed, **_):
        self.calls.append([[list(p) for p in prompts], seed])
        ids = [[40 + len(self.calls) % 20, 40 + len(p) % 20, self.stop_id] for p in prompts]
        return [Sample(list(p), s, [-0.5] * len(s), "stop") for p, s in zip(prompts, ids)]


class RankEnv(Environment):
    """Two tool answers that name this rank, then the end."""

    def reset(self, item):
        self.turn = 0
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return Step(done=True, reward=float(dist.get_rank()))
        return Step(observation=[{"role": "tool", "content": f"rank {dist.get_rank()} turn {self.turn}"}])


def main():
    dist.init_process_group("gloo")
    tokenizer = template_tokenizer("smollm")
    engine = RecordingEngine(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    if sys.argv[1] == "follow":  # as VLLMEngine sets them at rollout TP 2
        engine.wave_group, engine.wave_leader = dist.new_group([0, 1], backend="gloo"), 0
    samples = run_episodes(
        engine, ChatCodec(tokenizer), RankEnv, [{"prompt": f"item {i}"} for i in range(3)], n=2,
        temperature=1.0, top_p=1.0, max_tokens=8, max_turns=4, max_episode_tokens=500, step_timeout_s=5, seed=0,
    )  # fmt: skip
    calls = [None, None]
    dist.all_gather_object(calls, engine.calls)
    counts = [None, None]
    dist.all_gather_object(counts, len(samples))
    if dist.get_rank() == 0:
        s = samples[0]
        observation = [t for t, m in zip(s.response_ids, s.response_mask) if not m]
        result = dict(
            same_calls=calls[0] == calls[1],
            calls=[len(c) for c in calls],
            samples=counts,
            observation=tokenizer.decode(observation),
            rewards=[x.episode["reward"] for x in samples],
        )
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
