"""Prompts: loading datasets, chat formatting, a resumable sampler, and the synthetic task.

  load_prompts(path, prompt_key=None, answer_key=None) -> [dict(prompt=..., answer=str)]
                        from .jsonl / .json / .parquet or a `datasets` save_to_disk directory
  apply_chat_template(tokenizer, prompt, system_prompt=None, template_kwargs=None) -> prompt token ids
  task_prompts(tokenizer, data, ...) -> (items, prompt token ids): what the training scripts
                        sample from (--data, or the synthetic task), too-long prompts dropped
  chat_format_warning(tokenizer, system_prompt) -> what is likely wrong with a chat format, or None
  PromptSampler         deterministic epoch-wise shuffling with state_dict() for resume
  SyntheticArithmetic   "3+4=" -> "7" with difficulty knobs: the task of the embedded default

The synthetic task is built for a model that starts from random weights and reads bytes
(common/run/embedded.py): prompts are a few characters, answers a few digits, and the reward
(common/rl/rewards.py: synthetic_reward) gives partial credit for answering with a number.
"""

import json
import os
import random

PROMPT_KEYS = ("prompt", "question", "problem", "query")
ANSWER_KEYS = ("answer", "solution", "ground_truth", "reward_model.ground_truth", "final_answer")


# -----------------------------------------------------------------------------
# Loading prompt datasets

SAVE_TO_DISK_FILES = ("dataset_dict.json", "state.json")  # what datasets' save_to_disk writes


def _read_rows(path, config=None, split="train", flags=("--data-config", "--data-split")):
    """All rows of a dataset file or directory as a list of dicts. A directory is a `datasets`
    save_to_disk directory, or a dataset repository's files (a hub snapshot, common/run/hub.py),
    read by datasets.load_dataset with its config (the repository's README names them) and split.
    flags: the command-line flags of config and split, for the messages."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt dataset {path!r} does not exist")
    if os.path.isdir(path):
        import datasets

        if any(os.path.isfile(os.path.join(path, name)) for name in SAVE_TO_DISK_FILES):
            ds = datasets.load_from_disk(path)
        else:
            try:  # datasets' own messages name the configs / splits there are
                ds = datasets.load_dataset(path, config, split=split)
            except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
                message = " ".join(str(e).split())[:300]
                raise ValueError(
                    f"cannot read it with datasets.load_dataset (config {config!r} "
                    f"({flags[0]}), split {split!r} ({flags[1]})): {message}"
                ) from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path!r} has no split {split!r} ({flags[1]}; splits: {sorted(ds)})")
            ds = ds[split]
        return ds.to_list()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if ext in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if ext == ".json" and text.lstrip().startswith("["):
            return json.loads(text)  # one JSON array of rows
        rows = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no} is not a JSON object: {e}") from None
        return rows
    raise ValueError(
        f"unknown prompt dataset format {path!r}: expected a .jsonl, .json or .parquet "
        "file, or a directory written by datasets' save_to_disk"
    )


def _get(row, key):
    """row[key], where key may be dotted for nested dicts: 'reward_model.ground_truth'."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _field_names(row, prefix=""):
    """Every (dotted) field name of a row, for error messages."""
    names = []
    for key, value in row.items():
        names.append(prefix + key)
        if isinstance(value, dict):
            names += _field_names(value, prefix + key + ".")
    return names


def _pick_key(row, key, candidates, what, flag):
    if key is not None:
        if _get(row, key) is None:
            raise ValueError(f"{flag} {key!r}: no such field (fields: {_field_names(row)})")
        return key
    for candidate in candidates:
        if _get(row, candidate) is not None:
            return candidate
    raise ValueError(
        f"no {what} field found: looked for {list(candidates)}, the dataset has "
        f"{_field_names(row)}; choose one with {flag}"
    )


