"""--rollout-gpus --off-policy-steps 1: whole generate requests sent ahead to the engines on GPUs of their own
(common/rollout/remote.py), so they generate a step's samples while the trainer trains on the previous step's
(docs/async.md). Streaming partial rollouts, the other way to run those engines, are common/rollout/stream.py."""

from common.rollout.partial import sample_from_state, sample_state


class RequestsAhead:
    """--off-policy-steps K with --rollout-gpus: each step's generate request sent K steps before the step trains
    on it, so the engines generate while the trainer trains (a request goes after its step's weight sync: step s
    trains on samples of step s - K's weights, or step 0's). submit(step, prompt indices) -> ticket sends one;
    collect(ticket) -> (samples, ages in syncs) waits for it (RemoteEngine's, for the scripts' arguments).
    state_dict() waits for the requests in flight and keeps their samples (the engines would finish them before
    the next step's sync anyway): a resumed run trains on exactly those, then continues as the run would have."""

    def __init__(self, k, submit, collect):
        self.k, self.submit, self.collect = k, submit, collect
        self.in_flight = []  # [(step, prompt indices, ticket or None, samples or None)]
        self.step = 0  # the last step served (the versions of what state_dict collects)

    def next(self, step, next_prompts):
        """(prompt indices, samples with their versions) of this step, the requests up to step + K sent first."""
        self.step = step
        while len(self.in_flight) <= self.k:
            s = step + len(self.in_flight)
            prompts = next_prompts()
            self.in_flight.append((s, prompts, self.submit(s, prompts), None))
        s, prompts, ticket, samples = self.in_flight.pop(0)
        assert s == step, f"the request of step {s} taken at step {step}"
        return prompts, samples if samples is not None else self._collected(ticket, step)

    def _collected(self, ticket, step):
        samples, ages = self.collect(ticket)
        for sample, age in zip(samples, ages):
            sample.versions = [step - age] * len(sample.response_ids)
        return samples

    def state_dict(self):
        self.in_flight = [
            (s, p, None, samples if samples is not None else self._collected(ticket, self.step))
            for s, p, ticket, samples in self.in_flight
        ]
        return {"in_flight": [[s, list(p), [sample_state(x) for x in samples]] for s, p, _, samples in self.in_flight]}

    def load_state_dict(self, state):
        if state.get("groups"):
            raise ValueError(
                "--resume: this checkpoint holds partial rollouts of engines on the trainer's GPUs; resume it without "
                "--rollout-gpus"
            )
        self.in_flight = [(s, p, None, [sample_from_state(x) for x in xs]) for s, p, xs in state.get("in_flight", [])]
