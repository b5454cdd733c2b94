"""The episode driver (common/rollout/episodes.py): token-in token-out on the supported chat templates,
masks and logprobs through batch packing, budgets, environments that hang or raise (a timed-out step's late
answer never taken for the next step's), and an episode
waiting for its environment holding up no other on a request-level engine, and at rollout TP 2 (torchrun,
gloo: tests/episodes_worker.py) the replica's first rank running the episodes while the other follows.

    .venv/bin/python -m pytest -x -q tests/test_episodes.py
"""

import json
import math
import queue
import threading
import time

import pytest

from common.env.base import Environment, Step
from common.env.chat import ChatCodec
from common.rl.batch import pack_sequences
from common.rollout.engine import RolloutEngine, Sample
from common.rollout.episodes import episode_metrics, run_episodes
from tests.chat_templates import END_OF_TURN, TEMPLATES, template_tokenizer
from tests.conftest import run_torchrun

LOGPROB = -0.5  # what the scripted engine reports for each token it "samples"


class ScriptedEngine(RolloutEngine):
    """An engine whose turns are `respond(turn) -> text` (turn: prompts given so far), encoded + the stop
    token; it records every prompt it is given. RolloutEngine's default add_turn / finished_turns run it in waves."""

    def __init__(self, tokenizer, respond, stop_id):
        self.tokenizer, self.respond, self.stop_id, self.given = tokenizer, respond, stop_id, []

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed, **_):
        samples = []
        for prompt in prompts:
            ids = self.tokenizer.encode(self.respond(len(self.given)), add_special_tokens=False) + [self.stop_id]
            self.given.append(list(prompt))
            finish = "stop" if len(ids) <= max_tokens else "length"
            ids = ids[:max_tokens]
            samples.append(Sample(list(prompt), ids, [LOGPROB] * len(ids), finish))
            self.given[-1] = (self.given[-1], ids)
        return samples


class ToolEnv(Environment):
    """Two tool results, then the end (reward 1)."""

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

    def reset(self, item):
        self.turn = 0
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return Step(done=True, reward=1.0)
        return Step(observation=[{"role": "tool", "content": f"result {self.turn}"}], tool_calls=1)


def turn_text(name, turn, thinking=False):
    think = f"<think>\nstep {turn}\n</think>\n\n" if thinking else ""
    if turn < 2:
        return think + f'<tool_call>\n{{"name": "f", "arguments": {{"x": {turn}}}}}\n</tool_call>'
    return think + "The answer is 3."


def episode(name, env_class, respond, codec_class=ChatCodec, **kwargs):
    tokenizer = template_tokenizer(name)
    codec = codec_class(tokenizer, tools=env_class.tools, template_kwargs=kwargs.pop("template_kwargs", None))
    engine = ScriptedEngine(tokenizer, respond, tokenizer.convert_tokens_to_ids(END_OF_TURN[name]))
    options = dict(temperature=1.0, top_p=1.0, max_tokens=64, max_turns=4, max_episode_tokens=4000, step_timeout_s=5)
    samples = run_episodes(engine, codec, env_class, [{"prompt": "Find x."}], n=1, seed=0, **dict(options, **kwargs))
    return tokenizer, engine, samples[0]


def turns_of(sample):
    """[(start, end)] of the model's turns within response_ids (runs of mask 1)."""
    runs, start = [], None
    for t, m in enumerate(sample.response_mask + [0]):
        if m and start is None:
            start = t
        if not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def assert_engine_ids_are_the_samples(engine, sample):
    """Turn by turn: what the engine was given is the first prompt + everything before the turn, and
    what it produced is the turn's ids in the sample (mask 1, its logprobs; observations NaN)."""
    runs = turns_of(sample)
    assert len(runs) == len(engine.given)
    for (start, end), (given, produced) in zip(runs, engine.given):
        assert given == sample.prompt_ids + sample.response_ids[:start]
        assert sample.response_ids[start:end] == produced
    for t, m in enumerate(sample.response_mask):
        assert sample.response_logprobs[t] == LOGPROB if m else math.isnan(sample.response_logprobs[t])


