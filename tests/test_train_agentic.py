"""--env through the entry scripts on the CPU (embedded tiny model): the observations are masked,
PPO's critic sees the model's tokens only, a resumed run is exact, the budget and tool flags reach
the episodes, episodes of uneven lengths replayed at TP=2 (packed), CP=2, PP=2 (PPO: actor and critic) and
the MoE at EP=2 train as in one process, --env python runs, bad --env values are refused. That the
game is learned: tests/test_agentic_learns.py (its own file: the suite's workers take whole files).

    .venv/bin/python -m pytest -x -q tests/test_train_agentic.py
"""

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_script, run_scripts, run_torchrun

SMALL = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-turns", "3"]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """PPO with examples/counter_env.py (--env FILE.py:CLASS, tools): 3 steps saving their rollouts, and
    beside it 2 steps then resumed to 3 (test_resume_is_exact)."""
    root = tmp_path_factory.mktemp("agentic_ppo")
    env = ["--env", f"{ROOT}/examples/counter_env.py:Counter", "--max-new-tokens", "2", *SMALL]
    run_scripts(
        ("train_ppo.py", *env, "--steps", 3, "--out", root / "straight", "--save-rollouts", root / "rollouts"),
        ("train_ppo.py", *env, "--steps", 2, "--out", root / "resumed"),
    )
    run_script("train_ppo.py", *env, "--steps", 3, "--out", root / "resumed", "--resume")
    return root


def test_ppo_critic_values_model_tokens_only(ppo_runs):
    from common.rl.batch import pack_sequences

    saved = torch.load(ppo_runs / "rollouts" / "step_000000.pt", weights_only=False)
    samples = saved["samples"]
    assert all(s.response_mask is not None and len(s.response_mask) == len(s.response_ids) for s in samples)
    assert any(0 in s.response_mask for s in samples)  # observations
    assert saved["rewards"].tolist() == [s.episode["reward"] for s in samples]
    assert max(s.episode["turns"] for s in samples) == 3  # --max-turns 3 reached, never passed
    batch = pack_sequences(samples, pad_id=0, length_multiple=1)
    model_tokens = [sum(s.response_mask) for s in samples]
    assert batch["mask"].sum(1).tolist() == model_tokens  # the loss, GAE and the value loss use this mask
    step = read_metrics(ppo_runs / "straight")[0]
    # the script's batch: its response_len_mean is the mean of the model's tokens, not of all response ids
    assert step["response_len_mean"] == pytest.approx(sum(model_tokens) / len(samples), rel=1e-4)
    assert sum(map(len, (s.response_ids for s in samples))) > sum(model_tokens)
    assert step["turns_per_episode"] > 1 and "value_loss" in step


def test_resume_is_exact(ppo_runs):
    straight, resumed = read_metrics(ppo_runs / "straight"), read_metrics(ppo_runs / "resumed")
    assert [m["step"] for m in resumed] == [0, 1, 2]
    for key in ["policy_loss", "value_loss", "grad_norm", "reward_mean", "turns_per_episode", "episode_tokens"]:
        assert straight[2][key] == pytest.approx(resumed[2][key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env", "gmae"], "the built-in environments are game, game-direction, python"),
        (["--env", "game", "--max-turns", "0"], "must be positive"),
        (["--env", "game", "--overlong-buffer", "2"], "--overlong-buffer applies to single-turn responses"),
    ],
)
def test_bad_env_flags_are_refused(flags, message, tmp_path):
    proc = run_script("train_grpo.py", *flags, "--out", tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr + proc.stdout, proc.stderr[-2000:]


PROBE = """
import threading
import time

from common.env.base import Environment, Step

LOCK, RUNNING = threading.Lock(), [0, 0]  # steps running now, the most at once


class Probe(Environment):  # tells the model the run's tool limits and steps at once; never ends an episode
    def step(self, text):
        with LOCK:
            RUNNING[0] += 1
            RUNNING[1] = max(RUNNING)
        time.sleep(0.02)
        with LOCK:
            RUNNING[0] -= 1
        limits = f"{self.tool_timeout_s}/{self.tool_output_chars}/{RUNNING[1]}"
        return Step(observation=[{"role": "tool", "content": limits}])
