"""GPU: agentic episodes (--env) through train_grpo.py on the vLLM engine, and the multi-turn benchmark.

    python -m pytest -q -s tests/gpu/test_agentic_gpu.py     (GPU machine, stack of shared/device)

1. The embedded model with --env game for 3 steps, every sample's engine logprobs requested
   (--rollout-logprobs all), against the same run single-turn (no --env): episodes take more than one
   turn, and logprob_mismatch over every model token of the episodes is at single-turn levels (<= 2x
   the single-turn run's + 1e-3): the ids the trainer sees are the ones vLLM sampled, request by request
   (VLLMEngine.add_turn / finished_turns at rollout TP 1).
2. With two GPUs: the same at --tp 2 --rollout-tp 2, where turns run in waves (each rank of a vLLM TP
   group schedules alone), on a random model of Qwen2-0.5B's shape with the same byte tokenizer (the
   embedded model's 16-wide heads hang vLLM's start-up at rollout TP 2, refused: docs/gpu.md) and shorter turns.
3. bench/agentic.py at qwen2-1.5b: multi-turn tokens/s with 100 ms tools, and with lognormal tool times of
   mean 100 ms (256 tool workers: none waits for another) over single-turn at equal generated tokens,
   request-level and lock-step (target >= 0.9x request-level; reported, not required).
Results: $OUT/agentic.json.
"""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import launch_checked, run_script, save_results  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ARGS = ["--rollout", "vllm", "--steps", "3", "--rollout-logprobs", "all", "--save-every", "0", "--eval-every", "0"]
RESULTS = {}


def record(name, value):
    RESULTS[name] = value
    print("RESULT", name, json.dumps(value), flush=True)
    save_results("agentic.json", RESULTS)


@pytest.mark.parametrize("ranks", [1, 2])
def test_episodes_on_vllm_train_on_the_engines_ids(tmp_path, ranks):
    if ranks > torch.cuda.device_count():
        pytest.skip(f"{ranks} GPUs needed")
    layout = ["--tp", ranks, "--rollout-tp", ranks] if ranks > 1 else []
    if ranks > 1:  # Qwen2-0.5B's shape, the byte tokenizer; 32 samples of <= 32 tokens a turn
        model = tmp_path / "model"
        launch_checked([sys.executable, "tests/gpu/make_random_model.py", str(model), "--shape", "0.5b"], 120)
        layout += ["--model", model, "--prompts-per-step", 8, "--samples-per-prompt", 4, "--max-new-tokens", 32]
    launch = dict(ranks=ranks if ranks > 1 else None, timeout=270)  # a hang fails with every rank's stacks
    single, _ = run_script("train_grpo.py", tmp_path / "single", *ARGS, *layout, **launch)
    env = ["--env", "game", "--max-turns", 3]
    episodes, _ = run_script("train_grpo.py", tmp_path / "env", *ARGS, *layout, *env, **launch)
    keep = ("logprob_mismatch", "turns_per_episode", "episode_tokens", "env_reward", "rollout_s")
    record(f"train_grpo_ranks{ranks}", {"single": single, "episodes": [{k: m.get(k) for k in keep} for m in episodes]})
    assert all(m["turns_per_episode"] > 1 for m in episodes)
    worst_single = max(m["logprob_mismatch"] for m in single)
    assert max(m["logprob_mismatch"] for m in episodes) <= 2 * worst_single + 1e-3


@pytest.mark.parametrize("tool_ms", ["100", "lognormal:mean=100,sigma=0.8,max=1000"], ids=["fixed", "lognormal"])
def test_bench_multi_turn_against_single_turn(tool_ms):
    # every tool at once (as I/O-bound tools can): the engine's path, not a queue of 32 tool workers; tools of
    # one length (episodes reach them together) and of drawn lengths (episodes reach them apart)
    bench = ["bench/agentic.py", "--shape", "qwen2-1.5b", "--reps", "3", "--tool-workers", "256", "--tool-ms", tool_ms]
    output = launch_checked([sys.executable, *bench], timeout=400)
    result = json.loads(next(line for line in output.splitlines() if line.startswith("BENCH_JSON "))[11:])
    record(f"bench_agentic_{tool_ms.split(':')[0]}", result)
    assert result["episodes_over_single"] is not None and result["lockstep_over_single"] is not None  # equal work
