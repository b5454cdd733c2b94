"""Agentic episodes: many multi-turn episodes at once on a rollout engine, token-in token-out.

    samples = run_episodes(engine, codec, make_env, items, n=8, max_tokens=256, max_turns=4, ...)

Each of the len(items) * n episodes (prompt-major, as RolloutEngine.generate orders samples) starts
from its item's messages (env.reset), and then, turn after turn: the engine samples a turn after
the episode's ids so far; the environment answers the decoded turn (env.step, in a worker thread,
at most `max_workers` at once, each at most `step_timeout_s`) with an observation, tokenised once
as the chat template continues (common/env/chat.py), or ends the episode with its reward. The
worker runs env.step alone; the driver thread, which runs the engine's steps, decodes the turn and tokenises the
observation: where vLLM's steps are bound by the host, they hold the interpreter nearly all the time, and a worker
that needed it for that work would cost the engine more in hand-overs than the work itself (bench/episode_driver.py
--host-bound). The driver takes each finished step from a queue the workers fill, and timeouts from a heap of
deadlines, so its work between engine steps grows with the steps that ended, not with those still running
(thousands, with slow tools). An
episode whose environment is busy holds up no other: its next turn is queued when its observation
is ready (engine.add_turn / finished_turns; the CPU engine runs the queued turns in waves, vLLM
request by request).

The Sample of an episode: prompt_ids = the first prompt; response_ids = every id after it (model
turns and observations, exactly as the engine was given and produced them); response_mask 1 on
the model's tokens, 0 on the observations'; response_logprobs the engine's logprob of each model
token (NaN on observations); finish_reason "length" when a budget ended it (--max-turns, the
episode's tokens, the turn's --max-new-tokens on the last turn), else the last turn's; episode =
dict(reward, turns, tool_calls, tool_errors, tool_timeouts, tool_s, episode_tokens).

An environment step that raises or outlives step_timeout_s, or whose observation the chat template
cannot render, answers with an error observation (the model reads it; the run goes on). A budget that
ends an episode keeps its last reward.
"""

import collections
import heapq
import itertools
import math
import os
import queue
import threading
import time

from common.env.base import Step, error_step
from common.rollout.engine import Sample

EPISODE_METRICS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_s", "episode_tokens")


class _Episode:
    def __init__(self, env, prompt_ids, seed):
        self.env, self.prompt_ids, self.seed = env, prompt_ids, seed
        self.ids, self.mask, self.logprobs = [], [], []  # everything after the prompt
        self.counts = dict.fromkeys(EPISODE_METRICS, 0)
        self.reward, self.finish_reason, self.done = 0.0, "stop", False
        self.pending = None  # (the step's ticket, start, the turn's ids and stop id) while the environment works

    def end(self, finish_reason):
        self.done, self.finish_reason = True, finish_reason


