"""Partial rollouts carried between steps: asynchronous RL on shared GPUs with bounded staleness.

With --off-policy-steps K > 0 the rollout of a step does not wait for its slowest responses. Groups of G samples
of (K + 1) x --prompts-per-step prompts are in flight; the step's rollout phase continues all of them, in chunks of
--partial-chunk-tokens tokens, and ends after the first chunk once --prompts-per-step groups are complete (every
sample of the group finished). The oldest complete groups are trained on; the rest (running or complete) are carried
to the next step, whose weights continue them (Kimi k1.5's and slime's partial rollouts). A continuation is a
request whose prompt is the prompt + the response ids so far: token-in token-out, never re-tokenised.

    carry = PartialRollouts(off_policy_steps=K, prompts_per_step=P, group=G, max_tokens=..., chunk_tokens=...)
    samples, sample_prompts, metrics = carry.rollout(step, sampler.next_batch(), sampler.next_batch, prompt_ids,
                                                     generate)   # each step, engine awake
    extra["partial"] = carry.state_dict()                        # in the checkpoint; load_state_dict on resume

Every response token records the step whose weights sampled it (Sample.versions) and the engine's logprob
(Sample.response_logprobs), so the trainer's corrections (common/rl/corrections.py) weigh each token against
the policy that made it. The staleness of a sample at step s is s - the version of its first token; a group
whose first tokens are older than K versions when a phase starts can no longer be trained on within the bound:
it is dropped and its prompt sampled afresh under the current weights (metric dropped_samples). So a trained
sample's staleness is always in 0..K, also after a resume (the versions are in the checkpoint).

May import common.rl (and this package): no engine is imported here, `generate` is the script's.
"""

import math
from dataclasses import dataclass

from common.rl.batch import gather_samples
from common.rollout.engine import Sample, generate_checked
from common.rollout.lengths import draw_lengths


@dataclass
class Group:
    prompt: int  # the prompt's index in the run's prompts (its answer, its reward)
    version: int  # the step whose weights sampled the first token of every sample (they start together)
    samples: list[Sample]  # G; Sample.finish_reason is None while the sample runs
    targets: list[int] | None = None  # --bench-response-lengths: each sample's exact length, drawn at its start