def load_prompts(path, prompt_key=None, answer_key=None, config=None, split="train", flags=None):
    """Rows of a prompt dataset as [dict(prompt=..., answer=str)] (config, split: of a dataset
    directory, see _read_rows; flags: their command-line flags, for the messages).

    The prompt is a string, or a list of chat messages ({"role", "content"}) kept as is for
    apply_chat_template. The answer is the raw reference (a GSM8K solution with '#### 42'
    stays whole: the reward extracts the final answer). Keys may be dotted for nested
    fields, e.g. answer_key='reward_model.ground_truth'; without them the first field found
    of PROMPT_KEYS / ANSWER_KEYS is used; answer_key "none": no answers (each is "").
    """
    rows = _read_rows(path, config, split, *([flags] if flags else []))
    if not rows:
        raise ValueError(f"prompt dataset {path!r} is empty")
    if not isinstance(rows[0], dict):
        raise ValueError(f"rows of {path!r} must be JSON objects / records, got {type(rows[0]).__name__}")
    prompt_key = _pick_key(rows[0], prompt_key, PROMPT_KEYS, "prompt", "--prompt-key")
    no_answers = answer_key == "none"  # prompts alone: a reward without references (distillation, a reward model)
    answer_key = None if no_answers else _pick_key(rows[0], answer_key, ANSWER_KEYS, "answer", "--answer-key")

    items = []
    for i, row in enumerate(rows):
        prompt, answer = _get(row, prompt_key), "" if no_answers else _get(row, answer_key)
        if prompt is None or answer is None:
            missing = prompt_key if prompt is None else answer_key
            raise ValueError(f"row {i} of {path!r} has no field {missing!r}")
        if isinstance(prompt, list):
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                raise ValueError(f"row {i} of {path!r}: a list prompt must be chat messages with 'role' and 'content'")
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            prompt = str(prompt)
        if isinstance(answer, list) and len(answer) == 1:
            answer = answer[0]  # some datasets store the reference as a one-element list
        items.append(dict(prompt=prompt, answer=str(answer)))
    return items


# -----------------------------------------------------------------------------
# Chat formatting


def apply_chat_template(tokenizer, prompt, system_prompt=None, template_kwargs=None):
    """Token ids of one prompt, ready for generation (ends with the assistant turn header).

    prompt is a string (one user message) or a list of chat messages. template_kwargs: more
    variables for the template (--chat-template-kwargs, e.g. Qwen3's enable_thinking=False).
    Without a chat template the text is encoded as is (the tokenizer's BOS, if any, is added).
    """
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        # Render to text, then encode: the template already holds every special token, so
        # no BOS may be added a second time.
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=True))


def task_prompts(
    tokenizer,
    data,
    *,
    flag="--data",
    prompt_key=None,
    answer_key=None,
    data_config=None,
    data_split=None,
    raw_prompts=False,
    system_prompt=None,
    chat_template_kwargs=None,
    max_prompt_len,
    max_positions,
    seed=0,
):
    """(items, prompt token ids) of a training run: the rows of data, the dataset of `flag`
    (--data, or --eval-data: the messages name it and its split flag; data_split None: train,
    or test for --eval-data), chat-formatted unless raw_prompts (with the template's variables
    chat_template_kwargs, --chat-template-kwargs), or without data the embedded
    task (repeat the digit: "7=" -> "7"; not a chat). Prompts longer than max_prompt_len, or
    leaving no room for one new token within the model's max_positions, are dropped; a
    dataset with none left is a UsageError. A chat format that is likely not what was meant
    is printed once (chat_format_warning)."""
    from common.run.dist import print0
    from common.train.guard import UsageError

    if data:
        split_flag, default_split = ("--data-split", "train") if flag == "--data" else ("--eval-split", "test")
        try:
            items = load_prompts(
                data,
                prompt_key,
                answer_key,
                config=data_config,
                split=data_split or default_split,
                flags=("--data-config", split_flag),
            )
        except ValueError as e:
            raise UsageError(f"{flag} {data}: {e}") from None
    else:
        items = synthetic_prompts(num_items=1000, seed=seed, num_terms=1)
    if raw_prompts or not data:
        prompt_ids = [tokenizer.encode(it["prompt"], add_special_tokens=False) for it in items]
    else:
        warning = chat_format_warning(tokenizer, system_prompt)
        if warning and warning not in _WARNINGS_PRINTED:  # (the prompts of --data and --eval-data: once)
            _WARNINGS_PRINTED.add(warning)
            print0(f"warning: {warning}")
        prompt_ids = [apply_chat_template(tokenizer, it["prompt"], system_prompt, chat_template_kwargs) for it in items]
    if any(len(ids) == 0 for ids in prompt_ids):
        empty = next(i for i, ids in enumerate(prompt_ids) if not ids)
        raise UsageError(f"{flag} {data}: a prompt encodes to no tokens (row {empty})")
    limit = min(max_prompt_len, max_positions - 1)
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) <= limit]
    if not keep:
        raise UsageError(
            f"every prompt of {f'{flag} {data}' if data else 'the task'} is longer than {limit} tokens "
            f"(--max-prompt-len {max_prompt_len}, model positions {max_positions}); the shortest has "
            f"{min(map(len, prompt_ids))}: raise --max-prompt-len"
        )
    if len(keep) < len(items):
        print0(
            f"dropped {len(items) - len(keep)} of {len(items)} prompts of {f'{flag} {data}' if data else 'the task'} "
            f"longer than {limit} tokens (--max-prompt-len)"
        )
    return [items[i] for i in keep], [prompt_ids[i] for i in keep]


