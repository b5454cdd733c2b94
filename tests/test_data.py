"""Prompt loading, chat formatting, the resumable sampler and the synthetic task (common/run/data.py).

Run: .venv/bin/python -m pytest tests/test_data.py -q
"""

import json

import pytest

from common.run.data import (
    PromptSampler,
    SyntheticArithmetic,
    apply_chat_template,
    chat_format_warning,
    load_prompts,
    synthetic_prompts,
    task_prompts,
)

GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
        "answer": "In May she sold 48/2 = 24.\nIn total 48+24 = 72.\n#### 72",
    },
    {"question": "What is 1,000 + 1?", "answer": "#### 1,001"},
]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


# -----------------------------------------------------------------------------
# load_prompts


def test_jsonl_gsm8k_fields(tmp_path):
    items = load_prompts(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert items == [dict(prompt=r["question"], answer=r["answer"]) for r in GSM8K_ROWS]


def test_parquet_math_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?", "solution": "It is $\\boxed{1}$.", "level": 1},
        {"problem": "Compute $2^3$.", "solution": "$\\boxed{8}$", "level": 2},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet")
    items = load_prompts(str(tmp_path / "math.parquet"))
    assert items == [dict(prompt=r["problem"], answer=r["solution"]) for r in rows]


def test_datasets_dir_and_nested_chat_fields(tmp_path):
    import datasets

    # verl-style rows: chat-message prompts, the reference nested under reward_model.
    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            "reward_model": {"ground_truth": "4", "style": "rule"},
            "data_source": "toy",
        },
        {
            "prompt": [{"role": "user", "content": "3*3?"}],
            "reward_model": {"ground_truth": "9", "style": "rule"},
            "data_source": "toy",
        },
    ]
    expected = [dict(prompt=rows[0]["prompt"], answer="4"), dict(prompt=rows[1]["prompt"], answer="9")]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    assert load_prompts(str(tmp_path / "plain")) == expected
    # A DatasetDict: the train split is used.
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(tmp_path / "dict"))
    assert load_prompts(str(tmp_path / "dict"), prompt_key="prompt", answer_key="reward_model.ground_truth") == expected
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match=r"no split 'train' \(--data-split; splits: \['test'\]\)"):
        load_prompts(str(tmp_path / "no_train"))
    assert load_prompts(str(tmp_path / "no_train"), split="test") == expected  # --data-split test


