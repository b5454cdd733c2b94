"""A step's samples and their rewards, as both training scripts draw them (steps 2 and 3 of their loops).

    rollouts = StepRollouts(args, task, engine, info, rollout_tp, sampler, reward_model)  # rollouts.carry: in flight
    if engine is None:                                  # --load-rollouts
        samples, rewards = rollouts.load(step)
    else:
        with colo.rollout(timer, memory):               # the weight sync first; the engine sleeps after
            samples, rewards, group_prompts = rollouts.sample(step, timer, metrics)
        rewards = rollouts.add_reward_model(samples, rewards, group_prompts, timer, metrics)
    rollouts.check(step, samples, rewards, metrics)

sample: the prompt sampler's next batch (the same on every rank); each vLLM replica samples --samples-per-prompt
responses for its share of the prompts (multi-turn episodes with --env, common/rollout/episodes.py;
--off-policy-steps: the oldest complete groups of the partial rollouts in flight, common/rollout/partial.py, with
--rollout-gpus the request sent a step earlier, common/rollout/ahead.py, or with --rollout-gpus and
--partial-chunk-tokens the complete groups of the engines' stream, common/rollout/stream.py;
--bench-response-lengths: each sample its drawn length); the ranks of one vLLM TP group hold the same samples (the
first contributes), then every rank has all of them, prompt-major. The reward: the environment's with --env, else
--rule-reward-weight x the rule reward of the decoded response (+ DAPO's soft overlong penalty, train_grpo.py);
DAPO's dynamic sampling (train_grpo.py) samples more prompts, the engine still awake. add_reward_model: +
--reward-model-weight x its score, on the trainer's GPUs while the engine sleeps.
"""

import os

import torch

from common.rl import batch as B
from common.rl import dapo
from common.rollout.ahead import RequestsAhead
from common.rollout.engine import ROLLOUT_LOGPROBS, empty_responses_warning, generate_checked, rollout_replica
from common.rollout.episodes import episode_metrics, run_episodes
from common.rollout.lengths import draw_lengths
from common.rollout.partial import PartialRollouts, spread_generate
from common.rollout.stream import StreamingRollouts
from common.run import flags_rollout as FR
from common.run.dist import print0
from common.train.guard import check_finite
from common.train.save import broadcast_from_rank0