@pytest.mark.parametrize("name", TEMPLATES)
def test_ids_equal_what_the_engine_was_given_and_produced_and_the_template_renders(name):
    thinking = name == "qwen3"  # Qwen3 thinks first (its template adds an empty <think> to a last turn without)
    tokenizer, engine, sample = episode(name, ToolEnv, lambda turn: turn_text(name, turn, thinking))
    assert_engine_ids_are_the_samples(engine, sample)
    assert sample.finish_reason == "stop" and sample.episode["turns"] == 3 and sample.episode["reward"] == 1.0
    # ground truth: the whole conversation rendered by the template (append-only for these turns) starts with
    # exactly these ids, followed only by what the template writes after the last end-of-turn token
    messages = [{"role": "user", "content": "Find x."}]
    for turn in range(3):
        messages.append({"role": "assistant", "content": turn_text(name, turn, thinking)})
        if turn < 2:
            messages.append({"role": "tool", "content": f"result {turn + 1}"})
    full = tokenizer.apply_chat_template(messages, tools=ToolEnv.tools, tokenize=False)
    full = tokenizer.encode(full, add_special_tokens=False)
    ours = sample.prompt_ids + sample.response_ids
    assert full[: len(ours)] == ours
    assert tokenizer.decode(full[len(ours) :]) == ("" if name == "llama3" else "\n")


def test_qwen3_thinking_turns_stay_as_sampled_where_the_template_would_drop_them():
    """Game feedback comes as user messages, so Qwen3's template re-renders earlier assistant turns
    without their <think> blocks: the episode keeps the engine's ids, not that re-rendering."""

    class Feedback(ToolEnv):
        def step(self, text):
            step = super().step(text)
            if step.observation:
                step.observation = [{"role": "user", "content": f"feedback {self.turn}"}]
            return step

    tokenizer, engine, sample = episode(
        "qwen3",
        Feedback,
        lambda turn: turn_text("qwen3", turn, thinking=True),
        template_kwargs=dict(enable_thinking=True),
    )
    assert_engine_ids_are_the_samples(engine, sample)
    text = tokenizer.decode(sample.prompt_ids + sample.response_ids)
    assert text.count("<think>\nstep") == 3  # every turn's thinking, as sampled
    messages = [{"role": "user", "content": "Find x."}]
    for turn in range(3):
        messages.append({"role": "assistant", "content": turn_text("qwen3", turn, thinking=True)})
        if turn < 2:
            messages.append({"role": "user", "content": f"feedback {turn + 1}"})
    rerendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rerendered.count("<think>\nstep") == 1  # what naive concatenation would have trained on


def test_qwen3_without_thinking_every_turn_follows_the_empty_think_block():
    """enable_thinking=False (--chat-template-kwargs): the first prompt and each observation end in the
    empty <think></think> the template writes after the assistant header; the engine's ids stay the sample's."""
    tokenizer, engine, sample = episode(
        "qwen3", ToolEnv, lambda turn: turn_text("qwen3", turn), template_kwargs=dict(enable_thinking=False)
    )
    assert_engine_ids_are_the_samples(engine, sample)
    header = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    runs = turns_of(sample)
    assert len(runs) == 3
    for start, _ in runs:
        before = sample.prompt_ids + sample.response_ids[:start]
        assert before[-len(header) :] == header
    text = tokenizer.decode(sample.prompt_ids + sample.response_ids)
    assert text.count("<think>") == 3 and text.endswith("The answer is 3.<|im_end|>")


def test_masks_and_logprobs_through_batch_packing():
    tokenizer, engine, sample = episode("qwen2.5", ToolEnv, lambda turn: turn_text("qwen2.5", turn))
    plain = Sample([1, 2, 3], [4, 5], [-0.1, -0.2], "stop")  # a single-turn sample in the same batch
    batch = pack_sequences([sample, plain], pad_id=0, length_multiple=1)
    p = len(sample.prompt_ids)
    # target position t predicts token t + 1: response token j is predicted at p + j - 1
    expected = [0.0] * (p - 1) + [float(m) for m in sample.response_mask]
    assert batch["mask"][0, : len(expected)].tolist() == expected and batch["mask"][0, len(expected) :].sum() == 0
    assert batch["rollout_mask"][0].tolist() == batch["mask"][0].tolist()  # observations carry no engine logprob
    assert batch["rollout_logprobs"][0][batch["mask"][0] == 1].unique().tolist() == [LOGPROB]
    assert batch["response_len"].tolist() == [sum(sample.response_mask), 2]
    assert batch["mask"][1].tolist()[:4] == [0, 0, 1, 1]


class Forever(Environment):
    def step(self, text):
        return Step(observation=[{"role": "user", "content": "again"}], reward=0.25)


