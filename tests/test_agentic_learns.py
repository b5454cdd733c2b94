"""The embedded tiny model learns the built-in game (--env game) through train_grpo.py on the CPU, reading
the feedback of its first turn (common/env/game.py); a file of its own so that the suite's workers
(pytest-xdist, whole files) run it beside tests/test_train_agentic.py.

    .venv/bin/python -m pytest -x -q -s tests/test_agentic_learns.py
"""

import pytest

from tests.conftest import read_metrics, run_script


def test_grpo_learns_the_game_from_its_feedback(tmp_path):
    """Guessing digits blindly earns 0.19 over two turns; above that the model reads the feedback of its
    first miss (common/env/game.py). Measured: 0.012 over the first 5 steps, 0.71 over the last 5 (no KL
    term: its reference pass would be a sixth of each step)."""
    run_script("train_grpo.py", "--env", "game", "--max-turns", "2", "--steps", 60, "--kl-coef", 0, "--out", tmp_path)
    metrics = read_metrics(tmp_path)
    rewards = [m["env_reward"] for m in metrics]
    assert rewards == [m["reward_mean"] for m in metrics]  # the environment's reward is the reward
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"env reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.05 and last >= 0.35
    # multi-turn: most episodes take 2 turns of one token each; every other token is an observation's, masked
    step = metrics[0]
    assert 1.5 < step["turns_per_episode"] <= 2
    assert step["response_len_mean"] == pytest.approx(step["turns_per_episode"])
    assert step["episode_tokens"] > 40  # prompt (~30) + turns + the observation (~30 tokens)
    assert step["logprob_mismatch"] < 1e-4  # the engine's logprob of every model token, as single-turn
    assert step["tool_calls"] == 0 and step["tool_errors"] == 0
