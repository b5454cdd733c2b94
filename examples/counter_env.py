# examples/counter_env.py:  python train_grpo.py --env examples/counter_env.py:Counter
import random

from common.env.base import Environment, Step
from common.env.tool_calls import parse_tool_calls, run_tool_calls

READ = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "the counter's value",
        "parameters": {"type": "object", "properties": {}},
    },
}


class Counter(Environment):
    tools = [READ]

    @staticmethod
    def make_items(num_items, seed=0):  # used without --data
        rng = random.Random(seed)
        return [
            {"prompt": "Count to the target by adding 1, 2 or 3.", "answer": str(rng.randint(5, 12))}
            for _ in range(num_items)
        ]

    def reset(self, item):
        self.value, self.target = 0, int(item["answer"])
        return [{"role": "user", "content": f"{item['prompt']} Target: {self.target}."}]

    def step(self, text):
        calls = parse_tool_calls(text)
        if calls:  # the model asked for the counter: answer with tool messages
            messages, counts = run_tool_calls(calls, {"read": lambda: str(self.value)})
            return Step(observation=messages, tool_calls=counts["tool_calls"], tool_errors=counts["tool_errors"])
        step = text.strip()[:1]
        if step not in ("1", "2", "3"):
            return Step(observation=[{"role": "user", "content": "say 1, 2 or 3"}])
        self.value += int(step)
        if self.value >= self.target:
            return Step(done=True, reward=1.0 if self.value == self.target else 0.0)
        return Step(observation=[{"role": "user", "content": f"now {self.value}"}])
