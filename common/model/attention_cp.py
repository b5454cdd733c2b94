"""Causal attention of one context-parallel rank's chunks without a mask: each chunk against
the keys before it (no mask) and against its own keys (causal, square), one attention kernel
call per part, merged by their log-sum-exps.

Why: under context parallelism (common/model/attention.py SDPAttention._context_parallel) a rank
holds chunks r and 2cp-1-r of every sequence and attends the keys gathered over the CP group
up to each token's global position. Flash attention with a bottom-right causal mask does that
in one call (torch's varlen attention; context_parallel_prefix_attention below), but torch
serves it with its bundled flash-attention-2 kernels, and on H100/H200 cuDNN's attention (what
SDPA picks for plain causal rows) is the faster kernel. cuDNN's causal mask is top-left only,
so each chunk is split where the mask changes: the keys of the earlier chunks are all visible
(no mask) and the chunk's own keys are a square causal block. The two partial results merge
exactly: out = sum_i exp(lse_i - lse) out_i with lse = logsumexp_i lse_i (lse: each query
row's log-sum-exp of its scores); the backward runs each part's kernel backward with the
merged output and log-sum-exp, which is that part's share of the exact gradient (the
identity ring attention uses).

Kernels (`KERNELS`): cuDNN's SDPA ops on CUDA in bf16/fp16; torch's CPU flash-attention ops on
a CPU (the CPU tests run this same split). Both are torch ops with a log-sum-exp output.

Also here: the layouts of the rank's chunks (context_parallel_positions) and of the key
prefixes the varlen kernels take (context_parallel_prefixes for padded rows where the split
does not apply, e.g. MLA's different value head size; context_parallel_packed_prefixes for
packed rows).
"""

import functools

import torch

aten = torch.ops.aten


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(grad, q, k, v, out, lse, state, causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale
    )


def _cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_backward(grad, q, k, v, out, lse, state, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, scale=scale)


# name -> (forward, backward, takes grouped k/v natively)
KERNELS = {"cudnn": (_cudnn_forward, _cudnn_backward, True), "cpu": (_cpu_forward, _cpu_backward, False)}
SPLIT = True


def split_kernel(query):
    """The kernel for split_prefix_attention on query's device and dtype, or None (CUDA in fp32:
    cuDNN's attention is half precision only; SPLIT = False, e.g. to compare with the varlen path)."""
    if not SPLIT:
        return None
    if query.is_cuda:
        return (
            "cudnn" if query.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available() else None
        )
    return "cpu" if query.device.type == "cpu" else None


class _UnionAttention(torch.autograd.Function):
    """Softmax attention of q (b, heads, s, d) over the union of key parts [(k, v) (b, groups,
    s_i, d)], each part causal (square, top-left) or not; one kernel call per part, merged by
    log-sum-exp. Backward: each part's kernel backward with the merged output and lse."""

    @staticmethod
    def forward(ctx, q, kernel, scale, causal, *kv):
        forward, _, grouped = KERNELS[kernel]
        repeat = q.shape[1] // kv[0].shape[1]
        ks, vs = kv[0::2], kv[1::2]
        if not grouped and repeat > 1:
            ks, vs = ([x.repeat_interleave(repeat, 1) for x in xs] for xs in (ks, vs))
        parts = [forward(q, k, v, c, scale) for k, v, c in zip(ks, vs, causal)]
        b, h, s = q.shape[:3]
        lses = torch.stack([lse.reshape(b, h, s).float() for _, lse, _ in parts])
        lse = torch.logsumexp(lses, 0)
        merged = sum(torch.exp(l - lse).unsqueeze(-1) * o.float() for l, (o, _, _) in zip(lses, parts))
        out = torch.empty_like(parts[0][0])  # the kernel's own output layout, which its backward expects
        out.copy_(merged)
        ctx.kernel, ctx.scale, ctx.causal, ctx.repeat, ctx.grouped = kernel, scale, causal, repeat, grouped
        ctx.states = [state for _, _, state in parts]
        ctx.lse_shape = parts[0][1].shape
        ctx.save_for_backward(q, out, lse, *ks, *vs)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out, lse, *kv = ctx.saved_tensors
        n = len(ctx.causal)
        ks, vs = kv[:n], kv[n:]
        _, backward, _ = KERNELS[ctx.kernel]
        lse = lse.reshape(ctx.lse_shape).contiguous()
        g = torch.empty_like(out)
        g.copy_(grad)
        dq, dkv = None, []
        for k, v, state, c in zip(ks, vs, ctx.states, ctx.causal):
            dq_i, dk, dv = backward(g, q, k, v, out, lse, state, c, ctx.scale)
            dq = dq_i.float() if dq is None else dq + dq_i  # the parts' query gradients summed in fp32
            if not ctx.grouped and ctx.repeat > 1:  # the repeated groups' gradients summed back
                dk, dv = (x.unflatten(1, (-1, ctx.repeat)).sum(2) for x in (dk, dv))
            dkv += [dk, dv]
        return (dq.to(q.dtype), None, None, None, *dkv)