# Tokens that only chat formats use (ChatML: Qwen and others; Llama 3; Mistral; Gemma; Phi-3 and
# Zephyr; DeepSeek-V3): a tokenizer that has one most likely belongs to a chat model (Llama 3's base
# models have its tokens too: --raw-prompts there says plain text is meant).
CHAT_TOKENS = ("<|im_start|>", "<|start_header_id|>", "[INST]", "<start_of_turn>", "<|user|>", "<｜User｜>")
_WARNINGS_PRINTED = set()


def chat_format_warning(tokenizer, system_prompt=None):
    """What is likely wrong when chat-formatted prompts (no --raw-prompts) meet a tokenizer
    without a chat template, where apply_chat_template falls back to plain text; None when
    nothing is. A tokenizer with chat tokens belongs to a chat model whose template is missing
    from the model directory; without them (a base model) only a --system-prompt is worth a
    word: it becomes plain text before each prompt."""
    if getattr(tokenizer, "chat_template", None):
        return None
    vocab = tokenizer.get_vocab()
    chat_tokens = [token for token in CHAT_TOKENS if token in vocab]
    if chat_tokens:
        return (
            f"the tokenizer has chat tokens ({', '.join(chat_tokens)}) but no chat template, so the prompts go "
            "in as plain text, which a chat model answers poorly. Add the model's chat template to its "
            "directory (chat_template.jinja, or chat_template in tokenizer_config.json), or pass --raw-prompts "
            "if plain text is meant"
        )
    if system_prompt is not None:
        return (
            "the tokenizer has no chat template (a base model?): --system-prompt is put before each prompt as "
            "plain text, followed by a blank line"
        )
    return None


# -----------------------------------------------------------------------------
# Prompt sampler


class PromptSampler:
    """Batches of dataset indices: each epoch is a fresh permutation, fixed by (seed, epoch).

    A batch that runs past the end of an epoch continues into the next one, so every batch
    has batch_size indices and every item is seen once per epoch. state_dict() is the
    (epoch, position) reached: a sampler restored from it yields the same batches as the
    original would have.
    """

    def __init__(self, num_items, batch_size, seed=0):
        if num_items < 1 or batch_size < 1:
            raise ValueError(f"need num_items >= 1 and batch_size >= 1, got {num_items}, {batch_size}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch):
        order = list(range(self.num_items))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self):
        batch = []
        while len(batch) < self.batch_size:
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(batch), self.num_items - self.position)
            batch += self._order[self.position : self.position + take]
            self.position += take
        return batch

    def state_dict(self):
        return dict(epoch=self.epoch, position=self.position, seed=self.seed, num_items=self.num_items)

    def load_state_dict(self, state):
        if state["num_items"] != self.num_items or state["seed"] != self.seed:
            from common.train.guard import UsageError

            raise UsageError(
                f"--resume: the checkpoint's place in the data is for {state['num_items']} prompts with --seed "
                f"{state['seed']}, this run has {self.num_items} prompts with --seed {self.seed}: the dataset (or "
                "what --max-prompt-len keeps of it) or --seed changed since. Resume with the data and --seed the "
                "run started with, or begin a new run on this data with --start-over (or another --out)"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


# -----------------------------------------------------------------------------
# The synthetic task of the embedded default


def _evaluate(terms, ops):
    """terms[0] ops[0] terms[1] ... with '*' binding tighter than '+' and '-'."""
    total, sign, product = 0, 1, terms[0]  # the sum so far, and the product being built
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            product *= term
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), term
    return total + sign * product


