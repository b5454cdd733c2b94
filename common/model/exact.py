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
                    backend (TRITON_ATTN): batch-invariant, it is one kernel whose per-query order is the same in
                    prefill and decode (vLLM's default on Hopper, FlashAttention, was not made to match);
     SwiGLU         vLLM's silu_and_mul;
     log-probs      vLLM's sampler kernel (compute_token_logprobs) over the logits in the engine's dtype.
   The backward of each is the gradient of the usual (mathematically equal) function, recomputed from the saved
   inputs: the kernels vLLM ships have no backward. So the update's gradient is the usual one, to rounding.

`bind(engine)` reads what the engine decided at start-up (its rotary table, page size, model runner) after it
started and fills KERNELS with vLLM's functions (tests/test_exact.py puts torch references there); `convert` is
called by common/run/build.py load_model(exact=True). Scope: dense attention models (Qwen2, Qwen2.5, Llama,
Mistral, Qwen3), bf16, temperature 1 without top-p, context parallel size 1, tensor parallel size N with the engine
at --rollout-tp N: each rank multiplies the same weight shards as its vLLM rank, both sides add a row-parallel
layer's partial sums with one all-reduce, and the logits' vocabulary shards are gathered before the sampler's
kernel (token_logprobs), as vLLM gathers them. common/run/layout_checks.py refuses the rest at start. Costs:
vLLM without CUDA graphs and on batch-invariant kernels, the trainer on the same kernels plus a recomputed forward
of each swapped op in the backward (docs/algorithms.md measures both).
"""

import functools
import types

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel import mappings

from common.model.linear import save_linear_context

ENGINE = {}  # bind(): the engine's rotary table, is_neox, page size, the sampler's logits dtype
KERNELS = None  # bind(): vLLM's functions (a namespace: linear rms_norm rotary attention silu_and_mul token_logprobs)


def bind(engine):
    """Record the engine's start-up choices that the trainer's kernels must repeat (call after the engine
    started, before the first forward). engine: a VLLMEngine started with batch_invariant=True."""
    import os

    global KERNELS
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise RuntimeError("--true-on-policy: the engine was started without VLLM_BATCH_INVARIANT=1")
    config = engine.llm.llm_engine.vllm_config
    backend = config.attention_config.backend
    if backend is None or backend.name != "TRITON_ATTN":
        raise RuntimeError(
            "--true-on-policy: the engine must run vLLM's TRITON_ATTN backend (VLLMEngine batch_invariant)"
        )
    rotary = next(m for name, m in engine.model.named_modules() if name.endswith("rotary_emb"))
    ENGINE.update(
        cos_sin=rotary.cos_sin_cache.detach().clone(),  # the table vLLM rotates with (bf16, built on the GPU)
        is_neox=rotary.is_neox_style,
        block_size=config.cache_config.block_size,
        logits_dtype=config.model_config.dtype,  # the sampler's logits: its kernel's reduction follows their dtype
    )
    KERNELS = _vllm_kernels(v2_runner=config.use_v2_model_runner)
    from vllm.model_executor.layers import layernorm

    layernorm.rms_norm_batch_invariant = _unfused_rms_norm  # the engine's norms, from its next forward on
    from common.rl import logprobs

    logprobs.EXACT_TOKEN_LOGPROBS = token_logprobs


def _vllm_kernels(v2_runner):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    if v2_runner:  # the V2 model runner's sampler
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs as token_logprobs
    else:  # V1's: log_softmax in fp32 (batch-invariant through vLLM's aten override)

        def token_logprobs(rows, ids):
            return torch.log_softmax(rows.float(), dim=-1).gather(-1, ids)

    return types.SimpleNamespace(
        linear=linear_batch_invariant,
        rms_norm=rms_norm_batch_invariant,
        rotary=ops.rotary_embedding,
        attention=unified_attention,
        silu_and_mul=torch.ops._C.silu_and_mul,
        token_logprobs=token_logprobs,
    )


def kernels():
    if KERNELS is None:
        raise RuntimeError("--true-on-policy: common.model.exact.bind(engine) was not called before the forward")
    return KERNELS


def _unfused_rms_norm(input, weight, eps=1e-6, residual=None):
    """vLLM's batch-invariant RMSNorm with its residual add unfused: the add in bf16 (as its fused kernel adds),
    then its Triton rms_norm. vLLM 0.26's fused_add_rms_norm picks its threads per row by the batch's size
    (1024 below 256 tokens, else 256), so a row's sum depends on how many tokens share the step (measured at
    hidden sizes 896 and 3584, not at 512): the trainer's rows would differ from the engine's."""
    if residual is None:
        return KERNELS.rms_norm(input, weight, eps)
    residual = input + residual
    return KERNELS.rms_norm(residual, weight, eps), residual


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
    context fields set here, megatron-core 0.16.1). With sequence parallelism the input's sequence shards are
    gathered first (a copy: the engine's rows, exactly), as megatron's forward gathers them."""

    @staticmethod
    @mcore_layers.custom_fwd
    def forward(
        ctx, input, weight, bias, accumulation_fusion, allreduce_dgrad, sequence_parallel, buffer, limit, group
    ):
        save_linear_context(
            ctx, input, weight, bias, accumulation_fusion, allreduce_dgrad, sequence_parallel, buffer, limit, group
        )  # with sequence parallelism the backward gathers the saved shard again and reduce-scatters dgrad
        if sequence_parallel:
            gathered = input.new_empty((input.shape[0] * group.size(), *input.shape[1:]))
            mcore_layers.dist_all_gather_func(gathered, input.contiguous(), group=group)
            input = gathered
        return kernels().linear(input, weight, bias)