def union_attention(q, parts, kernel, scale):
    """q (b, heads, s, d) attending the union of parts [(k, v, causal)], k/v (b, groups, s_i, d),
    empty parts skipped. -> (b, heads, s, v_d)."""
    parts = [p for p in parts if p[0].shape[2] > 0]
    kv = [x for k, v, _ in parts for x in (k, v)]
    return _UnionAttention.apply(q, kernel, scale, tuple(c for _, _, c in parts), *kv)


@functools.lru_cache(maxsize=64)
def _earlier_index(s, cp, rank, device):
    """Where the keys before each of CP rank `rank`'s two chunks sit in the keys gathered over the
    CP group: the first chunk (global chunk rank) sees global chunks 0..rank-1, the second
    (global chunk 2cp-1-rank) sees 0..2cp-2-rank. Returns the two index tensors (global order)."""
    h, order = s // 2, _gathered_order(s, cp)
    return order[: rank * h].to(device), order[: (2 * cp - 1 - rank) * h].to(device)


def split_prefix_attention(query, key, value, cp, rank, scale, kernel):
    """CP rank `rank`'s causal attention without a mask (the module docstring): query (s, b,
    heads, d) = its chunks rank and 2cp-1-rank; key / value gathered over the CP group (cp * s,
    b, groups, d), rank after rank. Each chunk attends its earlier keys (no mask) and its own
    (causal), merged exactly. -> (s, b, heads, v_d)."""
    s = query.shape[0]
    h = s // 2
    earlier = _earlier_index(s, cp, rank, query.device)
    own = (slice(rank * s, rank * s + h), slice(rank * s + h, (rank + 1) * s))  # the rank's own chunks, gathered
    outs = []
    for c in range(2):
        q = query[c * h : (c + 1) * h].permute(1, 2, 0, 3)  # (b, heads, h, d)
        k_own, v_own = (x[own[c]].permute(1, 2, 0, 3) for x in (key, value))
        k_early, v_early = (x.index_select(0, earlier[c]).permute(1, 2, 0, 3) for x in (key, value))
        outs.append(union_attention(q, [(k_early, v_early, False), (k_own, v_own, True)], kernel, scale))
    return torch.cat(outs, 2).permute(2, 0, 1, 3)  # (s, b, heads, v_d)


def context_parallel_prefixes(s, cp, rank):
    """The key prefixes of CP rank `rank`'s two chunks (common/rl/batch.py:context_parallel_slice:
    chunks rank and 2cp-1-rank of a sequence of 2cp chunks of h = s/2 tokens) in the keys
    all-gathered over the CP group (cp * s, rank after rank). Returns (index, lengths): index
    (L,) picks from the gathered keys, in global order, positions 0..(rank+1)h-1 (what the
    first chunk attends) and then 0..(2cp-rank)h-1 (the second chunk's), lengths = those two
    counts. With causal attention aligned bottom-right, query i of a chunk sees exactly the
    keys at global positions <= its own."""
    h, order = s // 2, _gathered_order(s, cp)
    lengths = [(rank + 1) * h, (2 * cp - rank) * h]
    return torch.cat([order[:n] for n in lengths]), lengths


def _gathered_order(s, cp):
    """Global position -> its row in the keys gathered over the CP group (cp * s rows, rank after
    rank; rank r's s rows are its chunks r and 2cp-1-r of h = s/2 tokens): (2cp * h,)."""
    h = s // 2
    chunk = torch.arange(2 * cp)
    start = torch.where(chunk < cp, chunk * s, (2 * cp - 1 - chunk) * s + h)  # where global chunk c was gathered
    return (start[:, None] + torch.arange(h)).reshape(-1)