class SyntheticArithmetic:
    """Integer arithmetic prompts 'a+b=' with the answer as digits, deterministic by seed.

    Difficulty knobs:
      min_operand, max_operand  range of each operand (inclusive)
      num_terms                 operands per expression; 1 is the copy task '7=' -> '7'
      ops                       operators drawn from '+', '-', '*' (uniformly per gap);
                                evaluated with the usual precedence
      nonnegative               redraw expressions whose value is negative
    The easiest useful setting for a random-init byte model is one or two small terms:
    answers are one or two digits, and a policy that answers with any small number already
    hits the right one 1/10 to 1/20 of the time, which is the signal GRPO climbs from.
    """

    def __init__(self, seed=0, min_operand=0, max_operand=9, num_terms=2, ops=("+",), nonnegative=True):
        if num_terms < 1 or min_operand > max_operand or not ops or set(ops) - {"+", "-", "*"}:
            raise ValueError(
                f"bad SyntheticArithmetic knobs: num_terms={num_terms}, "
                f"operands [{min_operand}, {max_operand}], ops={ops!r}"
            )
        if nonnegative and min_operand < 0:
            raise ValueError("nonnegative=True needs min_operand >= 0")
        self.rng = random.Random(seed)
        self.min_operand, self.max_operand = min_operand, max_operand
        self.num_terms, self.ops, self.nonnegative = num_terms, tuple(ops), nonnegative

    def sample(self):
        for _ in range(10_000):
            terms = [self.rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_terms)]
            ops = [self.rng.choice(self.ops) for _ in range(self.num_terms - 1)]
            value = _evaluate(terms, ops)
            expr = str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:]))
            if value >= 0 or not self.nonnegative:
                return dict(prompt=expr + "=", answer=str(value))
        raise ValueError("SyntheticArithmetic: no nonnegative expression found with these knobs")

    def make(self, num_items):
        return [self.sample() for _ in range(num_items)]


def synthetic_prompts(num_items=1000, seed=0, **difficulty):
    """The train set of the embedded default: num_items SyntheticArithmetic items."""
    return SyntheticArithmetic(seed, **difficulty).make(num_items)


def env_prompts(env_class, items, tokenizer, args, max_positions):
    """--env's (items, first prompt ids, make_env, codec): `items` (--data's rows), or without them
    the environment's own (its make_items, seeded by --seed); make_env() a new episode's environment
    with the run's tool limits (--tool-timeout, --tool-output-chars); codec the chat template with the
    environment's tools (common/env/chat.py). --max-episode-tokens defaults to the model's positions
    (max_positions; set in args). The codec renders with --chat-template-kwargs' variables. Items
    whose first prompt leaves no room for a turn within it are dropped; none left, or no items at
    all, is a UsageError."""
    from common.env.base import configured
    from common.env.chat import ChatCodec
    from common.run.dist import print0
    from common.train.guard import UsageError

    args.max_episode_tokens = max_episode_tokens = args.max_episode_tokens or max_positions
    if items is None:
        if not hasattr(env_class, "make_items"):
            raise UsageError(f"--env {env_class.__name__} makes no items of its own (no make_items): pass --data")
        items = env_class.make_items(1000, args.seed)
    make_env = configured(env_class, tool_timeout_s=args.tool_timeout, tool_output_chars=args.tool_output_chars)
    try:
        codec = ChatCodec(tokenizer, tools=env_class.tools, template_kwargs=args.chat_template_kwargs)
        prompt_ids = [codec.prompt_ids(make_env().reset(item)) for item in items]
    except (ValueError, KeyError) as e:
        raise UsageError(f"--env {env_class.__name__}: {type(e).__name__}: {e}") from None
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) < max_episode_tokens]
    if not keep:
        raise UsageError(
            f"--env: every first prompt fills --max-episode-tokens {max_episode_tokens} (the shortest has "
            f"{min(map(len, prompt_ids))} tokens): raise it"
        )
    if len(keep) < len(items):
        print0(f"--env: dropped {len(items) - len(keep)} of {len(items)} items whose first prompt leaves no room")
    return [items[i] for i in keep], [prompt_ids[i] for i in keep], make_env, codec
