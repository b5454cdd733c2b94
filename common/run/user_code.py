"""The one door for user code: a reward function (--reward FILE.py:NAME) or an environment of agentic
episodes (--env FILE.py:CLASS, or a built-in's name: load_env; docs/agentic.md) named on the command line.

    reward_fn = load_reward("my_rewards.py:short_answers")   # at start-up; UsageError (exit 2) if unusable
    reward = reward_fn(response, answer)                      # per sample, a float

NAME is called once per sample, as the built-in rule-based rewards are (common/rl/rewards.py,
math_reward):

    def NAME(response: str, answer: str) -> float

response: the sampled text, decoded without special tokens; answer: the prompt's reference
answer as a string (--data's answer field; the embedded task's digits). It replaces the
rule-based reward: reward = --rule-reward-weight x NAME(...) (+ --reward-model-weight x a
reward model's score, + DAPO's overlong penalty); validation counts a response correct when
NAME gives it >= 1.

Checked at start-up, on every rank alike: the file exists and imports, NAME is in it, is
callable and accepts (response, answer). It is not called then (it may be slow or reach out
to a sandbox or a service): each value it returns is checked instead, and one that is not a
finite number stops the run with a UsageError saying which.
"""

import importlib
import importlib.util
import inspect
import math
import os
import sys

from common.train.guard import UsageError


def load_user_function(spec, flag, arguments):
    """The callable FILE.py:NAME of `spec`, after checking that it accepts `arguments` (their
    names, passed positionally). The file's directory is put on sys.path first, as `python FILE.py`
    does, so that it can import its neighbours. UsageError naming `flag` when it cannot be used."""
    path, sep, name = spec.rpartition(":")
    example = f"{flag} FILE.py:NAME, e.g. {flag} my_rewards.py:short_answers"
    if not sep or not path or not name.isidentifier():
        raise UsageError(f"{flag} {spec!r} is not FILE.py:NAME; pass {example}")
    if not path.endswith(".py"):
        raise UsageError(f"{flag} {spec}: {path} is not a .py file; pass {example}")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {spec}: no file {os.path.abspath(path)}")
    path = os.path.abspath(path)
    module_name = f"user_{flag.strip('-').replace('-', '_')}_{os.path.basename(path)[:-3]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's own error, on one line: its type, message (and line, for a SyntaxError)
        raise UsageError(f"{flag} {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    sys.modules[module_name] = module  # (pickle and tracebacks find it)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UsageError(f"{flag} {spec}: {path} defines no {name} (its functions: {', '.join(defined) or 'none'})")
    fn = getattr(module, name)
    if not callable(fn):
        raise UsageError(f"{flag} {spec}: {name} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C extension without one: called as it is
        return fn
    try:
        signature.bind(*arguments)
    except TypeError as e:
        wanted = f"{name}({', '.join(arguments)})"
        raise UsageError(f"{flag} {spec}: {name}{signature} cannot be called as {wanted}: {e}") from None
    return fn


def load_reward(spec):
    """--reward FILE.py:NAME -> reward(response, answer) -> float, each value checked (module docstring)."""
    fn = load_user_function(spec, "--reward", ("response", "answer"))

    def reward(response, answer):
        value = fn(response, answer)
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise UsageError(
                f"--reward {spec} returned {value!r} ({type(value).__name__}) for the response {response[:80]!r}; "
                "it must return a number (float)"
            )
        if not math.isfinite(float(value)):
            raise UsageError(f"--reward {spec} returned {float(value)} for the response {response[:80]!r}")
        return float(value)

    return reward


# --env's built-in environments by name: (module, class)
BUILTIN_ENVS = {
    "game": ("common.env.game", "GuessGame"),
    "game-direction": ("common.env.game", "DirectionGame"),
    "python": ("common.env.python_math", "PythonMath"),
}


def load_env(spec):
    """--env NAME (built in) or FILE.py:CLASS -> the Environment class (common/env/base.py),
    constructed once per episode with no arguments. UsageError when it cannot be used."""
    from common.env.base import Environment

    if spec in BUILTIN_ENVS:
        module, name = BUILTIN_ENVS[spec]
        cls = getattr(importlib.import_module(module), name)
    elif ":" not in spec:
        raise UsageError(f"--env {spec!r}: the built-in environments are {', '.join(BUILTIN_ENVS)}; or FILE.py:CLASS")
    else:
        cls = load_user_function(spec, "--env", ())
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise UsageError(
                f"--env {spec}: {spec.rpartition(':')[2]} is not a subclass of common.env.base.Environment "
                "(docs/agentic.md shows one)"
            )
    try:
        cls.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cls