def test_budgets_end_episodes_marked_truncated():
    tokenizer, engine, sample = episode("smollm", Forever, lambda turn: "go", max_turns=3)
    assert sample.episode["turns"] == 3 and sample.finish_reason == "length" and sample.episode["reward"] == 0.25
    tokenizer, engine, sample = episode("smollm", Forever, lambda turn: "go", max_episode_tokens=150)
    assert sample.finish_reason == "length" and len(sample.prompt_ids) + len(sample.response_ids) <= 150
    assert_engine_ids_are_the_samples(engine, sample)


class Flaky(Environment):
    """Turn 1 hangs (hang=True) or raises; turn 2 ends the episode."""

    hang = True

    def reset(self, item):
        self.turn = 0
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.turn += 1
        if self.turn == 1 and self.hang:
            time.sleep(30)
        if self.turn == 1:
            raise RuntimeError("tool crashed")
        return Step(done=True, reward=1.0)


@pytest.mark.parametrize("hang", [True, False])
def test_an_environment_that_hangs_or_raises_answers_with_an_error_and_the_episode_goes_on(hang):
    env_class = type("F", (Flaky,), {"hang": hang})
    start = time.time()
    tokenizer, engine, sample = episode("qwen2.5", env_class, lambda turn: "x", step_timeout_s=0.5)
    assert time.time() - start < 5
    observation = tokenizer.decode(sample.response_ids[turns_of(sample)[0][1] :])
    expected = "did not answer within 0.5 s" if hang else "error: RuntimeError: tool crashed"
    assert expected in observation
    assert sample.episode["turns"] == 2 and sample.episode["reward"] == 1.0
    assert (sample.episode["tool_timeouts"], sample.episode["tool_errors"]) == ((1, 0) if hang else (0, 1))
    metrics = episode_metrics([sample])
    assert (
        metrics["turns_per_episode"] == 2 and metrics["env_reward"] == 1.0 and metrics["tool_s"] >= (0.5 if hang else 0)
    )


class LateThenSlow(Environment):
    """Turn 1 answers after 2.6 s (past a 2-s timeout), turn 2 after 1.2 s (within it, but still running when turn
    1's late answer comes: from ~2.0 to ~3.2 s), turn 3 ends the episode. Margins of 0.6-0.8 s: a loaded machine."""

    def reset(self, item):
        self.turn = 0
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.turn += 1
        turn = self.turn  # (turn 1's thread still sleeps while turn 2 runs)
        time.sleep({1: 2.6, 2: 1.2}.get(turn, 0))
        if turn == 3:
            return Step(done=True, reward=1.0)
        return Step(observation=[{"role": "tool", "content": f"answer of step {turn}"}], tool_calls=1)


def test_a_late_answer_of_a_timed_out_step_is_not_taken_for_the_next_steps():
    tokenizer, _, sample = episode("qwen2.5", LateThenSlow, lambda turn: "x", step_timeout_s=2.0)
    (_, end1), (start2, end2), _ = turns_of(sample)
    assert "did not answer within 2 s" in tokenizer.decode(sample.response_ids[end1:start2])
    assert "answer of step 2" in tokenizer.decode(sample.response_ids[end2:])
    assert "answer of step 1" not in tokenizer.decode(sample.response_ids)
    assert (sample.episode["turns"], sample.episode["tool_timeouts"], sample.episode["reward"]) == (3, 1, 1.0)


def test_the_environment_step_alone_runs_in_a_worker_and_the_codec_on_the_driver_thread():
    """The worker thread runs env.step only; the driver thread, which runs the engine's steps, decodes the turn and
    tokenises the observation (a worker doing that would need the interpreter while vLLM's host-bound steps hold it:
    bench/episode_driver.py --host-bound)."""
    codec_threads, step_threads = [], []

    class Codec(ChatCodec):
        def turn_text(self, ids):
            codec_threads.append(threading.current_thread())
            return super().turn_text(ids)

        def observation_ids(self, messages, stop_id=None):
            codec_threads.append(threading.current_thread())
            return super().observation_ids(messages, stop_id)

    class Env(ToolEnv):
        def step(self, text):
            step_threads.append(threading.current_thread())
            return super().step(text)

    tokenizer, _, sample = episode("qwen2.5", Env, lambda turn: turn_text("qwen2.5", turn), codec_class=Codec)
    assert sample.episode["turns"] == 3 and len(codec_threads) == 5  # 3 turns decoded, 2 observations
    assert set(codec_threads) == {threading.main_thread()}
    assert len(step_threads) == 3 and threading.main_thread() not in step_threads