class StepRollouts:
    """Steps 2 and 3 of a training step (module docstring) for a run's flags (args), task (common/run/task.py), engine
    (None with --load-rollouts), process info, rollout TP, prompt sampler (common/run/data.py) and reward model
    (None without one); carry: the partial rollouts of --off-policy-steps (None when synchronous). Flags only
    train_grpo.py has (--dynamic-sampling, --overlong-buffer, --bench-response-lengths) count as off where a
    script has none."""

    def __init__(self, args, task, engine, info, rollout_tp, sampler, reward_model):
        self.args, self.task, self.engine, self.sampler, self.reward_model = args, task, engine, sampler, reward_model
        self.group = args.samples_per_prompt
        self.carry = None  # --off-policy-steps K: groups in flight between steps, continued under newer weights
        remote = getattr(args, "rollout_gpus", 0)
        if args.off_policy_steps and remote and not args.partial_chunk_tokens:  # engines of their own, one step ahead
            self.carry = RequestsAhead(
                args.off_policy_steps, lambda s, p: engine.submit(**self._request(s, p, 0)), engine.collect
            )
        elif args.off_policy_steps:  # (its state is in the checkpoint: the scripts save and resume it)
            self.carry = PartialRollouts(
                args.off_policy_steps,
                args.prompts_per_step,
                self.group,
                args.max_new_tokens,
                args.partial_chunk_tokens,
                args.seed,
                lengths=getattr(args, "bench_response_lengths", None),  # a benchmark's exact lengths, drawn per group
            )
            if remote:  # engines of their own, generating all the time: its chunks run in a thread
                self.carry = StreamingRollouts(engine, self.carry, args.temperature, args.top_p)
        self.replica, self.num_replicas = rollout_replica(info.rank, rollout_tp, info.world_size)
        self.first_of_replica = info.rank % rollout_tp == 0
        self.master_process, self.device = info.master_process, info.device
        self.warned_empty = False  # a step whose every response ended at once: said once a run

    def sample(self, step, timer, metrics):
        """This step's samples and rewards (engine awake) -> (samples, rewards (N,), each group's prompt index;
        None after dynamic sampling, which preflight refuses with a reward model)."""
        args = self.args
        if isinstance(self.carry, RequestsAhead):  # --rollout-gpus: sent K steps ago, generated meanwhile
            return self._ahead(step, timer, metrics)
        if isinstance(self.carry, StreamingRollouts):  # --rollout-gpus --partial-chunk-tokens: generated all along
            return self._stream(step, timer, metrics)
        prompts = self.sampler.next_batch()
        if self.carry:  # --off-policy-steps: the oldest complete groups in flight, the rest carried on
            with timer("rollout"):
                generate = spread_generate(
                    self.engine, self.replica, self.num_replicas, self.first_of_replica, args.temperature, args.top_p
                )
                samples, group_prompts, carried = self.carry.rollout(
                    step, prompts, self.sampler.next_batch, self.task.prompt_ids, generate
                )
            metrics.update(carried)  # staleness_share_*, partial_frac, dropped_samples, ...
            return samples, self.rewards(samples, group_prompts, timer, metrics), group_prompts
        samples, rewards, group_prompts = self._round(step, prompts, 0, timer, metrics)
        if getattr(args, "dynamic_sampling", False):  # DAPO: only groups whose rewards differ, more prompts until full
            samples, rewards, sampling = dapo.dynamic_sampling(
                samples,
                rewards,
                self.group,
                max_rounds=args.max_sampling_rounds,
                more=lambda round_: self._round(step, self.sampler.next_batch(), round_, timer, metrics)[:2],
            )
            metrics.update(sampling)
            group_prompts = None  # the kept groups come from several rounds
        return samples, rewards, group_prompts

    def _ahead(self, step, timer, metrics):
        """--rollout-gpus with --off-policy-steps K: this step's samples, from the request sent K steps ago (the
        requests up to step + K sent now, after this step's weight sync); each token's version is the step whose
        weights the engines held."""
        with timer("rollout"):
            prompts, local = self.carry.next(step, self.sampler.next_batch)
            samples = B.gather_samples(local if self.first_of_replica else [])
        ages = [step - s.versions[0] if s.versions else 0 for s in samples]
        metrics.update({f"staleness_share_{a}": ages.count(a) / len(ages) for a in range(self.carry.k + 1)})
        metrics.update(staleness_mean=sum(ages) / len(ages))
        if self.master_process:  # the engines' own time for it (the rest of rollout_s was hidden by training)
            metrics["engine_busy_sec"] = self.engine.last_generate_s
        group_prompts = list(prompts)
        return samples, self.rewards(samples, group_prompts, timer, metrics), group_prompts

    def _stream(self, step, timer, metrics):
        """--rollout-gpus with partial rollouts: the oldest complete groups the engines' stream holds, from the
        first trainer rank to every other (which groups are complete depends on timing: only the first knows)."""
        with timer("rollout"):
            taken = None
            if self.master_process:
                taken = self.carry.take(step, self.sampler.next_batch(), self.sampler.next_batch, self.task.prompt_ids)
            samples, group_prompts, carried = broadcast_from_rank0(taken)
        metrics.update(carried)  # staleness_share_*, partial_frac, dropped_samples, ..., engine_busy_sec
        return samples, self.rewards(samples, group_prompts, timer, metrics), group_prompts

    def _request(self, step, prompts, round_):
        """generate's arguments for this replica's share of `prompts` at this step and round."""
        args, group = self.args, self.group
        exact = None  # --bench-response-lengths: sample j of prompt i gets exactly lengths[i][j] tokens
        if getattr(args, "bench_response_lengths", None):
            lengths = draw_lengths(
                args.bench_response_lengths, len(prompts), group, seed=args.seed, step=step, round_=round_
            )
            exact = [n for row in lengths[self.replica :: self.num_replicas] for n in row]  # this replica's prompts
        return dict(
            prompts=[self.task.prompt_ids[i] for i in prompts[self.replica :: self.num_replicas]],
            logprob_samples=ROLLOUT_LOGPROBS[args.rollout_logprobs],
            n=group,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            seed=self._seed(step, round_),
            response_lengths=exact,
            return_routes=args.routing_replay == "rollout",
        )

    def _seed(self, step, round_):
        return self.args.seed * 100_003 + step * 1009 + self.replica + 7919 * round_

    def _round(self, step, prompts, round_, timer, metrics):
        """One sampling round of `prompts` (round_ > 0: dynamic sampling's extra rounds, their own seeds)."""
        args, group = self.args, self.group
        with timer("rollout"):
            mine = prompts[self.replica :: self.num_replicas]
            if self.task.make_env:  # --env: multi-turn episodes, observations masked
                items = [self.task.items[i] for i in mine]
                local = run_episodes(
                    self.engine,
                    self.task.codec,
                    self.task.make_env,
                    items,
                    n=group,
                    seed=self._seed(step, round_),
                    **FR.episode_settings(args),
                )
            else:
                request = self._request(step, prompts, round_)
                request.pop("logprob_samples")  # (generate_checked's from the mode)
                local = generate_checked(self.engine, request.pop("prompts"), args.rollout_logprobs, **request)
            samples = B.gather_samples(local if self.first_of_replica else [])
        group_prompts = [i for r in range(self.num_replicas) for i in prompts[r :: self.num_replicas]]
        return samples, self.rewards(samples, group_prompts, timer, metrics), group_prompts

    def rewards(self, samples, group_prompts, timer, metrics):
        """The environment's reward of each episode, or the rule reward of each decoded response (x its weight;
        + DAPO's overlong penalty) -> (N,) float32."""
        args, task = self.args, self.task
        if task.make_env:
            return torch.tensor([s.episode["reward"] for s in samples], dtype=torch.float32)
        with timer("reward"):
            answers = [task.items[i]["answer"] for i in group_prompts for _ in range(self.group)]
            texts = [task.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
            rule = torch.tensor([task.reward_fn(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
            rewards = args.rule_reward_weight * rule
            if args.teacher:  # the task's score, measured even when not optimised (--rule-reward-weight 0)
                metrics["rule_reward_mean"] = rule.mean().item()
            if getattr(args, "overlong_buffer", 0):
                rewards += dapo.overlong_penalty(
                    [len(s.response_ids) for s in samples],
                    args.max_new_tokens,
                    args.overlong_buffer,
                    args.overlong_penalty_factor,
                )
        return rewards

    def add_reward_model(self, samples, rewards, group_prompts, timer, metrics):
        """rewards + --reward-model-weight x the reward model's score of each (prompt, response), the engine asleep
        (saved with --save-rollouts: replayed as they are); rewards unchanged without a reward model."""
        if self.reward_model is None:
            return rewards
        with timer("reward_model"):
            order = [i for i in group_prompts for _ in range(self.group)]
            scores = self.reward_model.score(
                [self.task.items[i]["prompt"] for i in order],
                [self.task.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples],
                self.device,
            )
        metrics.update(rm_score_mean=scores.mean().item(), rm_score_std=scores.std().item())
        return rewards + self.args.reward_model_weight * scores

    def load(self, step):
        """--load-rollouts: the saved run's samples and rewards of this step (the prompt sampler moves on as in
        the run that saved them)."""
        self.sampler.next_batch()
        saved = torch.load(os.path.join(self.args.load_rollouts, f"step_{step:06d}.pt"), weights_only=False)
        return saved["samples"], saved["rewards"]

    def check(self, step, samples, rewards, metrics):
        """Finite rewards (else the run stops, exit 3), --env's episode metrics, the warning for a step whose every
        response ended at once (once a run), and --save-rollouts."""
        check_finite("rewards", rewards, step=step)
        metrics.update(episode_metrics(samples))  # --env: turns, tool calls/errors/timeouts, env_reward
        empty = None if self.warned_empty else empty_responses_warning(samples, step)
        if empty:  # nothing to reward, nothing to learn: what to check
            print0(empty)
            self.warned_empty = True
        if self.args.save_rollouts and self.master_process:
            os.makedirs(self.args.save_rollouts, exist_ok=True)
            path = os.path.join(self.args.save_rollouts, f"step_{step:06d}.pt")
            torch.save({"samples": samples, "rewards": rewards}, path)
