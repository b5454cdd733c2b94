"""A training run's task: the tokenizer, the prompts (--data's, or the embedded task's, or --env's
episodes), the held-out prompts of validation, and the reward; and the evaluator that validates on them.

    task = load_task(args, hf_dir, spec, user_reward, env_class)
    evaluator = make_evaluator(args, task, info, rollout_tp, user_reward)
"""

import functools
from dataclasses import dataclass, field


@dataclass
class Task:
    tokenizer: object
    pad_id: int  # the tokenizer's pad token, or its EOS
    items: list  # rows: {"prompt", "answer", ...}, or the environment's items with --env
    prompt_ids: list  # the token ids of each item's (first) prompt
    eval_items: list = field(default_factory=list)  # held-out rows of validation
    eval_prompt_ids: list = field(default_factory=list)
    reward_fn: object = None  # (response text, answer) -> float
    make_env: object = None  # --env: a new episode's environment
    codec: object = None  # --env: the chat template with the environment's tools


def load_task(args, hf_dir, spec, user_reward, env_class):
    """--data's prompts (--prompt-key --answer-key --data-config --data-split --raw-prompts --system-prompt
    --max-prompt-len), or the embedded task: repeat the digit ("7=" -> "7"), reward 1 when right; held-out
    prompts for validation (common/rollout/evaluate.py): --eval-data (--eval-split), or the embedded task's
    own; the reward: user_reward (--reward), else the math reward with --data, the synthetic one without.
    env_class (--env): episodes of the environment, on --data's items or its own (docs/agentic.md)."""
    from transformers import AutoTokenizer

    from common.rl.rewards import math_reward, synthetic_reward
    from common.run.data import env_prompts, task_prompts

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_format = dict(
        prompt_key=args.prompt_key,
        answer_key=args.answer_key,
        data_config=args.data_config,
        raw_prompts=args.raw_prompts,
        system_prompt=args.system_prompt,
        chat_template_kwargs=args.chat_template_kwargs,
        max_prompt_len=args.max_prompt_len,
        max_positions=spec.max_position_embeddings,
    )
    items, prompt_ids = task_prompts(tokenizer, args.data, data_split=args.data_split, seed=args.seed, **prompt_format)
    eval_items, eval_prompt_ids = (
        task_prompts(tokenizer, args.eval_data, flag="--eval-data", data_split=args.eval_split, **prompt_format)
        if args.eval_data or not args.data
        else ([], [])
    )
    reward_fn = user_reward or (math_reward if args.data else functools.partial(synthetic_reward, format_credit=0.0))
    make_env = codec = None
    if env_class is not None:
        data_items = items if args.data else None  # (else the environment's own)
        items, prompt_ids, make_env, codec = env_prompts(
            env_class, data_items, tokenizer, args, spec.max_position_embeddings
        )
        eval_items, eval_prompt_ids = [], []  # validation is of single-turn answers
    return Task(tokenizer, pad_id, items, prompt_ids, eval_items, eval_prompt_ids, reward_fn, make_env, codec)


def make_evaluator(args, task, info, rollout_tp, user_reward, *, folder="eval"):
    """Validation on the task's held-out prompts (common/rollout/evaluate.py): --eval-samples
    --eval-temperature --eval-every, --max-new-tokens, in <out>/<folder>/; with --eval-data the math reward
    (unless --reward) and answer. Each rollout replica samples its share."""
    from common.rl.rewards import final_answer, math_reward, synthetic_answer
    from common.rollout.evaluate import Evaluator

    return Evaluator(
        task.tokenizer,
        task.eval_items,
        task.eval_prompt_ids,
        samples=args.eval_samples,
        temperature=args.eval_temperature,
        max_tokens=args.max_new_tokens,
        every=args.eval_every,
        last_step=args.steps - 1,
        out_dir=args.out,
        seed=args.seed,
        reward_fn=math_reward if args.eval_data and not user_reward else task.reward_fn,
        answer_fn=final_answer if args.eval_data else synthetic_answer,
        replica=info.rank // rollout_tp,
        num_replicas=info.world_size // rollout_tp,
        first_of_replica=info.rank % rollout_tp == 0,
        master_process=info.master_process,
        folder=folder,
    )
