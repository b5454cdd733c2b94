"""The CPU rollout engine: a transformers AutoModelForCausalLM with a batched sampling loop over a KV cache.

    engine = HFEngine(hf_dir, dtype=torch.float32, max_model_len=1024)
    engine.update_weights(export_hf_weights(...)); samples = engine.generate(prompts, n=8, ...)

It serves the embedded tiny default (`python train_grpo.py`) and the tests; it is not meant for
real models. Logprob semantics: common/rollout/engine.py.
"""

import contextlib
import re

import torch

from common.model.bridge_moe import EXPERT_BLOCKS, EXPERT_HALF, EXPERT_NAME
from common.rollout.engine import RolloutEngine, Sample, cap_max_model_len
from common.rollout.routes import RouteRecorder


def sample_tokens(logits, temperature, top_p, generator):
    """Pick one token per row and return (tokens (B,), logprobs (B,)) as in the module docstring.

    logits: (B, V) float32.
    """
    if temperature <= 0:
        logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logits.argmax(dim=-1)  # (B,)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    probs = logprobs.exp()
    if top_p < 1.0:
        # Nucleus: keep the smallest set of most-likely tokens whose mass reaches top_p
        # (a token is kept if the mass strictly before it is < top_p, so the top one always is).
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # Weights an update made non-finite (or finite but huge: the logits overflow) give NaN rows,
    # which multinomial refuses: such a row draws any token and keeps its NaN logprob, so the
    # trainer's non-finite guard (common/train/guard.py) stops the run, naming the step.
    broken = ~torch.isfinite(probs).all(dim=-1, keepdim=True)  # (B, 1)
    probs = torch.where(broken, 1.0, probs)
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
    max_model_len: prompt + response tokens per request, as VLLMEngine's: capped at the
    model's max_position_embeddings (None: that), a response that reaches it ends with
    finish_reason "length", a prompt that fills it is refused.
    generate(return_routes=True), MoE models: forward hooks on the routers record the experts of
    every token fed (common/rollout/routes.py): the prompt's (its columns of the prefill) and
    each sampled token's but the last (the decode steps that fed them), as Sample.routes.
    """

    def __init__(self, hf_dir, dtype=torch.float32, eos_token_ids=None, device="cpu", max_model_len=None):
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.max_model_len = cap_max_model_len(max_model_len or max_positions, max_positions, rank)
        if eos_token_ids is None:
            # generation_config may override config (e.g. instruct models stop on <|im_end|>).
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            eos = eos if eos is not None else self.model.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        # Filler fed to finished rows and used as left padding; masked out / ignored anyway.
        self.pad_id = self.eos_token_ids[0] if self.eos_token_ids else 0

    @torch.inference_mode()
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
        # logprob_samples is ignored: the logprobs are a by-product of the sampling here
        from transformers import DynamicCache

        rows = [list(map(int, p)) for p in prompts for _ in range(n)]  # prompt-major
        if not rows:
            return []
        assert all(len(r) > 0 for r in rows), "empty prompt"
        exact = response_lengths is not None  # a benchmark's lengths: row k ends after exactly lengths[k] tokens
        if exact:
            assert len(response_lengths) == len(rows) and min(response_lengths) >= 1, "one length >= 1 per sample"
        B, L = len(rows), max(len(r) for r in rows)
        # each row's response budget: its drawn length or max_tokens, within what max_model_len leaves after its prompt
        wanted = response_lengths if exact else [max_tokens] * B
        budgets = [min(w, self.max_model_len - len(r)) if self.max_model_len else w for r, w in zip(rows, wanted)]
        if min(budgets) < 1:
            raise ValueError(
                f"a prompt of {L} tokens leaves no room for a response within max_model_len {self.max_model_len}"
            )
        dev = self.device
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long, device=dev)
        attn_mask = torch.zeros((B, L), dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            input_ids[i, L - len(r) :] = torch.tensor(r)
            attn_mask[i, L - len(r) :] = 1
        # Positions of real tokens are 0..len-1 in every row; pads get 0 (they are masked).
        position_ids = (attn_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        next_pos = attn_mask.sum(-1, keepdim=True)  # (B, 1)

        generator = torch.Generator(device=dev).manual_seed(seed)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=dev)
        cache = DynamicCache(config=self.model.config)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        budget_left = torch.tensor(budgets, device=dev)  # (B,) tokens each row may still sample
        out_tokens, out_logprobs = [], []  # steps x (B,)
        tokens = input_ids
        # MoE routes (common/rollout/routes.py): the experts of every token fed, the prompt's columns then one per step
        recorder = RouteRecorder(self.model) if return_routes else contextlib.nullcontext()
        with recorder:
            for step in range(max(budgets)):
                logits = self.model(
                    input_ids=tokens,
                    attention_mask=attn_mask,
                    position_ids=position_ids,
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]  # (B, V)
                if return_routes:
                    recorder.step(*tokens.shape)
                new, logprobs = sample_tokens(logits.float(), temperature, top_p, generator)
                new = torch.where(done, self.pad_id, new)
                out_tokens.append(new)
                out_logprobs.append(logprobs)
                budget_left -= 1
                done = done | (budget_left == 0) | (torch.isin(new, eos) & (not exact))  # a benchmark ignores EOS
                if bool(done.all()):
                    break
                # Feed the new token: one more mask column, position = previous length.
                tokens, position_ids = new[:, None], next_pos
                attn_mask = torch.cat([attn_mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
                next_pos = next_pos + 1

        samples = []
        all_tokens = torch.stack(out_tokens, 1).tolist() if out_tokens else [[] for _ in rows]
        all_logprobs = torch.stack(out_logprobs, 1).tolist() if out_logprobs else [[] for _ in rows]
        eos_set = set() if exact else set(self.eos_token_ids)
        routes = recorder.routes() if return_routes else None  # (B, L + steps fed, M, k)
        for i, (r, budget, toks, lps) in enumerate(zip(rows, budgets, all_tokens, all_logprobs)):
            toks, lps = toks[:budget], lps[:budget]
            stop = next((t for t, tok in enumerate(toks) if tok in eos_set), None)
            if stop is not None:
                samples.append(Sample(r, toks[: stop + 1], lps[: stop + 1], "stop"))
            else:
                samples.append(Sample(r, toks, lps, "length"))
            if return_routes:  # the prompt (left-padded to L columns), then response tokens 0..n-2 fed at L..
                n = len(samples[-1].response_ids)
                samples[-1].routes = torch.cat([routes[i, L - len(r) : L], routes[i, L : L + n - 1]])
        return samples

    @torch.inference_mode()
    def score(self, samples):
        scores = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=self.device)
            logprobs = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            scores.append(logprobs.gather(-1, ids[0, 1:, None])[len(s.prompt_ids) - 1 :, 0].tolist())
        return scores

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = dict(self.model.named_parameters())  # tied lm_head is deduplicated away
        saved = set(self.model.state_dict())  # + buffers that are checkpoint tensors (DeepSeek-V3's router bias)
        params.update((name, b) for name, b in self.model.named_buffers() if name in saved)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        errors, seen = [], set()
        for name, tensor in _fused_experts(named_tensors, params):  # consume everything before raising
            if name == "lm_head.weight" and tied and name not in params:
                name = "model.embed_tokens.weight"  # same storage; copy is harmless
                if name in seen:
                    continue
            p = params.get(name)
            if p is None:
                errors.append(f"unknown weight name {name!r}")
            elif p.shape != tensor.shape:
                errors.append(f"{name}: shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            else:
                p.copy_(tensor)  # casts dtype/device; source may be reused
                seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            errors.append(f"{len(missing)} weights not updated, e.g. {missing[:5]}")
        if errors:
            raise ValueError("HFEngine.update_weights: " + "; ".join(errors[:10]))


def _fused_experts(named_tensors, params):
    """(name, tensor) pairs in the checkpoint's per-expert layout (common/model/bridge_moe.py's
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
            yield (name if name in params else re.sub(rf"\.(?:{EXPERT_BLOCKS})\.", ".mlp.", name)), tensor
            continue
        target = params[fused][int(match[2])]  # (2F, H) or (H, F)
        if half is not None:
            rows = target.shape[0] // 2
            target = target[half * rows : (half + 1) * rows]
        if target.shape != tensor.shape:
            yield name, tensor  # reported as a shape error by update_weights
            continue
        target.copy_(tensor)
        counts[fused] = counts.get(fused, 0) + 1
        # every expert's gate and up (2 per expert) or down (1) arrived: the whole parameter is written
        if counts[fused] == params[fused].shape[0] * (1 if half is None else 2):
            yield fused, params[fused]  # its own values: the copy in update_weights changes nothing
