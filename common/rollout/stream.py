"""Partial rollouts on engines of their own: --rollout-gpus R --off-policy-steps K --partial-chunk-tokens N.

The engines do not wait for the trainer. A thread of the first trainer rank keeps (K + 1) x --prompts-per-step groups
in flight on them and continues every running sample N tokens at a time (the chunks of common/rollout/partial.py),
while the trainer trains. A weight sync goes between two chunks: the samples still running continue under the new
weights, each token's version saying which weights sampled it, so a sync waits for at most one chunk, never for the
longest response. Each step takes the oldest --prompts-per-step complete groups (it waits only while fewer are
complete); a group whose first tokens are more than K steps old when a step starts is dropped and its prompt
started afresh, so every trained sample's staleness is in 0..K, as with partial rollouts on shared GPUs.

    stream = StreamingRollouts(engine, PartialRollouts(...), temperature=..., top_p=...)   # engine: RemoteEngine
    samples, prompts, metrics = stream.take(step, sampler.next_batch(), sampler.next_batch, prompt_ids)  # rank 0
    extra["partial"] = stream.state_dict()    # the groups in flight as they stand; load_state_dict on resume

Which chunk ran under which weights depends on timing (how far the engines got while the trainer trained), so a
run does not repeat step for step, nor does a resumed run; the bound, the versions and the corrections are exact.
The checkpoint's groups are PartialRollouts' own: either kind of partial rollouts resumes the other's.
"""

import threading
import traceback

from common.rollout import remote

WAIT_SLICE_S = 10.0  # how often a step's wait looks whether the thread still runs


class StreamingRollouts:
    """The trainer side of streaming partial rollouts (module docstring). engine: the RemoteEngine; carry: the
    PartialRollouts whose groups, chunks, bound and metrics it runs; temperature, top_p: the sampling's. take,
    state_dict and load_state_dict run on the first trainer rank (the others get their samples from it)."""

    def __init__(self, engine, carry, temperature, top_p):
        self.engine, self.carry = engine, carry
        self.sampling = dict(temperature=temperature, top_p=top_p)
        self.changed = threading.Condition()  # the groups (the thread's chunks, the loop's takes)
        self.thread, self.error, self.stopping = None, None, False
        self.base = 0  # a chunk's version: base + the weight syncs the engines hold (set at the first take)
        self.calls = 0  # engine calls so far (each its own seed)
        self.chunks, self.busy_s = 0, 0.0  # since the last take: chunks run, the engines' seconds for them
        remote._OPEN.append(self)  # closed before the engine (close_all goes newest first): the thread stops

    def take(self, step, new_prompts, more_prompts, prompt_ids):
        """This step's samples -> (samples, each group's prompt, metrics): PartialRollouts.rollout's arguments and
        answer, the chunks run by the thread (started here at the first step or resume). Call it after the step's
        weight sync: its new groups start under this step's weights."""
        if self.thread is None:
            self.base = step - self.engine.sync  # (the syncs made: this step's, if sent behind, counted)
            self.thread = threading.Thread(target=self._run, name="streaming rollouts", daemon=True)
            self.thread.start()
        with self.changed:
            dropped = self.carry.admit(step, new_prompts, more_prompts, prompt_ids)
            self.changed.notify_all()
            while not self.changed.wait_for(self._ready, timeout=WAIT_SLICE_S):
                if not self.thread.is_alive():
                    raise RuntimeError("--rollout-gpus: the streaming rollouts' thread stopped")
            if self.error:
                raise RuntimeError(f"--rollout-gpus: streaming partial rollouts failed:\n{self.error}")
            done = self.carry.take()
            metrics = self.carry.metrics(step, done, dropped, self.chunks)
            metrics["engine_busy_sec"] = self.busy_s  # the engines' own seconds since the last step took its groups
            self.carry.generated, self.chunks, self.busy_s = 0, 0, 0.0
        return [s for g in done for s in g.samples], [g.prompt for g in done], metrics

    def _ready(self):
        return self.error is not None or self.carry.complete() >= self.carry.prompts_per_step

    def _run(self):
        """The thread: a chunk of every running sample, again and again, each in a turn of its own on the engines
        (RemoteEngine.turn: a weight sync goes between two chunks); idle while nothing runs."""
        link = self.engine.link.clone()
        try:
            while True:
                with self.changed:
                    self.changed.wait_for(lambda: self.stopping or self.carry.running())
                    if self.stopping:
                        return
                with self.engine.turn(background=True):
                    version = self.base + self.engine.held  # the weights the engines hold: no sync in this turn
                    with self.changed:
                        calls = self.carry.plan()
                    for call in calls:
                        if self.stopping:
                            return
                        seed = self.carry.call_seed(version, self.calls)
                        self.calls += 1
                        outs = self._generate(link, *self.carry.request(call, seed))
                        with self.changed:
                            self.carry.apply(version, call, outs)
                            self.busy_s += self.engine.last_generate_s  # (set by this call's collect, in this turn)
                            self.changed.notify_all()
                with self.changed:
                    self.chunks += 1
        except Exception:
            with self.changed:
                self.error = traceback.format_exc()
                self.changed.notify_all()

    def _generate(self, link, rows, max_tokens, seed, lengths=None):
        """One engine call of n = 1 per row, every token's logprob (the corrections' behaviour policy)."""
        ticket = self.engine.submit(
            rows, link, n=1, max_tokens=max_tokens, seed=seed, logprob_samples=None, response_lengths=lengths,
            **self.sampling,
        )  # fmt: skip
        return self.engine.collect(ticket, link)[0]

    def state_dict(self):
        """The groups in flight as they stand (a chunk running meanwhile is not waited for: its tokens are
        generated again after a resume)."""
        with self.changed:
            return self.carry.state_dict()

    def load_state_dict(self, state):
        if "in_flight" in state:
            raise ValueError(
                "--resume: this checkpoint holds whole requests sent ahead (--rollout-gpus without "
                "--partial-chunk-tokens); resume it with the run's own flags"
            )
        with self.changed:
            self.carry.load_state_dict(state)

    def close(self):
        """The thread ends after its engine call (the engines' stop, sent next, comes after it)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
