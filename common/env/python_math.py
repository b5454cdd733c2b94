"""The built-in Python interpreter for math (ReTool / ToRL style): the model may run code before
it answers, and its final answer is scored by the math reward.

    python train_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --data openai/gsm8k --data-config main --env python

The first prompt is the item's question with the tool `python` offered through the chat template's
`tools=` (Qwen2.5 / Qwen3 / Hermes render it in the system prompt and teach the call format). Each
turn:
  - with <tool_call> blocks (common/env/tool_calls.py): each call's `code` runs in the sandbox
    (common/env/sandbox.py: its own process, CPU time, memory and output limits; docs/sandbox.md),
    and its output (or the error: a malformed call, an unknown tool, a timeout) comes back as a
    tool message, cut at --tool-output-chars;
  - without: the turn is the final answer; the episode ends with math_reward(turn, item answer).
Every call of a turn shares the turn's --tool-timeout.
"""

import time

from common.env.base import Environment, Step
from common.env.tool_calls import ToolError, parse_tool_calls, run_tool_calls
from common.rl.rewards import math_reward

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code and return what it prints (stdout and stderr). Use print() to see values.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program to run"}},
            "required": ["code"],
        },
    },
}

INSTRUCTION = "Use the python tool to compute when it helps. Put the final answer in \\boxed{}."


class PythonMath(Environment):
    tools = [PYTHON_TOOL]

    @classmethod
    def check(cls):
        try:
            import common.env.sandbox  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--env python runs the model's code in common/env/sandbox.py, which fails to import: {e}")

    def reset(self, item):
        self.answer = str(item["answer"])
        messages = super().reset(item)
        messages[-1] = dict(messages[-1], content=f"{messages[-1]['content']}\n\n{INSTRUCTION}")
        return messages

    def python(self, code, deadline):
        """Run code in the sandbox: what it printed; a TimeoutError or ToolError (with what it printed)
        when it ran past the turn's time or failed."""
        from common.env.sandbox import run_python

        left = max(0.1, deadline - time.time())
        result = run_python(str(code), timeout_s=left, cpu_s=left, max_output_chars=self.tool_output_chars)
        said = f"{result.output}\n({result.error})" if result.output else f"({result.error})"
        if result.timed_out:
            raise TimeoutError(said)
        if result.error:
            raise ToolError(said)
        return result.output

    def step(self, text):
        calls = parse_tool_calls(text)
        if not calls:
            return Step(done=True, reward=math_reward(text, self.answer))
        deadline = time.time() + self.tool_timeout_s
        tools = {"python": lambda code: self.python(code, deadline)}
        # (the sandbox cuts the output at tool_output_chars itself, and says so)
        messages, counts = run_tool_calls(calls, tools, timeout_s=self.tool_timeout_s + 1, max_chars=None)
        return Step(observation=messages, **{k: v for k, v in counts.items() if k != "tool_s"})
