"""Validation between steps: the held-out set through the same colocated rollout engine.

    evaluator = Evaluator(tokenizer, items, prompt_ids, samples=4, temperature=0.6, every=10, ...)
    if evaluator.due(step):          # step 0 (before any update), every `every` steps, the last step
        metrics.update(evaluator.run(engine, step))   # all ranks; rank 0 writes eval/step_N.jsonl

    evaluate_once(engine, evaluator, weights, step, source=...)   # train_grpo.py --eval-only

Each prompt gets `samples` responses; a response is correct when the reward function gives
it 1 (math_reward / the embedded task's reward: 1 = right answer). Metrics (own keys in
metrics.jsonl, wandb, curves.png):
  eval_accuracy        mean correctness over all responses (= pass@1, estimated from k samples)
  eval_pass@k          unbiased pass@k (Chen et al. 2021, the HumanEval paper) with k = samples
  eval_maj@k           the share of prompts whose most frequent final answer is right
  eval_response_len    mean response tokens; eval_truncated_frac: share cut by max_tokens
"""

import json
import math
import os
from collections import Counter

import torch

from common.rl import batch as B


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers, correct):
    """Whether the most frequent extracted answer (None: no answer; ties: the first seen) is a
    correct one. answers, correct: one entry per response of a prompt."""
    counted = Counter(a for a in answers if a is not None)
    if not counted:
        return False
    top = max(counted, key=lambda a: (counted[a], -answers.index(a)))
    return any(ok for a, ok in zip(answers, correct) if a == top)


class Evaluator:
    """The held-out prompts and how to sample them; the same on every rank."""

    def __init__(
        self,
        tokenizer,
        items,
        prompt_ids,
        *,
        samples,
        temperature,
        max_tokens,
        every,
        last_step,
        reward_fn,
        answer_fn,
        out_dir,
        replica,
        num_replicas,
        first_of_replica,
        master_process,
        seed=0,
        folder="eval",
    ):
        """items, prompt_ids: as common.run.data.task_prompts returns them (repeated prompts are
        evaluated once). replica/num_replicas: this rank's rollout replica (prompts are split
        over replicas as in training); first_of_replica: the rank whose samples count.
        folder: out_dir's subdirectory of the per-prompt files (eval/step_N.jsonl)."""
        unique = {}
        for item, ids in zip(items, prompt_ids):
            unique.setdefault(tuple(ids), item)
        self.items, self.prompt_ids = list(unique.values()), [list(ids) for ids in unique]
        self.where = dict(
            replica=replica, num_replicas=num_replicas, first_of_replica=first_of_replica, master_process=master_process
        )
        self.samples, self.temperature, self.max_tokens = samples, temperature, max_tokens
        self.every, self.last_step, self.seed = every, last_step, seed
        self.reward_fn, self.answer_fn, self.tokenizer = reward_fn, answer_fn, tokenizer
        self.out_dir = os.path.join(out_dir, folder)

    def due(self, step):
        return bool(self.items) and self.every > 0 and (step % self.every == 0 or step == self.last_step)

    @torch.no_grad()
    def run(self, engine, step):
        """Generate, score, summarise. All ranks call this (the samples are all-gathered)."""
        replica, num_replicas, first_of_replica, master_process = self.where.values()
        mine = list(range(len(self.items)))[replica::num_replicas]
        local = engine.generate(
            [self.prompt_ids[i] for i in mine],
            n=self.samples,
            temperature=self.temperature,
            top_p=1.0,
            max_tokens=self.max_tokens,
            seed=self.seed * 7919 + step,
            logprob_samples=0,
        )
        samples = B.gather_samples(local if first_of_replica else [])
        order = [i for r in range(num_replicas) for i in list(range(len(self.items)))[r::num_replicas]]
        rows, correct_all = [], []
        for position, index in enumerate(order):
            group = samples[position * self.samples : (position + 1) * self.samples]
            texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in group]
            rewards = [float(self.reward_fn(text, self.items[index]["answer"])) for text in texts]
            correct = [r >= 1.0 for r in rewards]
            answers = [self.answer_fn(text) for text in texts]
            correct_all += correct
            rows.append(
                {
                    "index": index,
                    "prompt": self.items[index]["prompt"],
                    "answer": self.items[index]["answer"],
                    "responses": texts,
                    "rewards": rewards,
                    "answers": answers,
                    "pass": pass_at_k(len(group), sum(correct), len(group)),
                    "maj": majority_correct(answers, correct),
                }
            )
        if master_process:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"step_{step:06d}.jsonl"), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        k = self.samples
        return {
            "eval_accuracy": sum(correct_all) / len(correct_all),
            f"eval_pass@{k}": sum(row["pass"] for row in rows) / len(rows),
            f"eval_maj@{k}": sum(row["maj"] for row in rows) / len(rows),
            "eval_response_len": sum(len(s.response_ids) for s in samples) / len(samples),
            "eval_truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        }


def evaluate_once(engine, evaluator, weights, step, *, source, master_process):
    """train_grpo.py --eval-only: `weights` ((hf_name, tensor) pairs, as the weight sync's) into
    the engine, then the validation a training run does at `step`, once. All ranks call this.
    Rank 0 appends {"step", "weights": source, **metrics} to metrics.jsonl beside the
    per-prompt files (the evaluator's folder). Returns the metrics."""
    engine.wake_weights()
    engine.update_weights(weights)
    engine.wake_kv_cache()
    metrics = evaluator.run(engine, step)
    if master_process:
        with open(os.path.join(evaluator.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "weights": source, **metrics}) + "\n")
    return metrics
