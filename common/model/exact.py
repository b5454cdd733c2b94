"""Bitwise on-policy training (--true-on-policy): the trainer's forward on the rollout engine's own kernels.

With the mode on, the log-probability the trainer computes for a sampled token is the one vLLM returned for it,
bit for bit, so the first update's importance ratio is exactly 1 and `logprob_mismatch` is 0.0. Two things make
that hold:

1. vLLM runs batch-invariant (VLLM_BATCH_INVARIANT=1, eager): every kernel computes a token's row in an order
   that does not depend on which other tokens share the batch, so a token's logits are the same whether vLLM
   decoded it one at a time or the trainer scores the whole sequence at once.
2. The trainer calls the same kernels, in the same order, with the same roundings: `convert(chunks)` swaps the
   policy's modules for versions whose forward calls vLLM's functions (this process holds the engine, so they are
   the very functions the engine runs):
     linears        vLLM's linear_batch_invariant (its Triton persistent matmul, then the bias added in bf16);
     RMSNorm        vLLM's Triton rms_norm. The engine fuses the residual add into its norms with a CUDA kernel
                    whose sums depend on the batch's size; bind() has the engine add in bf16 (megatron's residual
                    add) and then run the same Triton rms_norm (_unfused_rms_norm);
     attention      vLLM's rotary op with the engine's own cos/sin table, then vLLM's Triton attention kernel
                    over a paged copy of the keys and values (the engine's page size). The engine runs that
                    backend (TRITON_ATTN): batch-invariant, it is one kernel whose per-query order does not depend
                    on prefill or decode (FlashAttention's decode takes another tiling than its prefill: measured,
                    its logprobs then differ from the trainer's at half of the sampled tokens);
     SwiGLU         vLLM's silu_and_mul;
     log-probs      vLLM's sampler kernel (compute_token_logprobs) over the bf16 logits.
   The backward of each is the gradient of the usual (mathematically equal) function, recomputed from the saved
   inputs: the kernels vLLM ships have no backward. So the update's gradient is the usual one, to rounding.

`bind(engine)` reads what the engine decided at start-up (its rotary table, page size, model runner) after it
started; `convert` is called by common/run/build.py load_model(exact=True). Scope: dense
attention models without q/k norms (Qwen2, Qwen2.5, Llama) at tensor, context and rollout parallel size 1, bf16,
temperature 1 without top-p; common/run/layout_checks.py refuses the rest at start. Costs: vLLM without CUDA
graphs and on batch-invariant kernels, the trainer on the same kernels plus a recomputed forward of each swapped
op in the backward (docs/algorithms.md measures both).
"""

import torch
from megatron.core.tensor_parallel import layers as mcore_layers

_ENGINE = {}  # bind(): rotary table, is_neox, page size, model runner


def bind(engine):
    """Record the engine's start-up choices that the trainer's kernels must repeat (call after the engine
    started, before the first forward). engine: a VLLMEngine started with VLLM_BATCH_INVARIANT=1."""
    import os

    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise RuntimeError("--true-on-policy: the engine was started without VLLM_BATCH_INVARIANT=1")
    model = engine.model
    rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    config = engine.llm.llm_engine.vllm_config
    if config.attention_config.backend is None or config.attention_config.backend.name != "TRITON_ATTN":
        raise RuntimeError(
            "--true-on-policy: the engine must run vLLM's TRITON_ATTN backend (VLLMEngine batch_invariant)"
        )
    _ENGINE.update(
        cos_sin=rotary.cos_sin_cache.detach().clone(),  # the table vLLM rotates with (bf16, built on the GPU)
        is_neox=rotary.is_neox_style,
        block_size=config.cache_config.block_size,
        v2_runner=config.use_v2_model_runner,
        logits_dtype=config.model_config.dtype,  # the sampler's logits: its kernel's reduction follows their dtype
    )
    from vllm.model_executor.layers import layernorm

    layernorm.rms_norm_batch_invariant = _unfused_rms_norm  # the engine's norms, from its next forward on
    from common.rl import logprobs

    logprobs.EXACT_TOKEN_LOGPROBS = token_logprobs