class _Workers:
    """Daemon threads that run environment steps, kept between steps and rollouts: starting a thread per
    step cost ~0.5 ms of the driver's time each (256 episodes: ~0.13 s at every turn boundary, while
    the engine waits). A thread whose step hangs stays busy for good (daemon: not joined at exit); the
    next step that finds no idle thread starts a new one, so a hung tool never holds up a later step."""

    def __init__(self):
        self._jobs, self._lock, self._idle = queue.SimpleQueue(), threading.Lock(), 0

    def submit(self, fn, arg, reply):
        """fn(arg) in a worker thread, then reply(result, error) there (error: what fn raised, else None). No
        Future: its lock, condition and callbacks cost the driver and, in a burst of answers, the workers' share of
        the interpreter."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # the job is that thread's
            else:
                threading.Thread(target=self._work, daemon=True).start()
        self._jobs.put((fn, arg, reply))

    def _work(self):
        while True:
            fn, arg, reply = self._jobs.get()
            try:
                result, error = fn(arg), None
            except BaseException as e:
                result, error = None, e
            with self._lock:  # idle before the driver hears of it: its next step finds this thread
                self._idle += 1
            reply(result, error)


_WORKERS = _Workers()
os.register_at_fork(after_in_child=_WORKERS.__init__)  # a forked child has none of these threads


def run_episodes(
    engine,
    codec,
    make_env,
    items,
    *,
    n,
    temperature,
    top_p,
    max_tokens,
    max_turns,
    max_episode_tokens,
    step_timeout_s,
    seed,
    max_workers=32,
):
    """Run len(items) * n episodes to their ends -> Samples (module docstring). make_env() -> a new
    Environment per episode; codec: a common.env.chat.ChatCodec of the engine's tokenizer;
    max_workers: environment steps running at once (threads; the others wait their turn, and
    step_timeout_s counts from a step's start). On a rank that follows its replica's first rank
    (engine.wave_follower, rollout TP > 1): generates that rank's waves and returns [] (the replica's
    samples are the first rank's)."""
    if engine.wave_follower:  # a rank of a TP > 1 replica but its first: it generates the first rank's waves
        engine.follow_waves()
        return []
    episodes = []
    for i, item in enumerate(items):
        for j in range(n):
            env = make_env()
            prompt_ids = codec.prompt_ids(env.reset(item))
            if len(prompt_ids) >= max_episode_tokens:
                raise ValueError(
                    f"the first prompt of item {i} has {len(prompt_ids)} tokens, which leaves no room for a turn "
                    f"within --max-episode-tokens {max_episode_tokens}: raise it"
                )
            episodes.append(_Episode(env, prompt_ids, seed * 100_003 + 7919 * (i * n + j)))
    turn = [0] * len(episodes)  # turns sampled so far, per episode (the turn's seed)
    in_engine = set()  # episodes whose turn the engine has
    waiting, running = collections.deque(), set()  # episodes whose environment step waits for a worker / runs
    answered = queue.SimpleQueue()  # (episode, ticket, result, error) of the environment steps that finished
    deadlines, tickets = [], itertools.count()  # heap of (deadline, ticket, episode) of the running steps

    def add_turn(k):
        e = episodes[k]
        room = max_episode_tokens - len(e.prompt_ids) - len(e.ids)
        engine.add_turn(k, e.prompt_ids + e.ids, min(max_tokens, room), temperature, top_p, e.seed + turn[k])
        in_engine.add(k)
        turn[k] += 1

    def turn_done(k, s):
        e = episodes[k]
        e.ids += s.response_ids
        e.mask += [1] * len(s.response_ids)
        e.logprobs += list(s.response_logprobs)
        e.counts["turns"] += 1
        if s.finish_reason == "length" and len(e.prompt_ids) + len(e.ids) >= max_episode_tokens:
            return e.end("length")  # the episode's context is full: no room for an observation and a turn
        stop_id = s.response_ids[-1] if s.finish_reason == "stop" else None
        e.pending = dict(ticket=None, turn_ids=s.response_ids, stop_id=stop_id, finish=s.finish_reason)
        waiting.append(k)  # its environment step starts when a worker is free
        start_steps()

    def start_steps():
        while waiting and len(running) < max_workers:
            k = waiting.popleft()
            e, now, ticket = episodes[k], time.time(), next(tickets)  # the ticket: this step's, not a later one's
            e.pending.update(ticket=ticket, started=now)
            running.add(k)
            heapq.heappush(deadlines, (now + step_timeout_s, ticket, k))

            def reply(result, error, k=k, ticket=ticket):  # (in the worker's thread)
                answered.put((k, ticket, result, error))

            _WORKERS.submit(e.env.step, codec.turn_text(e.pending["turn_ids"]), reply)

    def step_done(k, step, seconds):
        e = episodes[k]
        stop_id, finish = e.pending["stop_id"], e.pending["finish"]
        e.pending = None
        e.counts["tool_s"] += seconds
        for name in ("tool_calls", "tool_errors", "tool_timeouts"):
            e.counts[name] += getattr(step, name)
        e.reward = float(step.reward)
        if step.done or not step.observation:
            return e.end(finish)
        if e.counts["turns"] >= max_turns:
            return e.end("length")
        try:
            obs = codec.observation_ids(step.observation, stop_id)
        except Exception as error:  # an observation the chat template cannot render: the model reads why
            e.counts["tool_errors"] += 1
            obs = codec.observation_ids(error_step(f"{type(error).__name__}: {error}").observation, stop_id)
        if len(e.prompt_ids) + len(e.ids) + len(obs) >= max_episode_tokens:
            return e.end("length")  # the observation would leave no room for another turn
        e.ids += obs
        e.mask += [0] * len(obs)
        e.logprobs += [math.nan] * len(obs)
        add_turn(k)

    def finish_step(k, answer):
        """Take episode k's environment step: its (result, error), or (None) a timeout's error observation."""
        pending = episodes[k].pending
        if answer is None:  # the thread is left behind (daemon); its worker is given to another step
            step = error_step(f"the environment did not answer within {step_timeout_s:g} s")
            step.tool_errors, step.tool_timeouts = 0, 1
        else:
            step, error = answer
            if isinstance(error, Exception):  # the environment's own failure: the model reads it, the run goes on
                step = error_step(f"{type(error).__name__}: {error}")
            elif error is not None:  # (KeyboardInterrupt, SystemExit in the worker: the rollout's own)
                raise error
            if not isinstance(step, Step):
                step = error_step(f"the environment's step returned {type(step).__name__}, not a Step")
        running.discard(k)
        step_done(k, step, time.time() - pending["started"])

    def current(k, ticket):
        return k in running and episodes[k].pending["ticket"] == ticket

    def take_steps(block):
        """Handle the environment steps that timed out and those answered by now (with `block`: wait for the first
        answer or timeout), starting waiting steps in the freed workers. Answers that come meanwhile wait for the
        next call: a stream of them does not hold up the engine's next step."""
        left = answered.qsize()
        while running:  # each running step has its entry in `deadlines`
            while not current(deadlines[0][2], deadlines[0][1]):
                heapq.heappop(deadlines)  # that step was answered
            now = time.time()
            if deadlines[0][0] <= now:
                finish_step(heapq.heappop(deadlines)[2], None)
            elif block or left > 0:
                try:
                    k, ticket, result, error = answered.get(timeout=deadlines[0][0] - now)  # (left > 0: it is there)
                except queue.Empty:
                    continue  # the first deadline passed
                left = answered.qsize() if block else left - 1
                if current(k, ticket):  # (else the late answer of a step that timed out)
                    finish_step(k, (result, error))
            else:
                return
            block = False
            start_steps()

    for k in range(len(episodes)):
        add_turn(k)
    while in_engine or waiting or running:
        if engine.turns_in_waves:  # lock-step: every pending environment step first, then one wave
            while running:
                take_steps(block=True)
        if in_engine:
            for k, s in engine.finished_turns():  # vLLM: one engine step's finished requests (maybe none)
                in_engine.discard(k)
                turn_done(k, s)
        else:  # only environments are busy: take their answers a millisecond's worth at a time (waking for each
            time.sleep(0.001)  # of thousands of answers costs the interpreter hand-overs that slow the workers down)
        take_steps(block=False)
    engine.end_waves()
    samples = []
    for e in episodes:
        episode = dict(e.counts, reward=e.reward, episode_tokens=len(e.prompt_ids) + len(e.ids))
        samples.append(Sample(e.prompt_ids, e.ids, e.logprobs, e.finish_reason, response_mask=e.mask, episode=episode))
    return samples


def episode_metrics(samples):
    """The step's metrics of episodes' Samples: means per episode of turns, tool calls, errors,
    timeouts, tool seconds, tokens, and the environment's reward."""
    episodes = [s.episode for s in samples if s.episode is not None]
    if not episodes:
        return {}
    mean = {name: sum(e[name] for e in episodes) / len(episodes) for name in EPISODE_METRICS}
    return {
        "turns_per_episode": mean["turns"],
        "tool_calls": mean["tool_calls"],
        "tool_errors": mean["tool_errors"],
        "tool_timeouts": mean["tool_timeouts"],
        "tool_s": mean["tool_s"],
        "episode_tokens": mean["episode_tokens"],
        "env_reward": sum(e["reward"] for e in episodes) / len(episodes),
    }
