"""Streaming partial rollouts (common/rollout/stream.py) against an engine whose calls the test lets through one by
one: which weights each chunk ran under, the weight sync between two chunks, the staleness bound.

    .venv/bin/python -m pytest -q tests/test_stream.py

The engine answers each row with the prompt's length in tokens at most and logprobs -(its weight syncs so far), so
every token's engine logprob says which weights sampled it; the test checks the versions the stream recorded.
"""

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from common.rollout import remote
from common.rollout.engine import Sample
from common.rollout.partial import PartialRollouts
from common.rollout.stream import StreamingRollouts

LENGTHS = {0: 2, 1: 2, 2: 6, 3: 6, 4: 2, 5: 2, 6: 2, 7: 2}  # each prompt's response length
PROMPT_IDS = {p: [p] for p in LENGTHS}  # one token a prompt


class GatedEngine(remote.RemoteEngine):
    """A RemoteEngine's turns, its other methods in process: each call waits until the test lets one through."""

    def __init__(self):
        super().__init__(SimpleNamespace(global_rank=0, clone=lambda: None))
        remote._OPEN.remove(self)
        self.sync = self.held = 1  # the first weight sync: step 0's
        self.waiting, self.go = threading.Semaphore(0), threading.Semaphore(0)
        self.request = None

    def submit(self, prompts, link=None, **kwargs):
        self.request = (prompts, kwargs)
        return 0

    def collect(self, ticket, link=None):
        self.waiting.release()
        assert self.go.acquire(timeout=60), "the test let no call through"
        rows, kwargs = self.request
        out = []
        for row in rows:
            n = min(kwargs["max_tokens"], LENGTHS[row[0]] - (len(row) - 1))
            finish = "stop" if len(row) - 1 + n == LENGTHS[row[0]] else "length"
            out.append(Sample(row, [9] * n, [-float(self.held)] * n, finish))
        return out, [0] * len(out)

    def let_one_call_through(self):
        assert self.waiting.acquire(timeout=60), "no call came"
        self.go.release()

    def weight_sync(self):  # as RemoteEngine.update_weights: in a turn of its own
        self.sync += 1
        with self.turn():
            self.held += 1


def test_a_sync_goes_between_chunks_and_running_samples_continue_under_it():
    engine = GatedEngine()
    stream = StreamingRollouts(engine, PartialRollouts(1, 2, 2, max_tokens=6, chunk_tokens=2), 1.0, 1.0)
    remote._OPEN.remove(stream)  # (closed here)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    # step 0: (K + 1) x 2 groups start (prompts 0-3); one chunk completes the groups of prompts 0 and 1
    taken = pool.submit(stream.take, 0, [0, 1], lambda: [2, 3], PROMPT_IDS)
    engine.let_one_call_through()
    samples, prompts, metrics = taken.result(timeout=60)
    assert prompts == [0, 1] and metrics["staleness_share_0"] == 1.0 and len(samples) == 4
    # the next chunk (prompts 2, 3: tokens 3-4) is with the engine; a weight sync waits for it, then goes first
    assert engine.waiting.acquire(timeout=60)
    synced = pool.submit(engine.weight_sync)
    time.sleep(0.3)
    assert not synced.done(), "a weight sync went during a chunk"
    engine.go.release()
    synced.result(timeout=60)
    # the thread goes on with prompts 2 and 3 (tokens 5-6) under the new weights; step 1 starts prompts 4 and 5
    taken = pool.submit(stream.take, 1, [4, 5], None, PROMPT_IDS)
    engine.let_one_call_through()
    samples, prompts, metrics = taken.result(timeout=60)
    assert prompts == [2, 3]  # the oldest complete groups, written by two policies
    for s in samples:
        assert s.versions == [0, 0, 0, 0, 1, 1] and s.response_logprobs == [-1.0] * 4 + [-2.0] * 2
    assert metrics["partial_frac"] == 1.0 and metrics["staleness_share_1"] == 1.0 and metrics["carried_samples"] == 4
    with stream.changed:  # prompts 4 and 5 ran in that chunk (if step 1 started them before it) or run in the next
        next_chunk = stream.carry.running()
    if next_chunk:
        engine.let_one_call_through()
    # step 3 (two more syncs): the groups of prompts 4 and 5 began at step 1, beyond K = 1: dropped, sampled afresh
    engine.weight_sync(), engine.weight_sync()
    taken = pool.submit(stream.take, 3, [6, 7], None, PROMPT_IDS)
    engine.let_one_call_through()
    samples, prompts, metrics = taken.result(timeout=60)
    assert prompts == [4, 5] and metrics["dropped_samples"] == 4 and metrics["staleness_share_0"] == 1.0
    assert all(s.versions == [3, 3] and s.response_logprobs == [-4.0, -4.0] for s in samples)
    assert [g.prompt for g in stream.carry.groups] == [6, 7]  # complete, carried
    stream.close()
    stream.thread.join(timeout=60)
    assert not stream.thread.is_alive()


