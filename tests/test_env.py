"""Environments (common/env): tool-call parsing, running tools with limits, observations as the chat
templates render them, the built-in game and the python environment, --env loading.

    .venv/bin/python -m pytest -x -q tests/test_env.py
"""

import time

import pytest

from common.env.base import Environment, Step, configured
from common.env.chat import ChatCodec
from common.env.game import DirectionGame, GuessGame
from common.env.tool_calls import parse_tool_calls, run_tool_calls, truncate
from tests.chat_templates import END_OF_TURN, TEMPLATES, template_tokenizer


def test_tool_calls_parsed_in_the_hermes_format():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'  # arguments as a JSON string
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("python", {"code": "print(1)"}, None),
        ("search", {"q": "x"}, None),
    ]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    "body, error",
    [
        ('{"name": "python", "arguments": {"code": ', "not valid JSON"),  # cut off inside the call (unclosed)
        ("[1, 2]", 'a tool call is a JSON object {"name"'),
        ('{"arguments": {}}', 'a tool call is a JSON object {"name"'),
        ('{"name": "python", "arguments": [1]}', 'the "arguments" of python must be a JSON object'),
    ],
)
def test_malformed_tool_calls_become_errors_the_model_reads(body, error):
    calls = parse_tool_calls(f"<tool_call>{body}</tool_call>" if 'code": ' not in body else f"<tool_call>{body}")
    assert len(calls) == 1 and error in calls[0].error
    messages, counts = run_tool_calls(calls, {"python": lambda code: code})
    assert messages == [{"role": "tool", "content": f"error: {calls[0].error}"}]
    assert counts["tool_calls"] == 1 and counts["tool_errors"] == 1 and counts["tool_timeouts"] == 0


def test_hanging_crashing_and_unknown_tools_answer_with_errors_within_the_timeout():
    def hang(**_):
        time.sleep(60)

    def crash(**_):
        raise ZeroDivisionError("division by zero")

    tools = {"hang": hang, "crash": crash, "echo": lambda text: text * 3}
    calls = parse_tool_calls(
        "".join(
            f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
            for name, args in [("hang", "{}"), ("crash", "{}"), ("nope", "{}"), ("echo", '{"text": "ab"}')]
        )
    )
    start = time.time()
    messages, counts = run_tool_calls(calls, tools, timeout_s=0.5, max_chars=4)
    assert time.time() - start < 3
    assert [m["content"] for m in messages] == [
        truncate("error: timed out after 0.5 s", 4),
        truncate("error: ZeroDivisionError: division by zero", 4),
        truncate("error: unknown tool 'nope'; the tools are: crash, echo, hang", 4),
        "abab\n... (2 more characters cut)",
    ]
    assert counts["tool_calls"] == 4 and counts["tool_errors"] == 3 and counts["tool_timeouts"] == 1


