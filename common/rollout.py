"""Rollout engines: sample responses from the current policy, with per-token logprobs.

Every engine has the same small interface (`RolloutEngine`), so the training scripts read
the same on a laptop and on a GPU cluster:

    engine.wake()                                   # GPU: bring weights (+ KV cache) back
    engine.update_weights(export_hf_weights(...))   # stream (hf_name, full tensor) pairs in
    samples = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=256, seed=step)
    engine.sleep()                                  # GPU: free memory for the update

`HFEngine` is the CPU fallback: a transformers AutoModelForCausalLM with our own batched
sampling loop over a KV cache. It serves the embedded tiny default (`python train_grpo.py`)
and the tests; it is not meant for real models.
`VLLMEngine` (GPU: vLLM colocated in the torchrun processes) lives in common/rollout_vllm.py,
so that importing this module never imports vLLM.

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
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from common.bridge_moe import EXPERT_LAYOUTS


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]          # ends with (and includes) eos when finish_reason == "stop"
    response_logprobs: list[float]   # one per response token, see the module docstring
    finish_reason: str               # "stop" (eos sampled) | "length" (max_tokens reached)


def make_engine(use_vllm, hf_dir, *, rollout_tp=1, gpu_memory_utilization=0.5, max_model_len=4096, seed=0,
                device=None):
    """(engine, rollout TP size): a VLLMEngine (one per vLLM TP group of `rollout_tp` ranks;
    max_model_len is capped at the model's positions there) or, on CPUs, an HFEngine in fp32
    (each rank its own replica: rollout TP 1)."""
    if use_vllm:
        from common.rollout_vllm import VLLMEngine

        return VLLMEngine(hf_dir, rollout_tp=rollout_tp, gpu_memory_utilization=gpu_memory_utilization,
                          max_model_len=max_model_len, seed=seed), rollout_tp
    return HFEngine(hf_dir, dtype=torch.float32, device=device), 1


# --rollout-logprobs: which samples bring the engine's own logprobs (generate's logprob_samples)
ROLLOUT_LOGPROBS = {"prefill": 0, "one-per-prompt": 1, "all": None, "none": 0}
# prompt + response tokens the prefill check scores at most: for prompt logprobs vLLM
# materialises each prefill chunk's (tokens, vocabulary) logits in fp32 and their log-softmax,
# outside its memory budget (4096 x 152k x 4 B = 2.5 GB each), and a long prefill costs time
PREFILL_CHECK_TOKENS = 4096


def rollout_logprobs_mode(requested, temperature, tis_cap):
    """The --rollout-logprobs mode of a run (ValueError: what to change). Default: all with
    --tis-cap (its weights need every sample's), else prefill at temperature 1 (the check
    costs no decode time), else one-per-prompt (vLLM's prompt logprobs ignore temperature)."""
    if requested is None:
        return "all" if tis_cap > 0 else "prefill" if temperature == 1.0 else "one-per-prompt"
    if tis_cap > 0 and requested != "all":
        raise ValueError("--tis-cap needs the rollout logprobs of every sample: --rollout-logprobs all")
    if requested == "prefill" and temperature != 1.0:
        raise ValueError(f"--rollout-logprobs prefill scores a sample with the engine's prompt logprobs, which "
                         f"vLLM computes at temperature 1, not --temperature {temperature}: use one-per-prompt")
    return requested


def generate_checked(engine, prompts, mode, **kwargs):
    """engine.generate(prompts, **kwargs) with --rollout-logprobs `mode`: the samples that carry
    the engine's logprobs (the others NaN) for logprob_mismatch and --tis-cap.
    prefill: sampling asks for none (vLLM computes the batch's log-softmax at every decode step
    once any request asks: 3% of the 7B rollout, docs/benchmarks.md); afterwards one sample,
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


def vllm_available():
    """Whether vllm can be imported here (without importing it: it is slow and GPU-only)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class RolloutEngine:
    """The interface every rollout engine implements (HFEngine here; VLLMEngine on GPUs)."""

    expert_blocks = False  # True: update_weights takes routed experts as (module, common.weights.ExpertBlock)
    local_reads = None     # else export_hf_weights(local_reads=): update_weights takes TP pieces (LocalShard)

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int, logprob_samples: int | None = None) -> list[Sample]:
        """Sample n responses per prompt (token ids). Returns len(prompts) * n Samples in
        prompt-major order: samples[i * n + j] is the j-th sample of prompt i.
        Deterministic for a given seed (on one engine, batch and software stack).
        logprob_samples: only the first logprob_samples samples of each prompt must carry
        response_logprobs (None: all); an engine may return NaNs for the others when
        logprobs cost it time (vLLM: ~20% of its throughput at 1.5B, docs/benchmarks.md)."""
        raise NotImplementedError

    def score(self, samples: list[Sample]) -> list[list[float]]:
        """log_softmax(logits)[token] of every response token of each sample at temperature 1
        over the full vocabulary, from one forward pass over prompt + response (no sampling):
        the trainer's logprobs at T=1. Positions the engine cannot hold are NaN."""
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, full tensor) pairs into the engine's model. Consumes the whole
        iterator even on error (the producer may run collectives on every rank), then raises."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Release accelerator memory (weights + KV cache) for the training phase."""

    def wake_weights(self) -> None:
        """Take the weight memory back before a weight sync (vLLM: wake_up(tags=["weights"]))."""

    def wake_kv_cache(self) -> None:
        """Take the KV-cache memory back after the sync, before generation."""

    def wake(self) -> None:
        """Take the accelerator memory back before a weight sync / generation."""


