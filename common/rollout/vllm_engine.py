"""VLLMEngine: the GPU rollout engine, a vLLM 0.26 LLM living inside the torchrun processes.

Kept apart from common/rollout/engine.py so that `import common.rollout.engine` never imports vLLM (it
exists on GPU machines only); the training script imports this module when --engine vllm.

Colocation (see shared/device/README.md, where each call below was measured on H200s):
  - every rank builds one engine with distributed_executor_backend="external_launcher":
    vLLM reuses the torch.distributed default group the script already initialised and runs
    in-process (no engine subprocess). Its TP groups are runs of rollout_tp consecutive
    ranks; each group is one rollout replica. All ranks construct the engine together
    (vLLM creates its groups and agrees on the KV-cache size with collectives).
  - within a replica every rank must call generate() with the same prompts and seed (each
    rank schedules independently and deterministically); replicas get different prompts:
    rollout_replica() and replica_share() (common/rollout/engine.py) say which.
  - memory: sleep() = sleep(level=2) discards weights and KV cache (level 1 would copy the
    weights to CPU: 9.8 s at 7B, wasted since the next sync overwrites them). The step is
        engine.wake_weights(); engine.update_weights(export_hf_weights(...)); engine.wake_kv_cache()
        samples = engine.generate(...); engine.sleep(); <train>
    After a level-2 sleep the weights are garbage until the next update_weights, so
    generate() refuses to run before a sync (likewise with load_format="dummy").

Logprobs (must equal common/rollout/engine.py's HFEngine semantics, log_softmax(logits / T)[token]):
  vLLM's logprobs_mode="processed_logprobs" returns log_softmax of the logits after the
  sampling transforms: temperature, then top-k/top-p (v1/sample/sampler.py and the V2 runner's
  v1/worker/gpu/sample/sampler.py of 0.26.0). "raw_logprobs" (the default) ignores the
  temperature, so it is wrong for every T != 1.
  - top_p == 1: exactly HFEngine's quantity (and greedy, T = 0: log_softmax(logits)).
  - top_p < 1: vLLM renormalises over the nucleus, so the value is HFEngine's plus
    -log(nucleus mass) >= 0, the true log-probability of the sampling distribution. The
    trainer must then recompute with the same top-p filter or not compare against it
    (a warning is printed once).
"""

import atexit
import importlib.util
import json
import math
import os
import random
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist

from common.model.bridge_vl import checkpoint_name, text_config, vision_language_config
from common.rollout.engine import RolloutEngine, Sample, cap_max_model_len, replica_share, rollout_replica  # noqa: F401
from common.rollout.routes import routes_from_vllm
from common.rollout.vllm_experts import FusedExperts
from common.rollout.vllm_turns import RequestTurns
from common.rollout.weight_replay import WritePlan