class PartialRollouts:
    """The carry-over store of --off-policy-steps K (module docstring): (K + 1) x prompts_per_step groups of
    `group` samples in flight, responses of at most max_tokens, continued chunk_tokens at a time. lengths: a
    benchmark's response-length spec (common/rollout/lengths.py): each new group's samples draw their lengths
    (the n-th group of the run its own draw, the same in every run of the seed) and get exactly that many tokens,
    EOS ignored, chunk by chunk."""

    def __init__(self, off_policy_steps, prompts_per_step, group, max_tokens, chunk_tokens, seed=0, lengths=None):
        if off_policy_steps < 1 or chunk_tokens < 1:
            raise ValueError(
                f"need off_policy_steps >= 1 and chunk_tokens >= 1, not {off_policy_steps}, {chunk_tokens}"
            )
        self.k, self.prompts_per_step, self.group = off_policy_steps, prompts_per_step, group
        self.max_tokens, self.chunk_tokens, self.seed = max_tokens, chunk_tokens, seed
        self.lengths, self.draws = lengths, 0  # draws: groups whose lengths were drawn so far
        self.groups: list[Group] = []  # oldest first (versions never decrease along the list)
        self.generated = 0  # tokens generated in the current (last) phase

    def rollout(self, step, new_prompts, more_prompts, prompt_ids, generate):
        """One step's rollout phase. new_prompts: this step's prompt indices (the sampler's batch); more_prompts():
        another batch, called while fewer than (K + 1) x prompts_per_step groups are in flight (the first step, or
        a resume without carried samples); prompt_ids[i]: prompt i's token ids; generate(rows, max_tokens, seed):
        one Sample per row of token ids (n = 1, every token's logprob), the same on every rank (with lengths:
        generate(rows, max_tokens, seed, lengths=[...]), row i exactly lengths[i] tokens, EOS ignored).
        Returns (samples, prompts, metrics): prompts_per_step complete groups, oldest first, G samples each with
        their versions (group-major); each group's prompt index; the step's staleness metrics."""
        dropped = self.admit(step, new_prompts, more_prompts, prompt_ids)
        calls, chunks, self.generated = 0, 0, 0
        while self.running():
            if chunks and self.complete() >= self.prompts_per_step:
                break  # at least one chunk each phase: what runs moves on under the newest weights
            calls = self._chunk(step, generate, calls)
            chunks += 1
        done = self.take()
        return [s for g in done for s in g.samples], [g.prompt for g in done], self.metrics(step, done, dropped, chunks)

    def admit(self, step, new_prompts, more_prompts, prompt_ids):
        """A phase's start: the groups too old to train within the bound dropped, their prompts and new_prompts
        started as new groups of version `step`, more_prompts() while fewer than (K + 1) x prompts_per_step are in
        flight. Returns the groups dropped."""
        self._settle()
        stale = [g for g in self.groups if g.version < step - self.k]  # would be trained beyond the bound
        self.groups = [g for g in self.groups if g.version >= step - self.k]
        for prompt in [g.prompt for g in stale] + list(new_prompts):  # a dropped group's prompt, sampled afresh
            self.groups.append(self._new_group(prompt, step, prompt_ids))
        while len(self.groups) < (self.k + 1) * self.prompts_per_step:
            self.groups += [self._new_group(p, step, prompt_ids) for p in more_prompts()]
        return len(stale)

    def running(self):
        return any(s.finish_reason is None for g in self.groups for s in g.samples)

    def complete(self):
        return sum(map(_complete, self.groups))

    def take(self):
        """The oldest prompts_per_step complete groups, out of the store (there must be so many)."""
        self._settle()
        done = [g for g in self.groups if _complete(g)][: self.prompts_per_step]
        assert len(done) == self.prompts_per_step, "every sample ends within max_tokens"
        taken = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return done

    def _settle(self):
        """Each group's version: its first tokens' once it has any (on shared GPUs the step that started it; streaming
        on engines of their own, a weight sync may come between a group's start and its first chunk)."""
        for g in self.groups:
            if g.samples[0].versions:
                g.version = g.samples[0].versions[0]

    def _new_group(self, prompt, step, prompt_ids):
        ids = list(map(int, prompt_ids[prompt]))
        targets = None
        if self.lengths:  # round -1: apart from the synchronous loop's draws
            targets = draw_lengths(self.lengths, 1, self.group, seed=self.seed, step=self.draws, round_=-1)[0]
            self.draws += 1
        return Group(prompt, step, [Sample(ids, [], [], None, versions=[]) for _ in range(self.group)], targets)

    def _chunk(self, step, generate, calls):
        """Every running sample continued by up to chunk_tokens tokens under this step's weights (plan's calls, each
        generated and applied). Returns the calls made so far."""
        for call in self.plan():
            self.apply(step, call, generate(*self.request(call, self.call_seed(step, calls))))
            calls += 1
        return calls

    def call_seed(self, version, calls):
        """The seed of an engine call under the weights of step `version`, after `calls` calls (round 0 of that
        formula is the synchronous loop's)."""
        return self.seed * 100_003 + version * 1009 + 7919 * (calls + 1)

    def plan(self):
        """One chunk's engine calls, each (samples, their budgets, their caps): a call per remaining budget (a budget
        is chunk_tokens but near max_tokens), or with drawn lengths one call whose rows each get their own exact
        budget (a call per budget would be one per distinct draw: ~100 small calls a chunk on a lognormal profile).
        A sample's cap: its length at most (exactly, with drawn lengths)."""
        running = [(s, g.targets[j] if g.targets else self.max_tokens) for g in self.groups
                   for j, s in enumerate(g.samples) if s.finish_reason is None]  # fmt: skip
        budget = [min(self.chunk_tokens, cap - len(s.response_ids)) for s, cap in running]
        if self.lengths:
            return [([s for s, _ in running], budget, [cap for _, cap in running])]
        calls = []
        for t in sorted(set(budget), reverse=True):
            mine = [(s, cap) for (s, cap), b in zip(running, budget) if b == t]
            calls.append(([s for s, _ in mine], [t] * len(mine), [cap for _, cap in mine]))
        return calls

    def request(self, call, seed):
        """generate's arguments for one of plan's calls: (rows, max_tokens, seed) or, with drawn lengths,
        (rows, max_tokens, seed, lengths)."""
        batch, tokens, _ = call
        rows = [s.prompt_ids + s.response_ids for s in batch]
        return (rows, max(tokens), seed, tokens) if self.lengths else (rows, tokens[0], seed)

    def apply(self, version, call, outs):
        """One engine call's Samples (outs) appended to the samples of plan's call that it continued, their tokens
        recorded as sampled by the weights of step `version`."""
        batch, tokens, caps = call
        self.generated += sum(len(out.response_ids) for out in outs)
        for s, out, asked, cap in zip(batch, outs, tokens, caps, strict=True):
            s.response_ids += out.response_ids
            s.response_logprobs += out.response_logprobs
            s.versions += [version] * len(out.response_ids)
            # ended: on a stop token, at max_tokens (its drawn length), or short of the chunk (max_model_len)
            if out.finish_reason == "stop" or len(s.response_ids) >= cap:
                s.finish_reason = out.finish_reason
            elif len(out.response_ids) < asked:
                s.finish_reason = "length"

    def metrics(self, step, done, dropped_groups, chunks):
        """The staleness metrics of a phase that took the groups `done` (docs/async.md#metrics)."""
        samples = [s for g in done for s in g.samples]
        ages = [step - g.version for g in done for _ in g.samples]  # the version of every sample's first token
        metrics = {f"staleness_share_{a}": sum(age == a for age in ages) / len(ages) for a in range(self.k + 1)}
        metrics.update(
            staleness_mean=sum(ages) / len(ages),
            partial_frac=sum(len(set(s.versions)) > 1 for s in samples) / len(samples),  # made by several policies
            dropped_samples=dropped_groups * self.group,  # first tokens older than K versions: sampled afresh
            carried_samples=sum(len(g.samples) for g in self.groups),  # in flight into the next step
            rollout_chunks=chunks,
            generated_tokens=self.generated,  # this phase's, of every sample in flight (not the trained ones')
        )
        return metrics

    def state_dict(self):
        """The carried groups, JSON-able (the checkpoint's train_state.json): ids, logprobs, finish reasons and
        versions (as [version, count] runs) of every sample."""
        self._settle()
        return {
            "off_policy_steps": self.k,
            "draws": self.draws,
            "groups": [
                {
                    "prompt": g.prompt,
                    "version": g.version,
                    "samples": [sample_state(s) for s in g.samples],
                    "targets": g.targets,
                }
                for g in self.groups
            ],
        }

    def load_state_dict(self, state):
        self.groups = [
            Group(g["prompt"], g["version"], [sample_from_state(s) for s in g["samples"]], g.get("targets"))
            for g in state["groups"]
        ]
        self.draws = state.get("draws", 0)
        if any(len(g.samples) != self.group for g in self.groups):
            raise ValueError(
                f"--resume: the checkpoint's carried groups have {len(self.groups[0].samples)} samples, this run "
                f"--samples-per-prompt {self.group}: resume with the run's --samples-per-prompt"
            )


