"""The environment interface: an episode starts from a dataset item, the environment answers each
assistant turn with an observation or ends the episode with a reward.

    env = MyEnv()                          # one instance per episode (it may keep the episode's state)
    messages = env.reset(item)             # the first prompt's chat messages (item: a dataset row, a dict)
    step = env.step(text)                  # the model's turn, decoded; Step(observation=[...]) or Step(done=True)

An observation is a list of chat messages ({"role": "tool" | "user", "content": str}) appended after the
model's turn; the chat template renders them (common/env/chat.py) and their tokens are masked out of
the loss. `step` may take time (it runs tools): the episode driver (common/rollout/episodes.py) calls it
in a worker thread, so other episodes keep generating, and turns a step that raises or outlives
--tool-timeout into an error observation.

Class attributes an environment may set:
    tools          JSON schemas of its tools (OpenAI function format), given to the chat template (`tools=`)
    make_items     a static/class method (num_items, seed) -> items, for runs without --data
and read: tool_timeout_s, tool_output_chars (the run's --tool-timeout, --tool-output-chars).
"""

from dataclasses import dataclass, field


@dataclass
class Step:
    """What an environment returns for one assistant turn.

    observation: chat messages to append (the episode goes on), or None with done=True.
    reward: the episode's reward, read when done (the environment reward of the step's metrics).
    The counters are this turn's tool use, summed into the step's metrics."""

    observation: list[dict] | None = None
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    info: dict = field(default_factory=dict)


class Environment:
    """Subclass and write reset and step (docs/agentic.md has a worked example)."""

    tools: list[dict] | None = None
    # the run's tool limits (--tool-timeout, --tool-output-chars), set on each episode's instance
    tool_timeout_s: float = 10.0
    tool_output_chars: int = 4096

    def reset(self, item: dict) -> list[dict]:
        """The first prompt's messages. Default: item["prompt"], a string (one user message) or a
        list of messages, as the datasets of --data give them."""
        prompt = item["prompt"]
        return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]

    def step(self, text: str) -> Step:
        """The model's turn `text` (decoded without special tokens) -> an observation or the end."""
        raise NotImplementedError

    @classmethod
    def check(cls):
        """Called once at start-up (--env): raise ValueError saying what the environment lacks."""


def error_step(message):
    """The observation that tells the model its turn could not be handled (a tool that raised or
    hung): the episode goes on and the model may read it and retry."""
    return Step(observation=[{"role": "user", "content": f"error: {message}"}], tool_errors=1)


def configured(cls, *, tool_timeout_s, tool_output_chars):
    """A factory of cls's episodes with the run's tool limits (--tool-timeout, --tool-output-chars)
    set on each instance, for the environments that run tools."""

    def make():
        env = cls()
        env.tool_timeout_s, env.tool_output_chars = tool_timeout_s, tool_output_chars
        return env

    return make