"""


def qwen3_model(tmp_path):
    """The embedded model given Qwen3's chat template (tests/chat_templates.py): its dir."""
    from common.run.embedded import write_embedded_model
    from tests.chat_templates import QWEN3

    model = write_embedded_model(str(tmp_path / "qwen3"))
    (tmp_path / "qwen3" / "chat_template.jinja").write_text(QWEN3)
    return model


NO_THINKING = ["--chat-template-kwargs", '{"enable_thinking": false}']
ASSISTANT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's header, enable_thinking false


def test_budget_and_tool_flags_reach_the_episodes(tmp_path):
    """And --chat-template-kwargs (on Qwen3's template, without thinking): the first prompt and every
    observation end in the empty <think></think> the template writes after the assistant header."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "items.jsonl").write_text('{"prompt": "go", "answer": "1"}\n' * 8)  # --data's items, no make_items
    flags = ["--model", qwen3_model(tmp_path), *NO_THINKING, "--env", f"{tmp_path}/probe.py:Probe"]
    flags += ["--data", tmp_path / "items.jsonl", "--max-new-tokens", "3", "--tool-timeout", "3.5"]
    flags += ["--tool-output-chars", "7", "--max-episode-tokens", "200", "--max-turns", "5", "--tool-workers", "1"]
    flags += ["--prompts-per-step", 2, "--samples-per-prompt", 2, "--steps", 1]
    run_script("train_grpo.py", *flags, "--out", tmp_path / "run", "--save-rollouts", tmp_path / "rollouts")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "qwen3")
    samples = torch.load(tmp_path / "rollouts" / "step_000000.pt", weights_only=False)["samples"]
    observations = 0
    for s in samples:
        assert tokenizer.decode(s.prompt_ids) == "<|im_start|>user\ngo<|im_end|>\n" + ASSISTANT  # --data's
        # ~40 prompt tokens, turns of 3 and observations of ~80 tokens: 200 tokens end it before --max-turns 5
        assert len(s.prompt_ids) + len(s.response_ids) <= 200 and 1 < s.episode["turns"] < 5
        assert s.finish_reason == "length" and s.episode["episode_tokens"] == len(s.prompt_ids) + len(s.response_ids)
        mask = s.response_mask + [1]
        for start in [t for t in range(1, len(s.response_ids)) if mask[t] == 0 and mask[t - 1] == 1]:
            text = tokenizer.decode(s.response_ids[start : mask.index(1, start)])  # an observation
            stopped = s.response_ids[start - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
            # --tool-timeout and --tool-output-chars reached it; one step at a time
            tool = "\n<|im_start|>user\n<tool_response>\n3.5/7/1\n</tool_response><|im_end|>\n"
            assert text == ("" if stopped else "<|im_end|>") + tool + ASSISTANT, text
            observations += 1
    assert observations >= len(samples)


VARIED = """
from common.env.base import Environment, Step


class Varied(Environment):  # episodes of 1-3 turns, observations of 1-5 words, rewards in [0, 1]: uneven rows
    @staticmethod
    def make_items(num_items, seed=0):
        return [{"prompt": "go", "answer": str(i % 3 + 1)} for i in range(num_items)]

    def reset(self, item):
        self.left = int(item["answer"])
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.left, code = self.left - 1, sum(map(ord, text))
        if self.left == 0:
            return Step(done=True, reward=(code % 5) / 4)
        return Step(observation=[{"role": "user", "content": "ok " * (code % 5 + 1)}])