def test_an_observation_the_template_cannot_render_answers_with_an_error():
    class Codec(ChatCodec):
        def observation_ids(self, messages, stop_id=None):
            if messages[0]["content"] == "result 1":
                raise ValueError("no template for this")
            return super().observation_ids(messages, stop_id)

    tokenizer, _, sample = episode("qwen2.5", ToolEnv, lambda turn: turn_text("qwen2.5", turn), codec_class=Codec)
    observation = tokenizer.decode(sample.response_ids[turns_of(sample)[0][1] : turns_of(sample)[1][0]])
    assert "error: ValueError: no template for this" in observation
    assert sample.episode["tool_errors"] == 1 and sample.episode["turns"] == 3 and sample.episode["reward"] == 1.0
    assert sample.episode["tool_calls"] == 2  # the environment's step counts: only its observation failed


class RequestEngine(RolloutEngine):
    """A request-level engine (as VLLMEngine): each finished_turns call is one engine step that
    finishes the oldest queued turn; it logs the order in which turns were added."""

    turns_in_waves = False

    def __init__(self, stop_id):
        self.stop_id, self.queue, self.added = stop_id, [], []

    def add_turn(self, key, prompt_ids, max_tokens, temperature, top_p, seed):
        self.queue.append((key, list(prompt_ids)))
        self.added.append(key)

    def finished_turns(self):
        if not self.queue:
            return []
        key, prompt = self.queue.pop(0)
        return [(key, Sample(prompt, [65, self.stop_id], [LOGPROB] * 2, "stop"))]


class SlowFirst(Environment):
    """Three turns; episode "slow" takes 1 s to answer its first."""

    def reset(self, item):
        self.slow, self.turn = item["prompt"] == "slow", 0
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.slow and self.turn == 1:
            time.sleep(1.0)
        return Step(done=self.turn == 3, observation=[{"role": "user", "content": "ok"}])


def test_an_episode_waiting_for_its_environment_holds_up_no_other():
    tokenizer = template_tokenizer("smollm")
    engine = RequestEngine(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    items = [{"prompt": "slow"}, {"prompt": "a"}, {"prompt": "b"}]
    samples = run_episodes(
        engine,
        ChatCodec(tokenizer),
        SlowFirst,
        items,
        n=1,
        temperature=1.0,
        top_p=1.0,
        max_tokens=8,
        max_turns=5,
        max_episode_tokens=500,
        step_timeout_s=5,
        seed=0,
    )
    assert [s.episode["turns"] for s in samples] == [3, 3, 3]
    # the other episodes ran all their turns while episode 0 waited for its first observation (1 and 2 in
    # whichever order their environments' threads answered)
    assert engine.added[:3] == [0, 1, 2] and sorted(engine.added[3:7]) == [1, 1, 2, 2] and engine.added[7:] == [0, 0]


def test_the_cpu_engine_runs_queued_turns_as_one_generate_call(tmp_path):
    """RolloutEngine's default add_turn / finished_turns on HFEngine: a wave is one generate call seeded
    by its first turn, each turn cut at its own max_tokens (a prefix of what the wave sampled)."""
    from common.rollout.hf_engine import HFEngine
    from common.run.embedded import EMBEDDED_MODELS, write_embedded_model

    write_embedded_model(str(tmp_path), **EMBEDDED_MODELS["dense"])
    engine = HFEngine(str(tmp_path), eos_token_ids=[])  # no stop token: every turn runs to its budget
    prompts = [[257, 49, 50], [257, 51]]
    engine.add_turn("a", prompts[0], 3, 1.0, 1.0, seed=11)
    engine.add_turn("b", prompts[1], 5, 1.0, 1.0, seed=12)
    done = dict(engine.finished_turns())
    whole = engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=5, seed=11)
    assert done["a"].response_ids == whole[0].response_ids[:3] and done["a"].finish_reason == "length"
    assert done["a"].response_logprobs == whole[0].response_logprobs[:3]
    assert done["b"].response_ids == whole[1].response_ids and done["b"].prompt_ids == prompts[1]
    assert engine.finished_turns() == []  # nothing queued


