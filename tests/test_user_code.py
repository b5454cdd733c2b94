"""Tests of common/run/user_code.py: --reward FILE.py:NAME loaded and checked at start-up (each
refusal one line naming the flag), and the values it returns checked. The scripts' use of
it: tests/test_train_grpo.py (test_user_reward) and tests/test_train_ppo.py.

    .venv/bin/python -m pytest -q tests/test_user_code.py
"""

import pytest

from common.run.user_code import load_reward
from common.train.guard import UsageError

REWARDS = """
import math
from helper import SCALE     # a neighbour of this file: importable, as with `python FILE.py`

def short_answers(response, answer):
    return max(0.0, 1.0 - len(response) / SCALE)

def with_prompt(response, answer, prompt=None):   # extra arguments with defaults are fine
    return 1.0

def needs_three(response, answer, prompt):
    return 1.0

def keywords_only(*, response, answer):
    return 1.0

def as_text(response, answer):
    return "1.0"

def as_none(response, answer):
    return None

def as_nan(response, answer):
    return math.nan

def as_numpy(response, answer):
    import numpy
    return numpy.float32(0.5)

def as_tensor(response, answer):
    import torch
    return torch.tensor(True)

THRESHOLD = 0.5
"""


@pytest.fixture
def rewards_file(tmp_path):
    (tmp_path / "helper.py").write_text("SCALE = 8\n")
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path / "my_rewards.py"


def test_user_reward_is_called_per_sample(rewards_file):
    reward = load_reward(f"{rewards_file}:short_answers")
    assert reward("12", "3") == 0.75 and reward("123456789", "3") == 0.0
    assert load_reward(f"{rewards_file}:with_prompt")("a", "b") == 1.0
    # numbers of other types become floats
    assert load_reward(f"{rewards_file}:as_numpy")("a", "b") == 0.5
    assert load_reward(f"{rewards_file}:as_tensor")("a", "b") == 1.0
    assert isinstance(load_reward(f"{rewards_file}:as_tensor")("a", "b"), float)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("my_rewards.py", "--reward 'my_rewards.py' is not FILE.py:NAME; pass --reward FILE.py:NAME"),
        ("{file}:", "is not FILE.py:NAME"),
        ("{dir}/helper.txt:f", "helper.txt is not a .py file"),
        ("{dir}/absent.py:f", "no file {dir}/absent.py"),
        ("{file}:missing", "my_rewards.py defines no missing (its functions: as_nan, as_none, as_numpy, as_tensor, "),
        ("{file}:THRESHOLD", "THRESHOLD is a float, not a function"),
        (
            "{file}:needs_three",
            "needs_three(response, answer, prompt) cannot be called as needs_three(response, answer)",
        ),
        ("{file}:keywords_only", "cannot be called as keywords_only(response, answer)"),
        ("{dir}/broken.py:f", "importing {dir}/broken.py failed: SyntaxError: "),
        ("{dir}/raises.py:f", "importing {dir}/raises.py failed: ModuleNotFoundError: No module named 'not_installed'"),
    ],
    ids=[
        "no_name",
        "empty_name",
        "not_py",
        "no_file",
        "no_such_name",
        "not_callable",
        "arity",
        "kw_only",
        "syntax",
        "import",
    ],
)
def test_unusable_reward_refused(rewards_file, spec, message):
    folder = rewards_file.parent
    (folder / "broken.py").write_text("def f(response, answer)\n    return 1.0\n")
    (folder / "raises.py").write_text("import not_installed\n")
    (folder / "helper.txt").write_text("")
    with pytest.raises(UsageError) as e:
        load_reward(spec.format(file=rewards_file, dir=folder))
    assert message.format(dir=folder) in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, message",
    [
        ("as_text", "returned '1.0' (str) for the response 'x'; it must return a number (float)"),
        ("as_none", "returned None (NoneType) for the response 'x'; it must return a number (float)"),
        ("as_nan", "returned nan for the response 'x'"),
    ],
)
def test_reward_values_checked(rewards_file, name, message):
    reward = load_reward(f"{rewards_file}:{name}")  # loads: only its values are wrong
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reward("x", "1")