def test_a_group_started_before_a_sync_is_as_old_as_its_first_tokens():
    """Step 1 starts prompts 4 and 5 while the engine runs a chunk of prompts 2 and 3; step 2's weight sync goes
    before their first chunk, so their tokens, and their age at step 2, are step 2's weights' (age 0, not 1)."""
    engine = GatedEngine()
    stream = StreamingRollouts(engine, PartialRollouts(1, 2, 2, max_tokens=6, chunk_tokens=2), 1.0, 1.0)
    remote._OPEN.remove(stream)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    taken = pool.submit(stream.take, 0, [0, 1], lambda: [2, 3], PROMPT_IDS)
    engine.let_one_call_through()
    assert taken.result(timeout=60)[1] == [0, 1]
    assert engine.waiting.acquire(timeout=60)  # prompts 2 and 3: tokens 3-4
    synced = pool.submit(engine.weight_sync)  # step 1's, waiting before that chunk ends: it goes next
    time.sleep(0.3)
    engine.go.release()
    synced.result(timeout=60)
    assert engine.waiting.acquire(timeout=60)  # prompts 2 and 3: tokens 5-6, under step 1's weights
    taken = pool.submit(stream.take, 1, [4, 5], None, PROMPT_IDS)  # prompts 4 and 5 wait for the next chunk
    time.sleep(0.3)
    synced = pool.submit(engine.weight_sync)  # step 2's: waits for the chunk, goes before the next
    time.sleep(0.3)
    engine.go.release()
    assert taken.result(timeout=60)[1] == [2, 3]
    synced.result(timeout=60)
    taken = pool.submit(stream.take, 2, [6, 7], None, PROMPT_IDS)
    engine.let_one_call_through()  # prompts 4-7 under step 2's weights
    samples, prompts, metrics = taken.result(timeout=60)
    assert prompts == [4, 5] and all(s.versions == [2, 2] for s in samples)
    assert metrics["staleness_share_0"] == 1.0
    stream.close()


def test_an_engine_failure_stops_the_step_with_its_message():
    engine = GatedEngine()
    engine.collect = lambda ticket, link=None: (_ for _ in ()).throw(RuntimeError("the engine rank 1 died"))
    stream = StreamingRollouts(engine, PartialRollouts(1, 2, 2, max_tokens=6, chunk_tokens=2), 1.0, 1.0)
    remote._OPEN.remove(stream)
    with pytest.raises(RuntimeError, match="streaming partial rollouts failed:(.|\n)*the engine rank 1 died"):
        stream.take(0, [0, 1], lambda: [2, 3], PROMPT_IDS)


def test_a_checkpoint_of_whole_requests_is_refused():
    stream = StreamingRollouts(GatedEngine(), PartialRollouts(1, 2, 2, max_tokens=6, chunk_tokens=2), 1.0, 1.0)
    remote._OPEN.remove(stream)
    with pytest.raises(ValueError, match="without --partial-chunk-tokens"):
        stream.load_state_dict({"in_flight": [[0, [0, 1], []]]})


class HeldLink:
    """A link whose weight transfer waits until the test opens its gate; what was sent, in order."""

    global_rank, timeout_s = 0, 60

    def __init__(self):
        self.gate, self.sending = threading.Event(), threading.Event()
        self.posted, self.sent = {}, []

    def clone(self):
        return self

    def post(self, key, obj):
        self.posted[key] = obj

    def broadcast(self, flat):
        self.sending.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.sent.append(("weights", flat.clone()))


def test_a_sync_sent_behind_reads_the_weights_before_the_optimizer_changes_them():
    """--sync-overlap: update_weights returns while the weights are still on their way; the training step's
    settle() (before the optimizer step) waits for them, so the engines get the weights of the step that sent
    them; a streaming chunk waiting meanwhile goes after the sync."""
    link = HeldLink()
    engine = remote.RemoteEngine(link, bucket_mb=1, behind=True)
    remote._OPEN.remove(engine)
    weight = torch.ones(8)

    def chunk():  # streaming's thread: a background turn, waiting before the sync was made
        with engine.turn(background=True):
            link.sent.append(("chunk", engine.held))

    def optimizer_step():  # the training step: settle, then the parameters change
        engine.settle()
        weight.add_(1.0)

    pool = concurrent.futures.ThreadPoolExecutor(2)
    validation = engine.turn()  # (a turn the test holds: the chunk, then the sync, wait for it)
    validation.__enter__()
    chunked = pool.submit(chunk)
    time.sleep(0.2)
    engine.update_weights(iter([("w", weight)]))  # returns at once: the sync waits its turn
    assert engine.sync == 1 and engine.held == 0
    validation.__exit__(None, None, None)
    assert link.sending.wait(60)  # the sync went first; its transfer is held
    stepped = pool.submit(optimizer_step)
    time.sleep(0.3)
    assert not stepped.done() and not chunked.done() and weight.eq(1.0).all()
    link.gate.set()
    stepped.result(timeout=60), chunked.result(timeout=60)
    (what, flat), after = link.sent
    assert what == "weights" and flat.view(torch.float32).eq(1.0).all()  # the weights as the step made them
    assert after == ("chunk", 1)  # the chunk ran under the new weights
    assert link.posted["cmd/0"] == {"kind": "weights", "sync": 1} and weight.eq(2.0).all()


def test_a_failed_sync_sent_behind_stops_the_next_step():
    link = HeldLink()
    link.broadcast = lambda flat: (_ for _ in ()).throw(RuntimeError("NCCL error: the engine rank 1 died"))
    engine = remote.RemoteEngine(link, behind=True)
    remote._OPEN.remove(engine)
    engine.update_weights(iter([("w", torch.ones(2))]))
    with pytest.raises(RuntimeError, match="the weight sync failed:(.|\n)*the engine rank 1 died"):
        engine.settle()