def sample_tokens(logits, temperature, top_p, generator):
    """Pick one token per row and return (tokens (B,), logprobs (B,)) as in the module docstring.

    logits: (B, V) float32.
    """
    if temperature <= 0:
        logprobs = torch.log_softmax(logits, dim=-1)             # (B, V)
        tokens = logits.argmax(dim=-1)                            # (B,)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)   # (B, V)
    probs = logprobs.exp()
    if top_p < 1.0:
        # Nucleus: keep the smallest set of most-likely tokens whose mass reaches top_p
        # (a token is kept if the mass strictly before it is < top_p, so the top one always is).
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # multinomial renormalises the (filtered) probabilities; one generator draw per row.
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


class HFEngine(RolloutEngine):
    """CPU rollout engine on a transformers causal LM loaded from an HF dir.

    Batching: all len(prompts) * n rows decode together. Prompts are LEFT-padded to the longest
    one, so every row's next token sits in the last column; the attention mask hides the pads and
    position ids count only real tokens (a padded row gets the same positions as alone).
    Rows that finished keep decoding a filler token (their outputs are ignored) until every row
    is done or max_tokens is reached: simple, and cheap for the tiny models this is meant for.
    """

    def __init__(self, hf_dir, dtype=torch.float32, eos_token_ids=None, device="cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        if eos_token_ids is None:
            # generation_config may override config (e.g. instruct models stop on <|im_end|>).
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            eos = eos if eos is not None else self.model.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        # Filler fed to finished rows and used as left padding; masked out / ignored anyway.
        self.pad_id = self.eos_token_ids[0] if self.eos_token_ids else 0

    @torch.inference_mode()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seed, logprob_samples=None):
        # logprob_samples is ignored: the logprobs are a by-product of the sampling here
        from transformers import DynamicCache

        rows = [list(map(int, p)) for p in prompts for _ in range(n)]  # prompt-major
        if not rows:
            return []
        assert all(len(r) > 0 for r in rows), "empty prompt"
        B, L = len(rows), max(len(r) for r in rows)
        dev = self.device
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long, device=dev)
        attn_mask = torch.zeros((B, L), dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            input_ids[i, L - len(r):] = torch.tensor(r)
            attn_mask[i, L - len(r):] = 1
        # Positions of real tokens are 0..len-1 in every row; pads get 0 (they are masked).
        position_ids = (attn_mask.cumsum(-1) - 1).clamp(min=0)   # (B, L)
        next_pos = attn_mask.sum(-1, keepdim=True)               # (B, 1)

        generator = torch.Generator(device=dev).manual_seed(seed)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=dev)
        cache = DynamicCache(config=self.model.config)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        out_tokens, out_logprobs = [], []                         # max_tokens x (B,)
        tokens = input_ids
        for step in range(max_tokens):
            logits = self.model(input_ids=tokens, attention_mask=attn_mask, position_ids=position_ids,
                                past_key_values=cache, use_cache=True).logits[:, -1].float()  # (B, V)
            new, logprobs = sample_tokens(logits, temperature, top_p, generator)
            new = torch.where(done, self.pad_id, new)
            out_tokens.append(new)
            out_logprobs.append(logprobs)
            done = done | torch.isin(new, eos)
            if bool(done.all()) or step == max_tokens - 1:
                break
            # Feed the new token: one more mask column, position = previous length.
            tokens, position_ids = new[:, None], next_pos
            attn_mask = torch.cat([attn_mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
            next_pos = next_pos + 1

        samples = []
        all_tokens = torch.stack(out_tokens, 1).tolist() if out_tokens else [[] for _ in rows]
        all_logprobs = torch.stack(out_logprobs, 1).tolist() if out_logprobs else [[] for _ in rows]
        eos_set = set(self.eos_token_ids)
        for r, toks, lps in zip(rows, all_tokens, all_logprobs):
            stop = next((t for t, tok in enumerate(toks) if tok in eos_set), None)
            if stop is not None:
                samples.append(Sample(r, toks[:stop + 1], lps[:stop + 1], "stop"))
            else:
                samples.append(Sample(r, toks, lps, "length"))
        return samples

    @torch.inference_mode()
    def score(self, samples):
        scores = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=self.device)
            logprobs = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            scores.append(logprobs.gather(-1, ids[0, 1:, None])[len(s.prompt_ids) - 1:, 0].tolist())
        return scores

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = dict(self.model.named_parameters())   # tied lm_head is deduplicated away
        saved = set(self.model.state_dict())  # + buffers that are checkpoint tensors (DeepSeek-V3's router bias)
        params.update((name, b) for name, b in self.model.named_buffers() if name in saved)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        errors, seen = [], set()
        for name, tensor in _fused_experts(named_tensors, params):  # consume everything before raising
            if name == "lm_head.weight" and tied and name not in params:
                name = "model.embed_tokens.weight"      # same storage; copy is harmless
                if name in seen:
                    continue
            p = params.get(name)
            if p is None:
                errors.append(f"unknown weight name {name!r}")
            elif p.shape != tensor.shape:
                errors.append(f"{name}: shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            else:
                p.copy_(tensor)                         # casts dtype/device; source may be reused
                seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            errors.append(f"{len(missing)} weights not updated, e.g. {missing[:5]}")
        if errors:
            raise ValueError("HFEngine.update_weights: " + "; ".join(errors[:10]))


# checkpoint name of one expert's projection: model.layers.L.<block>.experts.E.<proj>.weight
_BLOCKS = "|".join(sorted({block for block, *_ in EXPERT_LAYOUTS.values()}))
EXPERT_NAME = re.compile(rf"model\.layers\.(\d+)\.(?:{_BLOCKS})\.experts\.(\d+)\.(\w+)\.weight")
# projection -> its half of the fused gate_up_proj (0 gate, 1 up), None for down_proj
EXPERT_HALF = {proj: half for _, gate, up, down in EXPERT_LAYOUTS.values() for proj, half in ((gate, 0), (up, 1), (down, None))}


def _fused_experts(named_tensors, params):
    """(name, tensor) pairs in the checkpoint's per-expert layout (common/bridge_moe.py's
    EXPERT_LAYOUTS) -> transformers 5's in-memory MoE layout, where a layer's experts are two
    fused parameters: `mlp.experts.gate_up_proj` (E, 2F, H), rows [gate; up], and
    `mlp.experts.down_proj` (E, H, F), and every block is called `mlp` (Mixtral's router is
    `mlp.gate`, not `block_sparse_moe.gate`). Each expert's tensor is copied into its slice as
    it comes; the fused parameter is reported once, after its last expert. Other names pass
    through."""
    counts = {}
    for name, tensor in named_tensors:
        match = EXPERT_NAME.fullmatch(name)
        half = EXPERT_HALF.get(match[3]) if match else None
        fused = match and f"model.layers.{match[1]}.mlp.experts.{'down_proj' if half is None else 'gate_up_proj'}"
        if not match or match[3] not in EXPERT_HALF or fused not in params:
            yield (name if name in params else re.sub(rf"\.(?:{_BLOCKS})\.", ".mlp.", name)), tensor
            continue
        target = params[fused][int(match[2])]  # (2F, H) or (H, F)
        if half is not None:
            rows = target.shape[0] // 2
            target = target[half * rows:(half + 1) * rows]
        if target.shape != tensor.shape:
            yield name, tensor  # reported as a shape error by update_weights
            continue
        target.copy_(tensor)
        counts[fused] = counts.get(fused, 0) + 1
        # every expert's gate and up (2 per expert) or down (1) arrived: the whole parameter is written
        if counts[fused] == params[fused].shape[0] * (1 if half is None else 2):
            yield fused, params[fused]  # its own values: the copy in update_weights changes nothing