def _complete(group):
    return all(s.finish_reason is not None for s in group.samples)


def sample_state(s):
    runs = []
    for v in s.versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    logprobs = [None if math.isnan(x) else x for x in s.response_logprobs]  # JSON has no NaN
    return dict(prompt_ids=s.prompt_ids, response_ids=s.response_ids, logprobs=logprobs, finish=s.finish_reason,
                versions=runs)  # fmt: skip


def sample_from_state(d):
    versions = [v for v, count in d["versions"] for _ in range(count)]
    logprobs = [math.nan if x is None else x for x in d["logprobs"]]
    return Sample(list(d["prompt_ids"]), list(d["response_ids"]), logprobs, d["finish"], versions=versions)


def spread_generate(engine, replica, num_replicas, first_of_replica, temperature, top_p):
    """PartialRollouts.rollout's generate on this run's engines: row i runs on replica i % num_replicas (seeded
    seed + replica), every rank gets every row's Sample back in row order. All ranks call it."""

    def generate(rows, max_tokens, seed, lengths=None):  # lengths: row i gets exactly lengths[i] tokens, EOS ignored
        mine_rows = rows[replica::num_replicas]
        mine = generate_checked(
            engine,
            mine_rows,
            "all",  # every token's engine logprob: the behaviour policy of the corrections
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed + replica,
            response_lengths=None if lengths is None else list(lengths[replica::num_replicas]),
        )
        gathered = gather_samples(mine if first_of_replica else [])  # replica-major
        order = [i for r in range(num_replicas) for i in range(r, len(rows), num_replicas)]
        out = [None] * len(rows)
        for i, s in zip(order, gathered, strict=True):
            out[i] = s
        return out

    return generate