def _unfused_rms_norm(input, weight, eps=1e-6, residual=None):
    """vLLM's batch-invariant RMSNorm with its residual add unfused: the add in bf16 (as its fused kernel adds),
    then its Triton rms_norm. vLLM 0.26's fused_add_rms_norm picks its threads per row by the batch's size
    (1024 below 256 tokens, else 256), so a row's sum depends on how many tokens share the step: measured, the
    trainer's rows then differ from the engine's whenever one side has >= 256 tokens."""
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    if residual is None:
        return rms_norm_batch_invariant(input, weight, eps)
    residual = input + residual
    return rms_norm_batch_invariant(residual, weight, eps), residual


def bound():
    if not _ENGINE:
        raise RuntimeError("--true-on-policy: common.model.exact.bind(engine) was not called before the forward")
    return _ENGINE


class _StraightThrough(torch.autograd.Function):
    """forward: exact(*inputs) (vLLM's kernel, no autograd); backward: the gradient of reference(*inputs),
    recomputed from the inputs (the same function in differentiable torch ops)."""

    @staticmethod
    def forward(ctx, exact, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return exact(*inputs)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[2:]
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, [x for x in inputs if x.requires_grad], grad, allow_unused=True))
        return (None, None, *(next(grads) if need else None for need in needs))


def straight_through(exact, reference, *inputs):
    return _StraightThrough.apply(exact, reference, *inputs)


# ---- linears ------------------------------------------------------------------------------------------------


class _ExactLinear(mcore_layers.LinearWithGradAccumulationAndAsyncCommunication):
    """megatron's linear function with vLLM's product in the forward; the backward is megatron's (it reads the
    context fields set here, megatron-core 0.16.1)."""

    @staticmethod
    @mcore_layers.custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, grad_output_buffer, limit):
        from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = False
        ctx.wgrad_deferral_limit = limit
        ctx.grad_output_buffer = grad_output_buffer
        ctx.tp_group = None
        return linear_batch_invariant(input, weight, bias)


def _exact_forward_impl(self, input, weight, *args, **kwargs):
    if args or kwargs.get("sequence_parallel") or not weight.requires_grad:  # frozen weights: megatron's path
        return super(type(self), self)._forward_impl(input, weight, *args, **kwargs)
    return _ExactLinear.apply(
        input,
        weight,
        kwargs.get("bias"),
        kwargs["gradient_accumulation_fusion"],
        kwargs["allreduce_dgrad"],
        kwargs.get("grad_output_buffer"),
        kwargs.get("wgrad_deferral_limit"),
    )


class ExactColumnParallelLinear(mcore_layers.ColumnParallelLinear):
    _forward_impl = _exact_forward_impl


class ExactRowParallelLinear(mcore_layers.RowParallelLinear):
    _forward_impl = _exact_forward_impl


# ---- norms, activation, attention ---------------------------------------------------------------------------


def rms_norm(x, weight, eps):
    """vLLM's batch-invariant RMSNorm of x (its Triton kernel, which the engine's norms run after bind())."""
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    def exact(x, weight):
        return rms_norm_batch_invariant(x, weight, eps)

    def reference(x, weight):
        return torch.nn.functional.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)

    return straight_through(exact, reference, x, weight)


