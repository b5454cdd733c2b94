"""Validation (common/rollout/evaluate.py): pass@k and maj@k against hand computations, and a run over a
scripted engine (which responses, which metrics, eval/step_N.jsonl).

    .venv/bin/python -m pytest -q tests/test_evaluate.py
"""

import json
import types

import pytest

from common.rl.rewards import final_answer, math_reward
from common.rollout.evaluate import Evaluator, majority_correct, pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k: every draw of 4 holds the correct one


def test_majority_correct():
    assert majority_correct(["4", "5", "4"], [True, False, True])
    assert not majority_correct(["5", "4", "5"], [False, True, False])
    assert majority_correct(["4", "5"], [True, False])  # a tie: the first seen
    assert not majority_correct([None, None], [False, False])
    assert majority_correct([None, "7", None], [False, True, False])  # no answer does not vote


class ScriptedEngine:
    """generate() answers prompt p (a token list [p]) with the texts in `answers[p]`, in order."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed, logprob_samples=None):
        self.calls.append(dict(prompts=prompts, n=n, temperature=temperature, logprob_samples=logprob_samples))
        return [
            types.SimpleNamespace(
                prompt_ids=p,
                response_ids=list(self.answers[p[0]][j].encode()),
                finish_reason="length" if j == 0 else "stop",
            )
            for p in prompts
            for j in range(n)
        ]


class BytesTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


def test_evaluator_run(tmp_path):
    items = [
        {"prompt": "a", "answer": "#### 4"},
        {"prompt": "b", "answer": "#### 7"},
        {"prompt": "a", "answer": "#### 4"},
    ]
    engine = ScriptedEngine({0: ["4", "so 5", "\\boxed{4}"], 1: ["7", "8", "9"]})
    evaluator = Evaluator(
        BytesTokenizer(),
        items,
        [[0], [1], [0]],
        samples=3,
        temperature=0.6,
        max_tokens=8,
        every=5,
        last_step=11,
        reward_fn=math_reward,
        answer_fn=final_answer,
        out_dir=str(tmp_path),
        replica=0,
        num_replicas=1,
        first_of_replica=True,
        master_process=True,
    )
    assert [evaluator.due(s) for s in (0, 1, 5, 10, 11, 12)] == [True, False, True, True, True, False]
    metrics = evaluator.run(engine, 5)
    assert engine.calls == [dict(prompts=[[0], [1]], n=3, temperature=0.6, logprob_samples=0)]  # "a" once
    # prompt a: 2 of 3 right, majority "4" right; prompt b: 1 of 3, no majority (tie: "7" first) -> right
    assert metrics == {
        "eval_accuracy": pytest.approx(3 / 6),
        "eval_pass@3": 1.0,
        "eval_maj@3": 1.0,
        "eval_response_len": pytest.approx((1 + 4 + 9 + 1 + 1 + 1) / 6),
        "eval_truncated_frac": pytest.approx(2 / 6),
    }
    rows = [json.loads(line) for line in open(tmp_path / "eval" / "step_000005.jsonl")]
    assert [(r["prompt"], r["rewards"], r["answers"]) for r in rows] == [
        ("a", [1.0, 0.0, 1.0], ["4", "5", "4"]),
        ("b", [1.0, 0.0, 0.0], ["7", "8", "9"]),
    ]