def context_parallel_prefix_attention(query, key, value, cp, rank, varlen):
    """Causal attention of CP rank `rank`'s tokens without a mask: each of its two chunks (per
    row) is one query sequence against its key prefix (context_parallel_prefixes), through
    varlen(q, k, v, cu_q, cu_k, max_q, max_k) -- flash attention, causal bottom-right.
    query (s, b, heads, d); key / value all-gathered (cp * s, b, groups, d). -> (s, b, heads, v_d)."""
    s, b = query.shape[:2]
    index, cu_q, cu_k, max_k = _prefix_layout(s, b, cp, rank, query.device)
    total = index.numel()
    q = query.transpose(0, 1).reshape(b * s, *query.shape[2:])  # row after row: chunk, chunk
    k, v = (x.index_select(0, index).transpose(0, 1).reshape(b * total, *x.shape[2:]) for x in (key, value))
    out = varlen(q, k, v, cu_q, cu_k, s // 2, max_k)  # (b * s, heads, v_d)
    return out.reshape(b, s, *out.shape[1:]).transpose(0, 1)


@functools.lru_cache(maxsize=64)
def _prefix_layout(s, b, cp, rank, device):
    """context_parallel_prefix_attention's index and cu_seqlens, on `device`: made once per
    shape, not copied to the device again in every layer (each copy is a host sync)."""
    index, lengths = context_parallel_prefixes(s, cp, rank)
    cu_q = torch.arange(2 * b + 1, dtype=torch.int32) * (s // 2)
    cu_k = torch.tensor([0] + lengths * b, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return index.to(device), cu_q.to(device), cu_k.to(device), max(lengths)


@functools.lru_cache(maxsize=64)
def context_parallel_positions(s, cp, rank, device):
    """Global positions (s,) of CP rank `rank`'s s tokens of a row (its chunks rank and
    2cp-1-rank, s/2 tokens each: common/rl/batch.py:context_parallel_slice), on `device`; made
    once per shape."""
    chunk = s // 2
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    ).to(device)


def context_parallel_packed_prefixes(cu_seqlens, cp, rank, length):
    """context_parallel_prefixes for a packed row (megatron's THD + CP layout,
    common/rl/batch.py:thd_context_parallel_layout): the whole row of `length` tokens holds samples
    at cu_seqlens (each a multiple of 2cp long), each cut into 2cp chunks of c_s tokens, and CP
    rank `rank` holds chunks rank and 2cp-1-rank of every sample, sample after sample. Returns
    (index, cu_q, cu_k), all on cu_seqlens' device, no host sync: cu_q cuts the rank's own
    tokens into its 2 chunks per sample (query sequences), index picks from the keys gathered
    over the CP group (length tokens, rank after rank) each chunk's key prefix within its
    sample, positions 0..(rank+1)c_s-1 and 0..(2cp-rank)c_s-1, and cu_k cuts those."""
    cu = cu_seqlens.long()
    device, local = cu.device, length // cp
    chunk = (cu[1:] - cu[:-1]) // (2 * cp)  # (S,)
    local_start = cu[:-1] // cp  # where each sample begins in a rank's own row
    zero = torch.zeros(1, dtype=torch.long, device=device)
    q_lengths = chunk.repeat_interleave(2)
    k_lengths = torch.stack([(rank + 1) * chunk, (2 * cp - rank) * chunk], 1).reshape(-1)
    cu_q, cu_k = (torch.cat([zero, lengths.cumsum(0)]) for lengths in (q_lengths, k_lengths))
    total = (2 * cp + 1) * (length // (2 * cp))  # = cu_k[-1] when every sample divides by 2cp
    j = torch.arange(total, device=device)
    seq = torch.searchsorted(cu_k, j, right=True) - 1
    sample = seq // 2
    position = j - cu_k[seq]  # within the sample
    c = chunk[sample]
    k = position // c  # the sample's global chunk
    owner = torch.where(k < cp, k, 2 * cp - 1 - k)
    index = owner * local + local_start[sample] + (k >= cp) * c + position % c
    return index, cu_q.int(), cu_k.int()