def eos_token_ids_of(hf_dir):
    """The ids generation stops at: generation_config.json's eos_token_id (instruct models add
    e.g. <|im_end|> there), else config.json's, as HFEngine does through transformers."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


class VLLMEngine(RequestTurns, FusedExperts, RolloutEngine):
    """vLLM colocated with the trainer on the same GPUs. All ranks construct it together,
    after common.run.dist.init_distributed (torch.distributed must exist). Agentic turns go to vLLM
    request by request (RequestTurns, common/rollout/vllm_turns.py); a sync copies routed experts straight
    into vLLM's fused parameters (FusedExperts, common/rollout/vllm_experts.py)."""

    expert_blocks = True  # routed experts arrive stacked per layer (export_hf_weights(expert_blocks=True))

    def __init__(
        self,
        hf_dir,
        rollout_tp=1,
        gpu_memory_utilization=0.5,
        max_model_len=4096,
        dtype="bfloat16",
        seed=0,
        enforce_eager=False,
        enable_sleep=True,
        load_format="dummy",
        eos_token_ids=None,
        return_routes=False,
        batch_invariant=False,
        **llm_kwargs,
    ):
        """hf_dir: config.json (+ generation_config.json); with load_format="dummy" (default)
        no weights are read, the first update_weights provides them. "auto" loads hf_dir's
        safetensors. gpu_memory_utilization: the fraction of the GPU's total memory vLLM takes
        (weights + activations + KV cache); that much must be free when the engine starts,
        or vLLM raises (v1/worker/utils.py:request_memory), so start it before the optimizer
        state exists or size the fraction to what the trainer leaves.
        max_model_len: prompt + response tokens per request, capped at config.json's
        max_position_embeddings (vLLM refuses a longer context; a request that reaches the cap
        ends with finish_reason "length").
        eos_token_ids: the ids generation stops at (None: eos_token_ids_of(hf_dir)); [] stops
        at none, every sample gets max_tokens tokens (the benchmarks on random weights, where
        EOS comes by chance: generate then also sets vLLM's ignore_eos, without which vLLM adds
        the model's generation-config eos to the stop tokens).
        return_routes: an MoE model's routes for generate(return_routes=True), through vLLM's
        enable_return_routed_experts (routing replay, common/rollout/routes.py; not yet run on a GPU).
        batch_invariant: --true-on-policy (common/model/exact.py): vLLM's batch-invariant kernels, eager, its
        Triton attention backend.
        llm_kwargs reach vllm.LLM unchanged (e.g. max_num_seqs, enable_prefix_caching)."""
        # flashinfer is not shipped with our GPU stack, and vLLM's sampler probes for it
        # unless told not to (shared/device/README.md). Must be set before vllm is imported.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        assert dist.is_initialized(), "call common.run.dist.init_distributed before VLLMEngine"
        # external_launcher reads RANK / LOCAL_RANK (env://); a plain single `python` process
        # (world of one, e.g. pytest) has none of torchrun's variables.
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        if batch_invariant:  # read as vLLM imports and as its worker starts (in this process)
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from vllm import LLM

        if batch_invariant:  # compiled, vLLM would fuse its norms and RoPE; the trainer repeats the Triton attention
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            enforce_eager = True
            llm_kwargs["attention_backend"] = AttentionBackendEnum.TRITON_ATTN

        self.rank = dist.get_rank()
        self.replica, self.num_replicas = rollout_replica(self.rank, rollout_tp)
        self.eos_token_ids = eos_token_ids_of(hf_dir) if eos_token_ids is None else list(eos_token_ids)
        self.enable_sleep = enable_sleep
        with open(os.path.join(hf_dir, "config.json")) as f:
            config = json.load(f)
        wrapped = vision_language_config(config) if load_format == "dummy" else None
        if wrapped is not None:  # a text Qwen3.5, which vLLM 0.26 serves only as the vision-language model:
            # started from that config (the weights come from the sync, under model.language_model.*)
            hf_dir, config = tempfile.mkdtemp(prefix="vllm_config_"), wrapped
            atexit.register(shutil.rmtree, hf_dir, ignore_errors=True)
            with open(os.path.join(hf_dir, "config.json"), "w") as f:
                json.dump(config, f)
        # a vision-language checkpoint (Qwen3.5 as released): vLLM builds the whole model, whose language
        # model takes the checkpoint's names (model.language_model.*: common/model/bridge_vl.py)
        text, self._vision_language = text_config(config)
        if self._vision_language:  # text in, text out: no vision tower, no image processor (a tokenizer-less engine)
            llm_kwargs.setdefault("language_model_only", True)
        if "linear_key_head_dim" in text and importlib.util.find_spec("flashinfer") is None:
            # gated-delta-net layers (Qwen3.5, Qwen3-Next): on Hopper vLLM's "auto" prefill kernel is
            # flashinfer's even where flashinfer is not installed; its Triton kernel needs nothing more
            extra = dict(llm_kwargs.get("additional_config") or {})
            llm_kwargs["additional_config"] = {"gdn_prefill_backend": "triton", **extra}
        max_positions = text.get("max_position_embeddings")
        self.moe_layers = None  # return_routes: which decoder layers are MoE (routes_from_vllm)
        if return_routes:
            from common.model.bridge import parse_hf_config

            self.moe_layers = parse_hf_config(config).moe.moe_layers
            llm_kwargs["enable_return_routed_experts"] = True
        self.max_model_len = max_model_len = cap_max_model_len(max_model_len, max_positions, self.rank)
        self.llm = LLM(
            model=hf_dir,
            tensor_parallel_size=rollout_tp,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=enable_sleep,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,  # the same on every rank of a replica
            enforce_eager=enforce_eager,  # False: torch.compile + CUDA graphs (slower start)
            load_format=load_format,
            skip_tokenizer_init=True,  # we pass token ids and decode ourselves
            logprobs_mode="processed_logprobs",  # see the module docstring
            **llm_kwargs,
        )
        self.rollout_tp = rollout_tp
        if rollout_tp > 1:  # agentic waves: the replica's first rank runs the episodes (RolloutEngine.wave_group)
            for r in range(self.num_replicas):  # every rank creates every group, in the same order
                ranks = list(range(r * rollout_tp, (r + 1) * rollout_tp))
                group = dist.new_group(ranks, backend="gloo")
                if r == self.replica:
                    self.wave_group, self.wave_leader = group, ranks[0]
        self.lockstep_turns = False  # True: agentic turns in waves even at rollout TP 1 (the benchmark's baseline)
        self._turns, self._turn_count = {}, 0  # agentic turns in flight: vLLM request id -> (driver key, prompt ids)
        self._asleep = set()  # tags asleep: "weights", "kv_cache"
        self._fused_cache = {}  # _fused_experts: vLLM MoE module name -> its w13/w2
        self._write_plan = None  # update_weights: the first sync's writes (WritePlan)
        self._weights_valid = load_format != "dummy"
        self._prefix_cache_stale = False
        self._warned_top_p = False

    @property
    def local_reads(self):
        """For export_hf_weights(local_reads=...): the first sync's recorded writes
        (WritePlan.reads_within), so that later syncs at Megatron TP = vLLM TP take each rank's
        own TP pieces instead of gathered tensors; None until then."""
        return self._write_plan

    @property
    def model(self):
        """The vLLM nn.Module in this process (its TP shard). Path checked on vLLM 0.26.0."""
        core = self.llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)  # InprocClient -> EngineCore
        worker = core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
        return worker.model_runner.get_model()

    # ---- memory --------------------------------------------------------------------------
    def sleep(self):
        """Free the weights and the KV cache (level 2): the next update_weights rewrites the
        weights anyway. Prefix cache is cleared by vLLM as it pauses the scheduler."""
        if self.enable_sleep and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = {"weights", "kv_cache"}
            self._weights_valid = False

    def wake_weights(self):
        """Re-allocate the weight memory only (contents undefined until update_weights)."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def wake_kv_cache(self):
        """Re-allocate the KV cache; vLLM resumes scheduling once nothing is asleep."""
        if "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        if self._prefix_cache_stale:
            self.llm.reset_prefix_cache()
            self._prefix_cache_stale = False

    def wake(self):
        self.wake_weights()
        self.wake_kv_cache()

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors):
        """Stream (HF name, full tensor) pairs into vLLM's model.load_weights, which maps HF
        names to its fused layout (qkv_proj, gate_up_proj) and cuts its own TP shard.

        One lazy pass: load_weights copies each tensor before pulling the next, so nothing
        is held beyond the producer's current bucket (export_hf_weights(bucket_mb=
        --sync-bucket-mb) gathers in buckets and may reuse them). The iterator is always
        consumed to the end (the producer runs collectives on every rank), then errors raise.
        The first sync records where load_weights writes each tensor; later ones repeat those
        writes directly (common/rollout/weight_replay.py) and hand load_weights only the tensors the
        recording could not cover.
        """
        assert "weights" not in self._asleep, "wake_weights() before update_weights()"
        source = iter(named_tensors)
        model = self.model
        written = set()
        try:
            if self._write_plan is None:  # first sync: vLLM's loader, its writes recorded
                plan = WritePlan(model)
                with plan.record(source) as stream:
                    loaded = model.load_weights(self._vllm_names(self._copy_experts(stream, written)))
                self._write_plan = plan
            else:  # later syncs: the recorded writes, the loader only for what they do not cover
                loaded = model.load_weights(
                    self._vllm_names(self._copy_experts(self._replayed(source, written), written))
                )
        finally:
            leftover = sum(1 for _ in source)  # drain: keep every rank's collectives matched
        if leftover:
            raise RuntimeError(f"vLLM load_weights stopped early, {leftover} tensors unread")
        loaded = None if loaded is None else set(loaded) | written
        # With sleep level 2 a parameter the sync missed would be garbage memory: check.
        if loaded is not None:
            # vLLM 0.26 reports a MoE layer's fused experts as `experts.w13_weight` while the
            # parameter lives at `experts.routed_experts.w13_weight`: compare without that level
            plain = lambda name: name.replace(".routed_experts.", ".")  # noqa: E731
            params = dict(model.named_parameters())
            written = {plain(name) for name in loaded}
            # MLA's absorbed W_UK_T / W_UV are views of kv_b_proj.weight: written with it
            storages = {p.untyped_storage().data_ptr() for name, p in params.items() if plain(name) in written}
            missing = sorted(
                plain(name)
                for name, p in params.items()
                if plain(name) not in written and p.untyped_storage().data_ptr() not in storages
            )
            if missing:
                raise RuntimeError(f"update_weights: {len(missing)} vLLM parameters not written, e.g. {missing[:5]}")
        self._weights_valid = True
        # Cached KV blocks were computed by the old weights.
        self._prefix_cache_stale = True
        if "kv_cache" not in self._asleep:
            self.wake_kv_cache()  # awake: just resets the prefix cache

    def _replayed(self, named_tensors, written):
        """named_tensors minus those written by replaying the first sync's writes
        (common/rollout/weight_replay.py: ~90 us of vLLM's Python per tensor saved, 7B's sync 39 ->
        14 ms on one H200), TP pieces (LocalShard) included; names of the parameters written
        go into `written`."""
        from common.model.weights import LocalShard

        plan = self._write_plan
        for name, tensor in named_tensors:
            if isinstance(tensor, LocalShard):  # export_hf_weights(local_reads=plan) chose it: no fallback
                if not plan.replay_piece(name, tensor):
                    raise RuntimeError(
                        f"update_weights: {name}: this rank's piece [{tensor.start}:{tensor.stop}] "
                        f"along dim {tensor.dim} was not recorded as all that vLLM reads"
                    )
                written.update(plan.written.get(name, ()))
            elif plan.replay(name, tensor):
                written.update(plan.written.get(name, ()))
            else:
                yield name, tensor

    def _vllm_names(self, named_tensors):
        """The text model's HF names as vLLM's loader of this checkpoint takes them: a vision-language
        model's under model.language_model. (vLLM maps those to its language_model.model.*)."""
        if not self._vision_language:
            return named_tensors
        return ((checkpoint_name(name), tensor) for name, tensor in named_tensors)

    # ---- sampling ------------------------------------------------------------------------
    def score(self, samples):
        """RolloutEngine.score through vLLM's prompt logprobs: prompt + response as one prompt
        of a one-token request (prefill only; such requests bypass the prefix cache). vLLM
        computes prompt logprobs from the raw logits (temperature 1, full vocabulary), whatever
        logprobs_mode says. A sample of max_model_len tokens loses its last token's score."""
        from vllm import SamplingParams

        assert not self._asleep and self._weights_valid, "score() needs the engine awake with synced weights"
        rows = [(list(s.prompt_ids) + list(s.response_ids))[: self.max_model_len - 1] for s in samples]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        scores = []
        for s, row, out in zip(samples, rows, outputs):  # prompt_logprobs[j]: token j given those before it
            got = [out.prompt_logprobs[j][row[j]].logprob for j in range(len(s.prompt_ids), len(row))]
            scores.append(got + [math.nan] * (len(s.response_ids) - len(got)))
        return scores

    def generate(
        self,
        prompts,
        n,
        temperature,
        top_p,
        max_tokens,
        seed,
        logprob_samples=None,
        response_lengths=None,
        return_routes=False,
    ):
        """Sample n responses per prompt; prompt-major, as RolloutEngine.generate says.

        Every (prompt, sample) is its own request with n=1 and its own seed (vLLM rejects
        n > 1 when greedy, and one seed per request keeps samples independent: vLLM's
        Gumbel noise is a function of (seed, position)). The seeds derive from (seed, this
        replica), so replicas draw differently and the ranks of one replica identically.
        Only the first logprob_samples samples of each prompt (None: all) ask vLLM for the
        sampled token's logprob; the others get NaNs (measured on an H200, Qwen2-1.5B: asking
        for logprobs costs 19% of the generation throughput, per-request seeds nothing).
        response_lengths (a benchmark's): request k has max_tokens=response_lengths[k], no stop
        tokens and ignore_eos (without it vLLM adds the generation config's EOS to the stops), so
        it ends after exactly that many tokens, unless prompt + length passes max_model_len:
        refused here, as vLLM would cut it short.
        return_routes (an engine made with return_routes): each completion's routed_experts, the
        MoE layers' (routes_from_vllm), as Sample.routes.
        """
        from vllm import SamplingParams

        assert not self._asleep, "generate() while asleep: wake_weights, update_weights, wake_kv_cache"
        assert self._weights_valid, (
            "no weights since start-up (load_format='dummy') or the last sleep: update_weights first"
        )
        assert not return_routes or self.moe_layers is not None, "routes need VLLMEngine(return_routes=True)"
        if 0 < temperature and top_p < 1.0 and not self._warned_top_p:
            warnings.warn(
                "VLLMEngine: with top_p < 1 the returned logprobs are renormalised over the "
                "nucleus (common/rollout/vllm_engine.py docstring), not HFEngine's full-vocab ones"
            )
            self._warned_top_p = True
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]  # prompt-major
        if not rows:
            return []
        base = random.Random(f"{seed}/{self.replica}").getrandbits(48)
        with_logprobs = [logprob_samples is None or i % n < logprob_samples for i in range(len(rows))]
        exact = response_lengths is not None
        if exact:
            assert len(response_lengths) == len(rows), "one response length per sample"
            over = [(len(r), k) for r, k in zip(rows, response_lengths) if len(r) + k > self.max_model_len]
            if over:
                raise ValueError(
                    f"response_lengths: {len(over)} samples would pass max_model_len {self.max_model_len}, e.g. a "
                    f"prompt of {over[0][0]} + {over[0][1]} tokens: shorten the lengths or the prompts"
                )
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=response_lengths[i] if exact else max_tokens,
                seed=base + i,
                logprobs=0 if with_lp else None,
                flat_logprobs=True,
                detokenize=False,
                stop_token_ids=[] if exact else self.eos_token_ids,
                ignore_eos=exact or not self.eos_token_ids,
            )  # no eos ids: stop at none (__init__)
            for i, with_lp in enumerate(with_logprobs)
        ]
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        samples = []
        for row, out, with_lp in zip(rows, outputs, with_logprobs):  # vLLM keeps the input order
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            if not with_lp:
                samples.append(Sample(row, tokens, [math.nan] * len(tokens), completion.finish_reason))
            else:
                flat = completion.logprobs  # FlatLogprobs: the sampled token comes first
                starts = flat.start_indices
                assert [flat.token_ids[s] for s in starts] == tokens, "logprobs do not follow the tokens"
                samples.append(Sample(row, tokens, [flat.logprobs[s] for s in starts], completion.finish_reason))
            if return_routes:  # (prompt + response - 1, layers, k): every token vLLM ran
                routes = routes_from_vllm(completion.routed_experts, self.moe_layers)
                assert len(routes) == len(row) + len(tokens) - 1, f"{len(routes)} routes for {len(row) + len(tokens)}"
                samples[-1].routes = routes
        return samples