def _exact_forward_impl(self, input, weight, *args, **kwargs):
    if args or not weight.requires_grad:  # frozen weights (the reference model): megatron's path
        return super(type(self), self)._forward_impl(input, weight, *args, **kwargs)
    return _ExactLinear.apply(
        input,
        weight,
        kwargs.get("bias"),
        kwargs["gradient_accumulation_fusion"],
        kwargs["allreduce_dgrad"],
        bool(kwargs.get("sequence_parallel")),
        kwargs.get("grad_output_buffer"),
        kwargs.get("wgrad_deferral_limit"),
        kwargs.get("tp_group") or parallel_state.get_tensor_model_parallel_group(),  # (RowParallelLinear: None)
    )


class ExactColumnParallelLinear(mcore_layers.ColumnParallelLinear):
    _forward_impl = _exact_forward_impl


class ExactRowParallelLinear(mcore_layers.RowParallelLinear):
    _forward_impl = _exact_forward_impl


def convert(chunks):
    """Put a built policy (its GPTModel chunks) on the engine's kernels, in place: megatron's linears become
    the Exact* classes above, and the modules that know the mode (an `exact` attribute: RMSNorm, SwiGLU,
    SDPAttention) are told to use it. Any other module holding parameters (MoE, gated delta nets, LoRA
    adapters, ...) is refused: its kernels would differ from the engine's."""
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


# ---- norms, activation, attention ---------------------------------------------------------------------------


def rms_norm(x, weight, eps):
    """vLLM's batch-invariant RMSNorm of x (its Triton kernel, which the engine's norms run after bind())."""

    def exact(x, weight):
        return kernels().rms_norm(x, weight, eps)

    def reference(x, weight):
        return torch.nn.functional.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)

    return straight_through(exact, reference, x, weight)


def silu_and_mul(y, reference):
    """silu(a) * b of y's halves by vLLM's silu_and_mul; the gradient of reference(y)."""

    def exact(y):
        out = y.new_empty(*y.shape[:-1], y.shape[-1] // 2)
        kernels().silu_and_mul(out, y.contiguous())
        return out

    return straight_through(exact, reference, y)


@functools.lru_cache(maxsize=4)
def paged_layout(lengths, block_size, device):
    """The engine's view of sequences of `lengths` (a tuple) stored one after another: (cu_seqlens_q, seq_lens,
    positions, slots, block_table, pages). Sequence i owns pages [first[i], first[i] + n[i]) of block_size
    tokens; token j of it sits in slot first[i] * block_size + j. Cached: every layer of a micro-batch asks for
    the same layout (its host syncs once, not per layer); the tensors are only read."""
    lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    blocks = (lens + block_size - 1) // block_size
    first = torch.cumsum(blocks, 0) - blocks
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens.long())
    pos = torch.arange(int(cu[-1]), device=device) - cu[seq].long()  # each token's position in its sequence
    slots = first[seq].long() * block_size + pos
    table = first[:, None] + torch.arange(max(int(blocks.max()), 1), device=device)[None, :]
    last = (first + blocks - 1).clamp(min=0)
    table = torch.minimum(table, last[:, None]).to(torch.int32)  # columns past a sequence's pages: a real page
    return cu, lens, pos, slots, table, int(blocks.sum())


def attention(query, key, value, lengths, scale, reference):
    """Causal attention of packed sequences the engine's way: query (t, heads, d), key / value (t, groups, d)
    before RoPE, the sequences of `lengths` (a tuple) one after another, each starting at position 0.
    -> (t, heads, d). reference(query, key, value): the same function in differentiable ops (its gradient)."""
    k_ = kernels()
    t, heads, d = query.shape
    groups, bs = key.shape[1], ENGINE["block_size"]
    cu, lens, pos, slots, table, pages = paged_layout(lengths, bs, query.device)

    def exact(query, key, value):
        q, k = query.reshape(t, heads * d).clone(), key.reshape(t, groups * d).clone()
        k_.rotary(pos, q, k, d, ENGINE["cos_sin"], ENGINE["is_neox"])  # in place
        k_cache = q.new_zeros(pages * bs, groups, d).index_copy_(0, slots, k.view(t, groups, d))
        v_cache = q.new_zeros(pages * bs, groups, d).index_copy_(0, slots, value.contiguous())
        ones = torch.ones(len(lengths), groups, device=q.device, dtype=torch.float32)  # vLLM's unquantised scales
        out = torch.empty(t, heads, d, device=q.device, dtype=q.dtype)
        k_.attention(
            q=q.view(t, heads, d),
            k=k_cache.view(pages, bs, groups, d),
            v=v_cache.view(pages, bs, groups, d),
            out=out,
            cu_seqlens_q=cu,
            max_seqlen_q=max(lengths),
            seqused_k=lens,
            max_seqlen_k=max(lengths),
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


# ---- log-probabilities ---------------------------------------------------------------------------------------


def token_logprobs(logits, targets, vocab_size, tp_group=None):
    """The engine's log-probabilities of `targets` under `logits` (..., V_padded, or with tp_group this rank's
    vocabulary shard of them, gathered first as vLLM gathers its shards), temperature 1: its sampler's kernel
    over the first vocab_size columns, on logits of the engine's dtype (the kernel, compiled for fp32 input, sums
    in another order: measured, 1 ulp off at ~5% of tokens). -> targets' shape, fp32, no autograd."""
    if tp_group is not None:
        logits = mappings.gather_from_tensor_model_parallel_region(logits, group=tp_group)
    rows = logits.reshape(-1, logits.shape[-1])[:, :vocab_size].to(ENGINE["logits_dtype"])  # fp32 copies: exact
    return kernels().token_logprobs(rows, targets.reshape(-1, 1).long()).view(targets.shape)