"""
VARIED_FLAGS = ["--max-new-tokens", 3, *SMALL, "--steps", 2]
MOE = ["--embedded-model", "moe", "--moe-aux-loss-coef", 0]  # (the aux loss counts each pass's padding)


@pytest.fixture(scope="module")
def env_rollouts(tmp_path_factory):
    """Episodes of uneven lengths and rewards (VARIED) from one-process runs in padded rows, their
    rollouts saved: GRPO and PPO on the dense embedded model, GRPO on the embedded MoE."""
    root = tmp_path_factory.mktemp("agentic_replay")
    (root / "varied.py").write_text(VARIED)
    flags = ["--env", f"{root}/varied.py:Varied", *VARIED_FLAGS, "--no-pack"]
    run_scripts(
        *(
            (script, *flags, *extra, "--out", root / name, "--save-rollouts", root / f"{name}_rollouts")
            for script, name, extra in (
                ("train_grpo.py", "grpo", []),
                ("train_ppo.py", "ppo", []),
                ("train_grpo.py", "moe", MOE),
            )
        )
    )
    return root


# episodes replayed at other layouts: packed under TP=2 + SP, cut over 2 CP ranks, split over 2
# pipeline stages (PPO: the actor's and the critic's micro-batches of uneven lengths), the MoE's experts over 2 ranks
# whose micro-batch counts differ (--micro-batch-tokens); the same numbers as padded rows in one
# process (the observation mask rides along with every slice)
LAYOUTS = {
    "tp2_sp_pack": ("train_grpo.py", "grpo", ["--tp", 2, "--sp", "--pack"]),
    "cp2": ("train_grpo.py", "grpo", ["--cp", 2]),
    "ppo_pp2_pack": ("train_ppo.py", "ppo", ["--pp", 2, "--pack", "--micro-batch-tokens", 48]),
    "moe_ep2_pack": ("train_grpo.py", "moe", [*MOE, "--ep", 2, "--pack", "--micro-batch-tokens", 48]),
}
PPO_KEYS = ["value_loss", "critic_grad_norm", "value_mean", "return_mean", "explained_variance"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_single_process(layout, env_rollouts, tmp_path):
    script, name, flags = LAYOUTS[layout]
    env = ["--env", f"{env_rollouts}/varied.py:Varied", *VARIED_FLAGS]
    run_torchrun(script, 2, *env, *flags, "--load-rollouts", env_rollouts / f"{name}_rollouts", "--out", tmp_path)
    reference, replayed = read_metrics(env_rollouts / name), read_metrics(tmp_path)
    assert len(replayed) == 2 and reference[0]["turns_per_episode"] > 1 and reference[0]["reward_std"] > 0
    keys = ["policy_loss", "grad_norm", "entropy", "kl", "clip_frac", "logprob_mismatch", "response_len_mean"]
    for a, b in zip(reference, replayed):
        for key in keys + (PPO_KEYS if name == "ppo" else []):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (layout, a["step"], key, a[key], b[key])


def test_python_env_runs_through_the_script(tmp_path):
    """--env python with --data: the embedded model writes no tool calls, so each episode is one turn
    scored by the math reward; the run goes through (the sandbox imports, the tool is in the prompt)."""
    (tmp_path / "math.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n' * 4)
    flags = ["--env", "python", "--data", tmp_path / "math.jsonl", "--max-new-tokens", 4, "--steps", 1]
    run_script("train_grpo.py", *flags, "--prompts-per-step", 2, "--samples-per-prompt", 2, "--out", tmp_path / "run")
    step = read_metrics(tmp_path / "run")[0]
    assert step["turns_per_episode"] == 1 and step["tool_calls"] == 0 and step["env_reward"] == 0.0


def test_chat_template_kwargs_reach_the_single_turn_prompts(tmp_path):
    """--chat-template-kwargs '{"enable_thinking": false}' on Qwen3's template: --data's prompts end in
    the empty <think></think> (the episodes': test_budget_and_tool_flags_reach_the_episodes)."""
    (tmp_path / "items.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n' * 4)
    flags = ["--model", qwen3_model(tmp_path), *NO_THINKING, "--data", tmp_path / "items.jsonl", "--steps", 1]
    flags += ["--prompts-per-step", 2, "--samples-per-prompt", 2, "--max-new-tokens", 3, "--eval-every", 0]
    run_script("train_grpo.py", *flags, "--out", tmp_path / "run", "--save-rollouts", tmp_path / "rollouts")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "qwen3")
    samples = torch.load(tmp_path / "rollouts" / "step_000000.pt", weights_only=False)["samples"]
    assert len(samples) == 4
    for s in samples:
        assert tokenizer.decode(s.prompt_ids) == "<|im_start|>user\n1+1?<|im_end|>\n" + ASSISTANT


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chat-template-kwargs", "{enable_thinking: false}"], "--chat-template-kwargs: not JSON"),
        (["--chat-template-kwargs", '["enable_thinking"]'], "a JSON object of the template's variables is needed"),
        (["--chat-template-kwargs", '{"tools": []}'], "tools: set by the run itself"),
        (["--chat-template-kwargs", '{"enable_thinking": false}'], "these prompts go in as plain text"),
    ],
)
def test_bad_chat_template_kwargs_are_refused(flags, message, tmp_path):
    proc = run_script("train_grpo.py", *flags, "--out", tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr + proc.stdout, proc.stderr[-2000:]