def test_a_wave_is_the_same_whatever_order_its_turns_were_queued_in():
    """The ranks of a TP > 1 vLLM replica run the same episodes in waves, and queue each wave's turns in
    the order their environments finished, which differs from rank to rank: the engine must still be
    given the same prompts in the same order with the same seed (else the ranks' engines disagree and
    their collectives hang)."""
    turns = [(k, [257, 40 + k], 4, 1.0, 1.0, 100 + k) for k in range(5)]
    calls = []
    for order in ([0, 1, 2, 3, 4], [3, 0, 4, 2, 1]):
        engine = ScriptedEngine(template_tokenizer("smollm"), lambda turn: "x", 0)
        engine.generate = lambda prompts, **kw: (
            calls.append((prompts, kw)) or [Sample(p, [1], [0.0], "stop") for p in prompts]
        )
        for k in order:
            engine.add_turn(*turns[k])
        assert sorted(key for key, _ in engine.finished_turns()) == list(range(5))
    assert calls[0] == calls[1] and calls[0][0] == [t[1] for t in turns] and calls[0][1]["seed"] == 100


@pytest.mark.parametrize("mode", ["follow", "alone"])
def test_at_rollout_tp2_the_first_rank_runs_the_episodes_and_the_other_generates_its_waves(mode):
    """Two ranks of one replica under torchrun (gloo), an environment that answers differently on each:
    with a wave group (as VLLMEngine sets at --rollout-tp 2) rank 0 runs the episodes and sends each wave,
    rank 1 generates exactly those and returns no samples (the replica's are rank 0's); alone (the
    control), each rank's engine is given its own rank's observations."""
    proc = run_torchrun("tests/episodes_worker.py", 2, mode, timeout=180)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["calls"] == [3, 3] and "rank 0 turn 2" in result["observation"]
    if mode == "follow":
        assert result["same_calls"] and result["samples"] == [6, 0]
    else:
        assert not result["same_calls"] and result["samples"] == [6, 6]


class Slow(Environment):
    def step(self, text):
        time.sleep(0.4)
        return Step(done=True, reward=1.0)


def test_at_most_max_workers_steps_run_at_once_and_the_timeout_counts_from_a_steps_start():
    tokenizer = template_tokenizer("smollm")
    engine = RequestEngine(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    start = time.time()
    samples = run_episodes(
        engine, ChatCodec(tokenizer), Slow, [{"prompt": "a"}] * 3, n=1, temperature=1.0, top_p=1.0, max_tokens=8,
        max_turns=2, max_episode_tokens=500, step_timeout_s=0.7, seed=0, max_workers=1,
    )  # fmt: skip
    assert time.time() - start >= 1.2  # one after the other
    assert [s.episode["reward"] for s in samples] == [1.0] * 3 and sum(s.episode["tool_timeouts"] for s in samples) == 0


def test_step_threads_are_reused_and_a_hung_step_holds_up_no_later_one():
    """Environment steps run on kept daemon threads (_Workers): one thread per step cost ~0.5 ms of the
    driver's time each. A step that hangs keeps its thread; the next step that finds none idle starts
    another, so later steps still run, and a thread back from its step takes the next one."""
    import threading

    from common.rollout.episodes import _Workers

    workers, release = _Workers(), threading.Event()
    started = []
    real_start = threading.Thread.start

    def counting_start(thread):
        started.append(thread)
        real_start(thread)

    replies = queue.SimpleQueue()

    def reply_to(tag):
        return lambda result, error: replies.put((tag, result, error))

    threading.Thread.start = counting_start
    try:
        workers.submit(release.wait, None, reply_to("hung"))  # (Event.wait(None): until released)
        for i in range(20):
            workers.submit(lambda x: x * x, i, reply_to(i))
            assert replies.get(timeout=5) == (i, i * i, None)
        assert len(started) == 2  # the hung step's thread and one reused 20 times
        workers.submit(lambda x: 1 / x, 0, reply_to("error"))  # an environment's own error reaches the driver
        tag, result, error = replies.get(timeout=5)
        assert tag == "error" and result is None and isinstance(error, ZeroDivisionError)
        assert replies.empty()  # the hung step has not answered
        release.set()
        assert replies.get(timeout=5) == ("hung", True, None)
    finally:
        threading.Thread.start = real_start
        release.set()


def test_a_forked_child_gets_its_own_step_threads():
    """The kept threads do not exist in a forked child (a tool that forks, a data loader): there the pool starts
    empty, instead of handing a step to a thread that is not there."""
    import os

    from common.rollout.episodes import _WORKERS

    def answer(x):
        replies = queue.SimpleQueue()
        _WORKERS.submit(lambda y: y, x, lambda result, error: replies.put(result))
        return replies.get(timeout=5)

    assert answer(1) == 1  # one idle thread in this process
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if answer(2) == 2 else 1)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0