def test_explicit_keys_and_non_string_answers(tmp_path):
    rows = [{"input": "1+1=", "target": 2, "question": "ignored"}, {"input": "2+2=", "target": 4, "question": "x"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert load_prompts(path, prompt_key="input", answer_key="target") == [
        dict(prompt="1+1=", answer="2"),
        dict(prompt="2+2=", answer="4"),
    ]
    # A .json file holding one array works too.
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert load_prompts(str(tmp_path / "d.json"), prompt_key="input", answer_key="target")[1]["answer"] == "4"


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("prompt,answer\n1+1,2\n")
    with pytest.raises(ValueError, match=r"\.jsonl.*\.parquet"):
        load_prompts(str(tmp_path / "data.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_prompts(str(tmp_path / "empty.jsonl"))
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "1+1", "label": "2"}])
    with pytest.raises(ValueError, match=r"no prompt field.*'text'.*'label'.*--prompt-key"):
        load_prompts(path)
    with pytest.raises(ValueError, match=r"no answer field.*--answer-key"):
        load_prompts(path, prompt_key="text")
    with pytest.raises(ValueError, match=r"--answer-key 'nope'"):
        load_prompts(path, prompt_key="text", answer_key="nope")
    path = write_jsonl(tmp_path / "hole.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match="row 1"):
        load_prompts(path)
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(ValueError, match="cannot read it with datasets.load_dataset"):  # nothing in it
        load_prompts(str(tmp_path / "not_a_dataset"))


# -----------------------------------------------------------------------------
# apply_chat_template (on the embedded byte tokenizer: token id == byte, so the expected
# ids can be written by hand)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from common.run.embedded import write_embedded_model

    return AutoTokenizer.from_pretrained(write_embedded_model(str(tmp_path_factory.mktemp("emb") / "m")))


def test_apply_chat_template(tokenizer):
    START, END = 257, 258
    user = [START, *b"user\n3+4=", END, *b"\n"]
    assistant = [START, *b"assistant\n"]
    assert apply_chat_template(tokenizer, "3+4=") == user + assistant
    system = [START, *b"system\nAdd.", END, *b"\n"]
    assert apply_chat_template(tokenizer, "3+4=", system_prompt="Add.") == system + user + assistant
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    assert apply_chat_template(tokenizer, messages) == system + user + assistant
    # A system message in the data wins over --system-prompt (no second system turn).
    assert apply_chat_template(tokenizer, messages, system_prompt="Other.") == system + user + assistant


def test_apply_chat_template_without_template(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    assert apply_chat_template(tokenizer, "3+4=") == list(b"3+4=")


def test_chat_format_warning(tokenizer):
    """Chat prompts meeting a tokenizer without a chat template: a chat model's (it has chat
    tokens) is warned of with the fixes; a base model's only with a --system-prompt, which then
    becomes plain text."""
    from types import SimpleNamespace

    assert chat_format_warning(tokenizer) is None and chat_format_warning(tokenizer, "Be brief.") is None
    no_template = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    no_template.chat_template = None
    warning = chat_format_warning(no_template)
    assert "chat tokens (<|im_start|>) but no chat template" in warning and "--raw-prompts" in warning
    base = SimpleNamespace(chat_template=None, get_vocab=lambda: {"a": 0, "<|endoftext|>": 1})
    assert chat_format_warning(base) is None
    assert "--system-prompt is put before each prompt as plain text" in chat_format_warning(base, "Be brief.")


def test_task_prompts_name_the_flag_given(tokenizer, tmp_path):
    """The messages about --eval-data's dataset name --eval-data and --eval-split (its split
    defaults to test), not --data's flags."""
    import datasets

    from common.train.guard import UsageError

    rows = [{"question": "1+1", "answer": "2"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    common = dict(max_prompt_len=64, max_positions=256)
    with pytest.raises(UsageError, match=r"^--eval-data .*dict: .*no split 'test' \(--eval-split; splits"):
        task_prompts(tokenizer, str(tmp_path / "dict"), flag="--eval-data", **common)
    items, _ = task_prompts(tokenizer, str(tmp_path / "dict"), flag="--eval-data", data_split="train", **common)
    assert items == [dict(prompt="1+1", answer="2")]
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "1+1", "label": "2"}])
    with pytest.raises(UsageError, match=r"^--eval-data .*odd\.jsonl: no prompt field"):
        task_prompts(tokenizer, odd, flag="--eval-data", **common)
    with pytest.raises(UsageError, match=r"^--data .*dict: .*no split 'validation' \(--data-split"):
        task_prompts(tokenizer, str(tmp_path / "dict"), data_split="validation", **common)


# -----------------------------------------------------------------------------
# PromptSampler


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_are_permutations():
    sampler = PromptSampler(num_items=10, batch_size=4, seed=3)
    flat = sum(take(sampler, 5), [])  # 20 indices = exactly 2 epochs
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new shuffle each epoch
    assert flat[:10] != list(range(10))
    assert sum(take(PromptSampler(10, 4, seed=3), 5), []) == flat  # deterministic
    assert sum(take(PromptSampler(10, 4, seed=4), 5), []) != flat
    # A batch larger than the dataset spans epochs.
    assert sorted(PromptSampler(3, 7, seed=0).next_batch()[:3]) == [0, 1, 2]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_sampler_resume_gives_the_same_batches(stop_after):
    reference = take(PromptSampler(num_items=11, batch_size=4, seed=7), 12)
    first = PromptSampler(num_items=11, batch_size=4, seed=7)
    assert take(first, stop_after) == reference[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = PromptSampler(num_items=11, batch_size=4, seed=7)
    resumed.load_state_dict(state)
    assert take(resumed, 12 - stop_after) == reference[stop_after:]


def test_sampler_refuses_a_changed_dataset():
    state = PromptSampler(10, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="dataset"):
        PromptSampler(11, 2, seed=0).load_state_dict(state)


# -----------------------------------------------------------------------------
# The synthetic task


def test_synthetic_default_items():
    items = synthetic_prompts(2000, seed=0)
    assert items == synthetic_prompts(2000, seed=0)  # deterministic by seed
    assert items != synthetic_prompts(2000, seed=1)
    for item in items:
        a, b = item["prompt"][:-1].split("+")
        assert item["prompt"].endswith("=") and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert item["answer"] == str(int(a) + int(b))
    assert len({item["prompt"] for item in items}) == 100  # all 10x10 sums occur


def test_synthetic_knobs_match_python_arithmetic():
    task = SyntheticArithmetic(seed=5, min_operand=2, max_operand=30, num_terms=4, ops=("+", "-", "*"))
    for item in task.make(300):
        expr = item["prompt"][:-1]
        assert item["answer"] == str(eval(expr))  # ground truth: Python's own precedence
        assert int(item["answer"]) >= 0  # nonnegative
        assert all(2 <= int(t) <= 30 for t in expr.replace("-", "+").replace("*", "+").split("+"))
    negative = SyntheticArithmetic(seed=5, num_terms=2, ops=("-",), nonnegative=False).make(300)
    assert any(item["answer"].startswith("-") for item in negative)
    assert all(item["answer"] == str(eval(item["prompt"][:-1])) for item in negative)
    copy = SyntheticArithmetic(seed=0, num_terms=1).make(20)  # the copy task
    assert all(item["prompt"] == item["answer"] + "=" for item in copy)
    with pytest.raises(ValueError):
        SyntheticArithmetic(ops=("/",))
    with pytest.raises(ValueError, match="nonnegative"):  # 5-5-5 < 0 always: no endless loop
        SyntheticArithmetic(min_operand=5, max_operand=5, num_terms=3, ops=("-",)).sample()