# the text each template puts between the model's end-of-turn token and its next turn, by hand
OBSERVATIONS = {
    "qwen2.5": "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
    + "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "smollm": "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_observation_is_the_templates_continuation_after_the_models_stop_token(name):
    tokenizer = template_tokenizer(name)
    codec = ChatCodec(tokenizer)
    stop_id = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    tool = [{"role": "tool", "content": "42"}]
    ids = codec.observation_ids(tool, stop_id)
    assert tokenizer.decode(ids) == OBSERVATIONS[name]
    # the turn separator after the end-of-turn token is kept (verl#6921 lost it): ChatML's "\n"
    assert ids[0] != stop_id
    # a turn cut by a budget (no stop token sampled): the template's end of turn opens the observation
    cut = codec.observation_ids(tool, None)
    assert cut == [stop_id] + ids


@pytest.mark.parametrize("name", TEMPLATES)
def test_turn_text_is_the_tokenizers_decode_without_special_tokens(name):
    tokenizer = template_tokenizer(name)
    codec = ChatCodec(tokenizer)
    ids = codec.encode("I <tool_call>x = 1</tool_call> said: caf\u00e9  \n ok") + [
        tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    ]
    text = codec.turn_text(ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True) and END_OF_TURN[name] not in text
    assert codec.turn_text(tuple(ids)) == text  # (not a list: the public decode)


@pytest.mark.parametrize("name", TEMPLATES)
def test_encode_gives_the_tokenizers_own_ids(name):
    """ChatCodec.encode = tokenizer.encode(text, add_special_tokens=False): through the backend where the tokenizer
    and its state allow (the embedded tokenizer is a plain fast one), else through transformers."""
    tokenizer = template_tokenizer(name)
    codec = ChatCodec(tokenizer)
    assert codec._backend is tokenizer._tokenizer
    texts = [
        OBSERVATIONS[name],
        "I <tool_call>x = 1</tool_call> said: caf\u00e9  \n ok",
        "",
        " <|im_start|>x<|eot_id|>",
    ]
    for text in texts + ["\u4e2d\u6587 \t\n\n \U0001f642" * 3]:
        assert codec.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    # a backend left truncating (as transformers' encode would not use it): transformers' encode, all the ids
    tokenizer._tokenizer.enable_truncation(3)
    ids = codec.encode(texts[1])
    assert ids == tokenizer.encode(texts[1], add_special_tokens=False) and len(ids) > 3
    tokenizer._tokenizer.enable_padding(length=200)  # (likewise padding)
    assert codec.encode(texts[1]) == ids
    # special tokens split as the tokenizer says
    tokenizer.split_special_tokens = True
    assert codec.encode(texts[3]) == tokenizer.encode(texts[3], add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in codec.encode(texts[3])


def test_a_tokenizer_whose_encode_changes_the_text_keeps_its_encode():
    tokenizer = template_tokenizer("qwen2.5")

    class Lower(type(tokenizer)):
        def encode(self, text, **kwargs):
            return super().encode(text.lower(), **kwargs)

    tokenizer.__class__ = Lower
    codec = ChatCodec(tokenizer)
    assert codec._backend is None and codec.encode("ABC") == tokenizer.encode("abc", add_special_tokens=False)


def test_qwen3_without_thinking_adds_the_empty_think_block_to_the_next_turn():
    codec = ChatCodec(template_tokenizer("qwen3"), template_kwargs=dict(enable_thinking=False))
    text = codec.observation_text([{"role": "tool", "content": "42"}], "<|im_end|>")
    assert text == OBSERVATIONS["qwen3"] + "<think>\n\n</think>\n\n"


def test_a_tokenizer_without_a_chat_template_is_refused():
    tokenizer = template_tokenizer("smollm")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ChatCodec(tokenizer)


def test_guess_game():
    items = GuessGame.make_items(50, seed=3)
    assert items == GuessGame.make_items(50, seed=3) and {it["answer"] for it in items} <= set("0123456789")
    game = GuessGame()
    assert game.reset({"prompt": "guess", "answer": "7"}) == [{"role": "user", "content": "guess"}]
    assert game.step("x").observation == [{"role": "user", "content": "no, 77777777"}]
    assert game.step("3").observation == [{"role": "user", "content": "no, 77777777"}]
    assert game.step(" 7") == Step(done=True, reward=1.0)
    game = DirectionGame()
    game.reset({"prompt": "guess", "answer": "7"})
    assert [game.step(t).observation[0]["content"] for t in ("3", "9", "?")] == ["higher", "lower", "a digit"]


def test_python_env_runs_code_in_the_sandbox_and_scores_the_final_answer():
    from common.env import python_math

    env = configured(python_math.PythonMath, tool_timeout_s=1.5, tool_output_chars=400)()
    messages = env.reset({"prompt": "What is 2**10?", "answer": "1024"})
    assert messages[0]["role"] == "user" and "\\boxed{}" in messages[0]["content"]

    def call(code):
        return env.step(f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>')

    step = call("print(2**10)")
    assert step.observation == [{"role": "tool", "content": "1024\n"}] and not step.done and step.tool_calls == 1
    step = call("print(1); 1/0")  # the code fails: what it printed, the traceback and how it ended
    content = step.observation[0]["content"]
    assert content.startswith("error: 1\nTraceback") and "ZeroDivisionError" in content
    assert content.endswith("(exit code 1)") and (step.tool_errors, step.tool_timeouts) == (1, 0)
    start = time.time()
    step = call("while True: pass")  # killed at the turn's --tool-timeout
    assert time.time() - start < 5 and (step.tool_errors, step.tool_timeouts) == (1, 1)
    assert step.observation[0]["content"].startswith("error: (timed out after")
    step = call("print('x' * 1000)")  # cut at --tool-output-chars, the model told
    assert step.observation[0]["content"].startswith("x" * 400) and "truncated" in step.observation[0]["content"]
    assert env.step("The answer is \\boxed{1024}.") == Step(done=True, reward=1.0)
    assert env.step("\\boxed{1000}").reward == 0.0


def test_env_loading(tmp_path):
    from common.run.user_code import load_env
    from common.train.guard import UsageError

    assert load_env("game") is GuessGame
    (tmp_path / "my_env.py").write_text(
        "from common.env.base import Environment, Step\n"
        "class Echo(Environment):\n"
        "    def step(self, text):\n"
        "        return Step(done=True, reward=float(len(text)))\n"
        "def not_env():\n"
        "    pass\n"
    )
    echo = load_env(f"{tmp_path}/my_env.py:Echo")
    assert issubclass(echo, Environment) and echo().step("abc").reward == 3.0
    with pytest.raises(UsageError, match="not a subclass of common.env.base.Environment"):
        load_env(f"{tmp_path}/my_env.py:not_env")
    with pytest.raises(UsageError, match="the built-in environments are game"):
        load_env("gmae")


def test_the_documented_example_environment():
    """docs/agentic.md's example is examples/counter_env.py, and it works through --env's loader."""
    from common.run.user_code import load_env
    from tests.conftest import ROOT

    path = f"{ROOT}/examples/counter_env.py"
    assert f"```python\n{open(path).read()}```" in open(f"{ROOT}/docs/agentic.md").read()
    counter = load_env(f"{path}:Counter")()
    item = counter.make_items(3, seed=1)[0]
    counter.reset(item)
    read = counter.step('<tool_call>{"name": "read", "arguments": {}}</tool_call>')
    assert read.observation == [{"role": "tool", "content": "0"}] and read.tool_calls == 1
    assert counter.step("3").observation == [{"role": "user", "content": "now 3"}]
    assert counter.step("x").observation[0]["content"] == "say 1, 2 or 3"
    steps = [counter.step("1") for _ in range(int(item["answer"]) - 3)]
    assert steps[-1] == Step(done=True, reward=1.0) and not any(s.done for s in steps[:-1])


def test_python_env_needs_the_sandbox(monkeypatch):
    """--env python is refused at start-up, saying why, when common/env/sandbox.py cannot be imported."""
    import sys

    from common.run.user_code import load_env
    from common.train.guard import UsageError

    monkeypatch.setitem(sys.modules, "common.env.sandbox", None)  # an import of it raises ImportError
    with pytest.raises(UsageError, match="--env python runs the model's code in common/env/sandbox.py"):
        load_env("python")