def silu_and_mul(y, reference):
    """silu(a) * b of y's halves by vLLM's silu_and_mul; the gradient of reference(y)."""

    def exact(y):
        out = y.new_empty(*y.shape[:-1], y.shape[-1] // 2)
        torch.ops._C.silu_and_mul(out, y.contiguous())
        return out

    return straight_through(exact, reference, y)


def attention(query, key, value, lengths, scale, reference):
    """Causal attention of packed sequences the engine's way: query (t, heads, d), key / value (t, groups, d)
    before RoPE, the sequences of `lengths` (a list) one after another, each starting at position 0.
    -> (t, heads, d). reference(query, key, value): the same function in differentiable ops (its gradient)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    engine = bound()
    device, bs = query.device, engine["block_size"]
    t, heads, d = query.shape
    groups = key.shape[1]
    lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    blocks = (lens + bs - 1) // bs  # pages per sequence; sequence i owns pages [first[i], first[i] + blocks[i])
    first = torch.cumsum(blocks, 0) - blocks
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    pos = torch.arange(t, device=device) - cu[seq].long()  # each token's position in its sequence
    slots = first[seq].long() * bs + pos
    most = max(lengths)
    table = (first[:, None] + torch.arange(int(blocks.max()), device=device)[None, :]).to(torch.int32)
    last = (first + blocks - 1).clamp(min=0)
    table = torch.minimum(table, last[:, None]).to(torch.int32)  # columns past a sequence's pages: a real page

    def exact(query, key, value):
        q, k = query.reshape(t, heads * d).clone(), key.reshape(t, groups * d).clone()
        ops.rotary_embedding(pos, q, k, d, engine["cos_sin"], engine["is_neox"])
        pages = int(blocks.sum())
        k_cache = q.new_zeros(pages * bs, groups, d).index_copy_(0, slots, k.view(t, groups, d))
        v_cache = q.new_zeros(pages * bs, groups, d).index_copy_(0, slots, value.contiguous())
        ones = torch.ones(len(lengths), groups, device=device, dtype=torch.float32)  # vLLM's unquantised scales
        out = torch.empty(t, heads, d, device=device, dtype=q.dtype)
        unified_attention(
            q=q.view(t, heads, d),
            k=k_cache.view(pages, bs, groups, d),
            v=v_cache.view(pages, bs, groups, d),
            out=out,
            cu_seqlens_q=cu,
            max_seqlen_q=most,
            seqused_k=lens,
            max_seqlen_k=most,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=table,
            softcap=0,
            q_descale=None,
            k_descale=ones,
            v_descale=ones,
        )
        return out

    return straight_through(exact, reference, query, key, value)


def convert(chunks):
    """Put a built policy (its GPTModel chunks) on the engine's kernels, in place: megatron's linears become
    the Exact* classes above, and the modules that know the mode (an `exact` attribute: RMSNorm, SwiGLU,
    SDPAttention) are told to use it. Any other
    module holding parameters (MoE, gated delta nets, LoRA adapters, ...) is refused: its kernels would differ
    from the engine's."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, mcore_layers.RowParallelLinear):
                module.__class__ = ExactRowParallelLinear
            elif isinstance(module, mcore_layers.ColumnParallelLinear):
                module.__class__ = ExactColumnParallelLinear
            elif hasattr(module, "exact"):
                module.exact = True
            elif not isinstance(module, VocabParallelEmbedding) and any(True for _ in module.parameters(False)):
                raise ValueError(f"--true-on-policy: {name} ({type(module).__name__}) has no engine-exact kernels")


# ---- log-probabilities ---------------------------------------------------------------------------------------


def token_logprobs(logits, targets, vocab_size):
    """The engine's log-probabilities of `targets` under `logits` (..., V_padded), temperature 1: its sampler's
    kernel over the first vocab_size columns, on logits of the engine's dtype (the kernel, compiled for fp32
    input, sums in another order: measured, 1 ulp off at ~5% of tokens). -> targets' shape, fp32, no autograd."""
    rows = logits.reshape(-1, logits.shape[-1])[:, :vocab_size].to(bound()["logits_dtype"])  # fp32 copies: exact
    ids = targets.reshape(-1, 1).long()
    if bound()["v2_runner"]:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        out = compute_token_logprobs(rows, ids)
    else:  # V1's sampler: log_softmax in fp32 (batch-invariant kernel through vLLM's aten override)
        out = torch.log_softmax(rows.float(), dim=-1).gather(-1, ids)
    return out.view(targets.shape)
