"""Rollout engines: sample responses from the current policy, with per-token logprobs.

Every engine has the same small interface (`RolloutEngine`), so the training scripts read
the same on a laptop and on a GPU cluster:

    engine.wake()                                   # GPU: bring weights (+ KV cache) back
    engine.update_weights(export_hf_weights(...))   # stream (hf_name, full tensor) pairs in
    samples = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=256, seed=step)
    engine.sleep()                                  # GPU: free memory for the update

`HFEngine` (common/rollout/hf_engine.py) is the CPU fallback: a transformers AutoModelForCausalLM with our own batched
sampling loop over a KV cache. It serves the embedded tiny default (`python train_grpo.py`)
and the tests; it is not meant for real models.
`VLLMEngine` (GPU: vLLM colocated in the torchrun processes) lives in common/rollout/vllm_engine.py;
`make_engine` (common/rollout/engines.py) picks one, and importing this module never imports vLLM.

Logprob semantics (the trainer must recompute the same quantity, see rl.py):
  response_logprobs[t] = log_softmax(logits_t / temperature)[token_t], over the FULL vocab.
  - With top_p < 1 the token is drawn from the nucleus (renormalised), but the logprob we
    return is still the one above, i.e. BEFORE the top-p filter and renormalisation. It is
    what a trainer recomputes from its own logits; the difference to the true sampling
    probability is log(nucleus mass) <= 0. (vLLM's "processed_logprobs" mode would instead
    return the renormalised nucleus logprob, so pick the matching mode there.)
  - temperature == 0 means greedy (argmax); the logprob is then log_softmax(logits) (T = 1).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with (and includes) eos when finish_reason == "stop"
    response_logprobs: list[float]  # one per response token, see the module docstring
    finish_reason: str  # "stop" (eos sampled) | "length" (max_tokens reached)
    # generate(return_routes=True), MoE models: (prompt + response - 1, M, k) int16, the top-k experts
    # each token the engine ran went to in each of the model's M MoE layers (all but the last
    # token, which it sampled and never ran); for routing replay (common/rollout/routes.py)
    routes: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # agentic episodes (common/rollout/episodes.py): one per response token, 1 where the model sampled it,
    # 0 on an observation's tokens (tool output, feedback: out of the loss, the KL and the entropy); None: all 1
    response_mask: list[int] | None = None
    # agentic episodes: the episode's reward and counts (turns, tool_calls, ...), for the step's metrics
    episode: dict | None = field(default=None, compare=False)
    # --off-policy-steps (common/rollout/partial.py): one per response token, the step whose weights sampled it
    # (a partial rollout's tokens come from several); None: all from the step that trains on it
    versions: list[int] | None = None


# --rollout-logprobs: which samples bring the engine's own logprobs (generate's logprob_samples)
ROLLOUT_LOGPROBS = {"prefill": 0, "one-per-prompt": 1, "all": None, "none": 0}
# prompt + response tokens the prefill check scores at most: for prompt logprobs vLLM
# materialises each prefill chunk's (tokens, vocabulary) logits in fp32 and their log-softmax,
# outside its memory budget (4096 x 152k x 4 B = 2.5 GB each), and a long prefill costs time
PREFILL_CHECK_TOKENS = 4096


def rollout_logprobs_mode(requested, temperature, correction="none"):
    """The --rollout-logprobs mode of a run (ValueError: what to change). Default: all with a
    --rollout-correction (its weights need every sample's), else prefill at temperature 1 (the
    check costs no decode time), else one-per-prompt (vLLM's prompt logprobs ignore temperature)."""
    if requested is None:
        return "all" if correction != "none" else "prefill" if temperature == 1.0 else "one-per-prompt"
    if correction != "none" and requested != "all":
        raise ValueError(
            f"--rollout-correction {correction} (or --tis-cap) needs the rollout logprobs of every sample: "
            "--rollout-logprobs all"
        )
    if requested == "prefill" and temperature != 1.0:
        raise ValueError(
            f"--rollout-logprobs prefill scores a sample with the engine's prompt logprobs, which "
            f"vLLM computes at temperature 1, not --temperature {temperature}: use one-per-prompt"
        )
    return requested


def generate_checked(engine, prompts, mode, **kwargs):
    """engine.generate(prompts, **kwargs) with --rollout-logprobs `mode`: the samples that carry
    the engine's logprobs (the others NaN) for logprob_mismatch and --rollout-correction.
    prefill: sampling asks for none (vLLM computes the batch's log-softmax at every decode step
    once any request asks: 3% of the 7B rollout, docs/performance.md); afterwards one sample,
    the first that ended on EOS (else the first: --mask-truncated leaves cut-off ones out of
    the trainer's passes), is scored in one prefill pass (engine.score; its first
    PREFILL_CHECK_TOKENS tokens, the rest NaN like the other samples), which sees the synced
    weights as the sampler does, so a sync that did not happen still shows
    (tests/gpu/test_vllm_agreement.py)."""
    samples = engine.generate(prompts, logprob_samples=ROLLOUT_LOGPROBS[mode], **kwargs)
    if mode == "prefill" and samples:
        pick = next((i for i, s in enumerate(samples) if s.finish_reason == "stop"), 0)
        chosen = samples[pick]  # its first PREFILL_CHECK_TOKENS tokens (prompt included) are scored
        keep = max(0, min(len(chosen.response_ids), PREFILL_CHECK_TOKENS - len(chosen.prompt_ids)))
        part = Sample(chosen.prompt_ids, chosen.response_ids[:keep], [], chosen.finish_reason)
        scored = engine.score([part])[0] if keep else []
        for s in samples:
            s.response_logprobs = [math.nan] * len(s.response_ids)
        chosen.response_logprobs = scored + [math.nan] * (len(chosen.response_ids) - keep)
    return samples


def empty_responses_warning(samples, step):
    """The warning for a step whose every response is empty or the stop token alone (the engine
    ended each at once: nothing to reward, nothing learned), saying what to check; else None.
    The scripts print it once per run."""
    if not samples or any(len(s.response_ids) > 1 or s.finish_reason != "stop" for s in samples if s.response_ids):
        return None
    return (
        f"warning: step {step}: all {len(samples)} responses are empty (each stopped at its first token). Check "
        "the prompt format (a chat model needs its chat template, so no --raw-prompts; a base model may need "
        "--raw-prompts), the end-of-sequence ids in the model's generation_config.json (eos_token_id), and "
        "--temperature / --max-new-tokens"
    )


def rollout_replica(rank, rollout_tp, world_size=None):
    """(replica index, number of replicas) of this rank: vLLM's TP groups are runs of
    rollout_tp consecutive ranks (vllm/distributed/parallel_state.py), one replica each."""
    world_size = dist.get_world_size() if world_size is None else world_size
    if world_size % rollout_tp:
        raise ValueError(f"--rollout-tp {rollout_tp} must divide the world size {world_size}")
    return rank // rollout_tp, world_size // rollout_tp


def replica_share(items, replica, num_replicas):
    """This replica's contiguous share of items (sizes differ by at most one), so the
    replicas' results concatenated in replica order are in the original order."""
    base, extra = divmod(len(items), num_replicas)
    start = replica * base + min(replica, extra)
    return items[start : start + base + (replica < extra)]


def cap_max_model_len(max_model_len, max_positions, rank=0):
    """max_model_len (prompt + response tokens per request) capped at the model's
    max_position_embeddings, as vLLM requires; said on rank 0 when it is. Both engines use it, so
    a run ends its samples at the same length on a CPU and on a GPU (finish_reason "length")."""
    if max_positions and max_model_len > max_positions:
        if rank == 0:
            print(
                f"rollout: max_model_len {max_model_len} (the longest prompt + --max-new-tokens) capped at the "
                f"model's max_position_embeddings {max_positions}: a response ends where prompt + response reach "
                f"{max_positions} tokens",
                flush=True,
            )
        return max_positions
    return max_model_len


class RolloutEngine:
    """The interface every rollout engine implements (HFEngine here; VLLMEngine on GPUs)."""

    expert_blocks = False  # True: update_weights takes routed experts as (module, common.weights.ExpertBlock)
    local_reads = None  # else export_hf_weights(local_reads=): update_weights takes TP pieces (LocalShard)
    behind = False  # True: update_weights may return before it has read the parameters (settle)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int,
        logprob_samples: int | None = None,
        response_lengths: list[int] | None = None,
        return_routes: bool = False,
    ) -> list[Sample]:
        """Sample n responses per prompt (token ids). Returns len(prompts) * n Samples in
        prompt-major order: samples[i * n + j] is the j-th sample of prompt i.
        Deterministic for a given seed (on one engine, batch and software stack).
        logprob_samples: only the first logprob_samples samples of each prompt must carry
        response_logprobs (None: all); an engine may return NaNs for the others when
        logprobs cost it time (vLLM: ~20% of its throughput at 1.5B, docs/performance.md).
        response_lengths: a benchmark's lengths (common/rollout/lengths.py), one per sample in
        the same prompt-major order: sample k gets exactly response_lengths[k] tokens, EOS
        ignored, max_tokens unused; finish_reason "length".
        return_routes: each Sample also carries its MoE routes (Sample.routes)."""
        raise NotImplementedError

    # Turns of agentic episodes (common/rollout/episodes.py): add_turn queues one request, finished_turns
    # returns those done. This default runs the queued turns in one generate call per wave, the
    # whole wave seeded by its first turn (the driver waits for every pending environment step
    # first, so a seeded run replays exactly); VLLMEngine overrides both with vLLM's request-level
    # API, so an episode waiting for its tool holds up no other episode's generation.
    turns_in_waves = True
    # At rollout TP > 1 (VLLMEngine) the ranks of a replica must give their engines the same waves, while
    # environments may answer differently on each rank (a tool that reads the clock, a timeout): the
    # replica's first rank (wave_leader, a global rank) runs the episodes and sends each wave over
    # wave_group (gloo, the replica's ranks); the others generate what it sends (follow_waves). The first
    # rank's samples are the replica's (the scripts gather only those).
    wave_group = None
    wave_leader = 0

    @property
    def wave_follower(self):
        """True on the ranks of a replica that generate the waves its first rank sends."""
        return self.wave_group is not None and dist.get_rank() != self.wave_leader

    def _send_wave(self, wave):
        """All ranks of wave_group call this: the leader's wave (None: the episodes ended) -> every rank."""
        box = [wave]
        dist.broadcast_object_list(box, src=self.wave_leader, group=self.wave_group)
        return box[0]

    def follow_waves(self):
        """A follower's side of run_episodes: generate each wave the leader sends, until it says the
        episodes ended (the results are the leader's too: the same engine inputs, the same samples)."""
        while (wave := self._send_wave(None)) is not None:
            self._run_wave(wave)

    def end_waves(self):
        """The leader's last word to the followers when its episodes ended (no-op without followers)."""
        if self.wave_group is not None and not self.wave_follower:
            self._send_wave(None)

    def add_turn(self, key, prompt_ids, max_tokens, temperature, top_p, seed):
        """Queue one turn: sample at most max_tokens after prompt_ids (ids, not text), with logprobs."""
        self.__dict__.setdefault("_queued_turns", []).append(
            (key, list(prompt_ids), max_tokens, temperature, top_p, seed)
        )

    def finished_turns(self):
        """[(key, Sample)] of turns done (the Sample's prompt_ids are the turn's prompt); blocks until
        at least one is done while any is queued; [] when none is. A wave runs in key order, not in the
        order its turns were queued (the order environments finished in): a seeded run replays exactly.
        With followers (wave_group) the wave goes to them first."""
        queued, self._queued_turns = self.__dict__.get("_queued_turns", []), []
        if not queued:
            return []
        queued.sort(key=lambda q: q[0])
        if self.wave_group is not None:
            self._send_wave(queued)
        return self._run_wave(queued)

    def _run_wave(self, queued):
        """[(key, Sample)] of one wave: one generate call per sampling setting, seeded by its first turn."""
        done = []
        for params in dict.fromkeys((t, p) for _, _, _, t, p, _ in queued):  # one call per sampling setting
            wave = [q for q in queued if (q[3], q[4]) == params]
            samples = self.generate(
                [q[1] for q in wave],
                n=1,
                temperature=params[0],
                top_p=params[1],
                max_tokens=max(q[2] for q in wave),
                seed=wave[0][5],
            )
            for (key, _, max_tokens, *_), s in zip(wave, samples):
                if len(s.response_ids) > max_tokens:  # a shorter budget than the wave's: cut, as the engine would
                    s = Sample(s.prompt_ids, s.response_ids[:max_tokens], s.response_logprobs[:max_tokens], "length")
                done.append((key, s))
        return done

    def score(self, samples: list[Sample]) -> list[list[float]]:
        """log_softmax(logits)[token] of every response token of each sample at temperature 1
        over the full vocabulary, from one forward pass over prompt + response (no sampling):
        the trainer's logprobs at T=1. Positions the engine cannot hold are NaN."""
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, full tensor) pairs into the engine's model. Consumes the whole
        iterator even on error (the producer may run collectives on every rank), then raises."""
        raise NotImplementedError

    def settle(self) -> None:
        """Return once the last update_weights has read every parameter it sends (engines on GPUs of their own
        may send behind the trainer's next passes: common/rollout/remote.py); the training scripts call it before
        anything changes the parameters. Here: at once (update_weights returns when done)."""

    def sleep(self) -> None:
        """Release accelerator memory (weights + KV cache) for the training phase."""

    def wake_weights(self) -> None:
        """Take the weight memory back before a weight sync (vLLM: wake_up(tags=["weights"]))."""

    def wake_kv_cache(self) -> None:
        """Take the KV-cache memory back after the sync, before generation."""

    def wake(self) -> None:
        """Take the accelerator memory back before a weight sync / generation."""
