"""Core attention on torch SDPA, a drop-in for megatron-core's local DotProductAttention.

Why: megatron's local spec (no TransformerEngine) computes attention as
baddbmm -> masked softmax -> bmm, materialising the (B, heads/tp, T, T) score matrix:
at T = 4096 that is 0.5 GiB per head group in bf16, and it made a Qwen2-1.5B
fwd+bwd peak at 60 GB on an H200 (shared/device/README.md). `SDPAttention` computes
the same function with torch.nn.functional.scaled_dot_product_attention, which on a
GPU dispatches to the flash / memory-efficient kernels (O(T) memory).

It is selected by a ModuleSpec swap in common/model/gpt.py:layer_spec(attention="sdpa"),
never by patching megatron. It has no parameters, so checkpoints and the HF bridge
are identical with either core attention.

Contract (megatron-core 0.16.1, transformer/attention.py SelfAttention):
  constructed as core_attention(config=, layer_number=, attn_mask_type=, attention_type=,
                                cp_comm_type=, softmax_scale=, pg_collection=)
  forward(query  (sq, b, heads/tp,  head_dim),
          key    (sk, b, groups/tp, head_dim),
          value  (sk, b, groups/tp, head_dim),
          attention_mask: None or bool, True = masked out (megatron's convention),
          attn_mask_type=, attention_bias=None, packed_seq_params=None)
     -> (sq, b, heads/tp * head_dim)
Multi-latent attention (DeepSeek-V3, megatron's MLASelfAttention) also passes k_channels (the
q/k head size, nope + rope) and v_channels (the value head size), one key per query head, and
rotates q and k itself: the output is then (sq, b, heads/tp * v_channels).
Masking follows the local DotProductAttention's torch path: with a causal mask type and
no mask, causal attention; a given mask is used as is (it is not combined with causal).

RoPE: with `rotary` (megatron RotaryEmbedding keywords), q and k are rotated here, by one
compiled call for both (apply_rope_qk, common/rl/fused.py), and the GPTModel is built with
position_embedding_type="none" (common/model/gpt.py) so megatron does not rotate them first. The
same rotation, but megatron-core 0.16.1 applies it without TransformerEngine as ~10 separate
elementwise kernels per tensor (rope_utils._apply_rotary_pos_emb_bshd: cos, sin, casts, two
products, a cat for rotate_half, a sum, a cat with the empty non-rotary part), forward and
backward, in every layer. Positions are 0..T-1 of each row (right-padded rows), or, for
packed rows (megatron's THD format, common/rl/batch.py:packed_micro_batches), each sample's own,
from the cu_seqlens of the PackedSeqParams megatron passes through (SDPAttention._packed).
Context parallelism (a CP group in pg_collection): padded rows in _context_parallel, packed
rows in _packed_context_parallel; both all-gather keys and values over the CP group and let
each token attend the keys at global positions <= its own (in its row, or in its sample). The
padded rows need no mask: each of the rank's two chunks attends the earlier chunks' keys and
its own causally, merged by log-sum-exp (common/model/attention_cp.py, cuDNN on GPUs); packed rows
on GPUs each sample's chunks against their key prefixes through varlen flash attention.
"""

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from common.model.attention_cp import (
    context_parallel_packed_prefixes,
    context_parallel_positions,
    context_parallel_prefix_attention,
    split_kernel,
    split_prefix_attention,
)
from common.rl.fused import on_gpu_compiled


@on_gpu_compiled
def apply_rope(t, freqs):
    """t (s, b, heads, head_dim) rotated by the angles freqs (s, 1, 1, head_dim), fp32 math with one
    rounding to t's dtype. Layout of HF and megatron ("rotate_half"): dimension j < d/2 pairs with
    j + d/2, i.e. out = t * cos + cat(-t[d/2:], t[:d/2]) * sin."""
    x = t.float()
    d = freqs.shape[-1]  # < head_dim: partial RoPE (Qwen3.5), the dims past d pass unrotated
    x, rest = (x, None) if d == x.shape[-1] else (x[..., :d], x[..., d:])
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out = x * torch.cos(freqs) + rotated * torch.sin(freqs)
    return (out if rest is None else torch.cat((out, rest), dim=-1)).to(t.dtype)


@on_gpu_compiled
def apply_rope_qk(query, key, freqs):
    """apply_rope of the queries and of the keys in one compiled call: one graph to guard and
    launch, one autograd node, instead of two per layer and pass (the 1.5B forward passes are
    partly bound by the host's launching, docs/performance.md section 3)."""
    return apply_rope.eager(query, freqs), apply_rope.eager(key, freqs)


class SDPAttention(MegatronModule):
    """Causal self-attention through torch SDPA, GQA and tensor parallel aware.

    Each TP rank holds heads/tp query heads and groups/tp key/value groups (megatron keeps
    whole query groups on a rank), so the per-rank problem is plain GQA with the same
    heads-per-group ratio as the full model.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        rotary=None,
        k_channels=None,
        v_channels=None,
    ):
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection

        # What this module does not implement fails here, at build time, not silently later.
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("SDPAttention: sliding-window attention is not implemented")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPAttention: softmax_type={config.softmax_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError("SDPAttention: attention dropout (RL runs use 0.0)")

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if config.context_parallel_size > 1 else ["tp"]
            )
        tp_size = pg_collection.tp.size()
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = k_channels or config.kv_channels
        self.v_head_dim = v_channels or self.head_dim
        self.hidden_size_per_partition = self.heads_per_partition * self.v_head_dim
        # apply_query_key_layer_scaling divides the scale by layer_number and the local softmax
        # multiplies it back (an fp16 overflow guard): the function is unchanged, so it is
        # ignored here. softmax_scale None means 1/sqrt(head_dim), as in megatron and HF.
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.rotary = None  # RoPE angles per position, cached per sequence length by megatron's module
        if rotary is not None:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            self.rotary = RotaryEmbedding(
                kv_channels=self.head_dim,
                use_cpu_initialization=config.use_cpu_initialization,
                **{"rotary_percent": 1.0, **rotary},
            )

    exact = False  # --true-on-policy (common/model/exact.py convert): the rollout engine's RoPE and attention kernels

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if self.exact:
            return self._exact(query, key, value, attention_mask, packed_seq_params)
        return self._forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    def _exact(self, query, key, value, attention_mask, packed):
        """The forward of --true-on-policy: vLLM's rotary and Triton attention kernels (common/model/exact.py), the
        gradient of this module's own path. Causal samples, padded (s, b, ...) or packed (t, ...) rows."""
        from common.model import exact

        if attention_mask is not None or self.cp_group is not None or self.rotary is None:
            raise NotImplementedError("--true-on-policy: causal self-attention with RoPE, no mask, no CP")
        heads, d = self.heads_per_partition, self.head_dim
        if packed is not None:
            t = query.shape[0]
            lengths = per_micro_batch(packed, "exact_lengths", lambda: tuple(packed.cu_seqlens_q.diff().tolist()))

            def reference(q, k, v):
                return self._packed(q, k, v, packed).view(t, heads, d)

            out = exact.attention(query, key, value, lengths, d**-0.5, reference)  # vLLM's scale: head_dim**-0.5
            return out.reshape(t, heads * d)
        sq, b = query.shape[:2]

        def tokens(x):  # (s, b, h, d) -> (b * s, h, d): each row one sequence
            return x.transpose(0, 1).reshape(b * sq, *x.shape[2:])

        def untokens(x):  # (b * s, ...) -> (s, b, heads * d)
            return x.reshape(b, sq, heads * d).transpose(0, 1).contiguous()

        def reference(q, k, v):
            out = self._forward(*(x.view(b, sq, *x.shape[1:]).transpose(0, 1) for x in (q, k, v)), None)
            return out.transpose(0, 1).reshape(b * sq, heads, d)

        return untokens(exact.attention(tokens(query), tokens(key), tokens(value), (sq,) * b, d**-0.5, reference))

    def _forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            return self._context_parallel(query, key, value)
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported")
        sq, b = query.shape[:2]
        sk = key.shape[0]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.rotary is not None:
            if sq != sk:
                raise NotImplementedError("SDPAttention: RoPE for decoding with a KV cache is not implemented")
            freqs = self.rotary(sq)  # (sq, 1, 1, head_dim) fp32, positions 0..sq-1
            query, key = apply_rope_qk(query, key, freqs)

        # (s, b, heads, d) -> (b, heads, s, d): strided views, the head_dim stays contiguous
        # (all the kernels need).
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            # sq == 1 is one new token against its context (the local path uses no mask then).
            is_causal = mask_type == AttnMaskType.causal and sq > 1
            if is_causal and sq != sk:
                raise ValueError(f"SDPAttention: causal attention needs sq == sk, got {sq} != {sk}")
            # enable_gqa: the kernels index the shared k/v group for each query head instead of
            # materialising repeated k/v (flash supports it on CUDA; elsewhere torch repeats).
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=self.heads_per_partition != self.groups_per_partition,
            )
        else:
            # An explicit mask (b or 1, 1 or heads, sq, sk), True = do not attend. The GQA fast
            # path needs mask-free kernels, so repeat k/v to one per query head here.
            k, v = self._kv_per_query_head(k, v, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), scale=self.softmax_scale)
        # (b, heads, sq, d) -> (sq, b, heads * d)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query, key, value, params):
        """Packed samples (megatron's THD format: common/rl/batch.py:packed_micro_batches):
        query (t, heads/tp, d), key/value (t, groups/tp, d), every sample its own causal
        attention, RoPE positions restarting at each cu_seqlens boundary. On a GPU in
        bf16/fp16: torch's varlen flash attention (no (t, t) anything); elsewhere SDPA with
        the block-diagonal causal mask (the CPU tests' path). -> (t, heads/tp * d)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed format {params.qkv_format!r} (only 'thd')")
        if self.cp_group is not None:
            return self._packed_context_parallel(query, key, value, params)
        cu = params.cu_seqlens_q
        t = query.shape[0]

        def layout():  # (t,) each: every token's index in the row, its sample, its position in the sample
            index = torch.arange(t, device=query.device, dtype=cu.dtype)
            seg = torch.searchsorted(cu, index, right=True) - 1
            return index, seg, (index - cu[seg]).long()

        index, seg, position = per_micro_batch(params, ("packed", t), layout)
        if self.rotary is not None:
            freqs = self.rotary(params.max_seqlen_q)[position]  # (t, 1, 1, d): own positions
            query, key = (x.squeeze(1) for x in apply_rope_qk(query.unsqueeze(1), key.unsqueeze(1), freqs))
        if varlen_usable(query):
            out = self._varlen(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_kv)
        else:
            allowed = (seg[:, None] == seg[None, :]) & (index[:, None] >= index[None, :])  # (t, t)
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # (1, heads, t, d)
            k, v = self._kv_per_query_head(k, v, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
            out = out.squeeze(0).permute(1, 0, 2)  # (t, heads, d)
        return out.reshape(t, self.hidden_size_per_partition)

    def _context_parallel(self, query, key, value):
        """Context parallelism (common/rl/batch.py:context_parallel_slice): this rank holds chunks
        r and 2cp-1-r of every sequence (q, k, v (s, b, ., d), s = 2 chunks). Its keys and
        values are all-gathered over the CP group (the Llama 3 recipe; the backward
        reduce-scatters their gradients back), and each query attends every key at a global
        position <= its own, without a mask (common/model/attention_cp.py): each chunk against the
        earlier chunks' keys (unmasked) and its own (causal), merged by log-sum-exp, through
        cuDNN's attention on GPUs in half precision and torch's flash kernels on a CPU
        (split_prefix_attention). Where those do not apply (MLA's value head size differs;
        CUDA in fp32): each chunk against its key prefix through varlen flash attention
        (context_parallel_prefix_attention), else SDPA with the (s, cp*s) mask. RoPE uses the
        global positions."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        cp, rank = self.cp_group.size(), self.cp_group.rank()
        sq = query.shape[0]
        q_pos = context_parallel_positions(sq, cp, rank, query.device)
        if self.rotary is not None:
            freqs = self.rotary(sq * cp)  # megatron's module keeps this CP rank's positions (same layout)
            freqs = freqs if freqs.shape[0] == sq else freqs[q_pos]  # (s, 1, 1, d)
            query, key = apply_rope_qk(query, key, freqs)
        key, value = (
            gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.cp_group)
            for x in (key, value)
        )  # (cp * s, b, groups, d), rank after rank
        kernel = split_kernel(query) if key.shape[-1] == value.shape[-1] else None
        if kernel is not None:
            out = split_prefix_attention(query, key, value, cp, rank, self.softmax_scale, kernel)
        elif varlen_usable(query):  # flash: each chunk against its key prefix, bottom-right causal
            out = context_parallel_prefix_attention(query, key, value, cp, rank, self._varlen)
        else:
            k_pos = torch.cat([context_parallel_positions(sq, cp, r, query.device) for r in range(cp)])
            allowed = k_pos[None, :] <= q_pos[:, None]  # (s, cp * s): causal in global positions
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            k, v = self._kv_per_query_head(k, v, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
            out = out.permute(2, 0, 1, 3)
        return out.reshape(sq, query.shape[1], self.hidden_size_per_partition)

    def _packed_context_parallel(self, query, key, value, params):
        """Packed rows under context parallelism (megatron's THD + CP convention,
        common/rl/batch.py:thd_context_parallel_layout): params.cu_seqlens_q are the WHOLE row's
        sample boundaries (each sample a multiple of 2 * cp long) and this rank holds chunks r
        and 2cp-1-r of every sample: query (t/cp, heads/tp, d), key/value (t/cp, groups/tp, d).
        Keys and values are all-gathered over the CP group (as in _context_parallel: the
        backward reduce-scatters their gradients); a query attends the keys of its own sample
        at a position within the sample <= its own. RoPE angles are of each token's position
        in its sample. -> (t/cp, heads/tp * v_d).
        On GPUs (varlen_usable): varlen flash attention once, each of the rank's 2 chunks of a
        sample one query sequence against the sample's key prefix up to that chunk's end
        (context_parallel_packed_prefixes; flash's causal mask is bottom-right aligned when q
        is shorter than k), so no mask. Elsewhere masked SDPA with a (t/cp, t) boolean mask:
        exact, but O(t^2 / cp) mask memory."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        from common.rl.batch import thd_context_parallel_layout

        cp, rank = self.cp_group.size(), self.cp_group.rank()
        t = query.shape[0]
        cu = params.cu_seqlens_q
        q_sample, q_pos = per_micro_batch(
            params,
            ("cp", t, cp, rank),  # (t/cp,) each
            lambda: thd_context_parallel_layout(cu, cp, rank, t),
        )
        if self.rotary is not None:
            # packed_seq=True: the whole table, not megatron's slice of it for this CP rank
            freqs = self.rotary(params.max_seqlen_q, packed_seq=True)[q_pos]  # (t/cp, 1, 1, d)
            query, key = (x.squeeze(1) for x in apply_rope_qk(query.unsqueeze(1), key.unsqueeze(1), freqs))
        key, value = (
            gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.cp_group)
            for x in (key, value)
        )  # (cp * t/cp, groups, d), rank after rank
        if varlen_usable(query):  # flash: each sample's two chunks against their key prefixes, no mask
            index, cu_q, cu_k = per_micro_batch(
                params, ("cp prefixes", t, cp, rank), lambda: context_parallel_packed_prefixes(cu, cp, rank, t * cp)
            )
            chunk = params.max_seqlen_q // (2 * cp)  # the longest chunk (max_seqlen: the longest sample)
            out = self._varlen(
                query,
                key.index_select(0, index),
                value.index_select(0, index),
                cu_q,
                cu_k,
                chunk,
                (2 * cp - rank) * chunk,
            )
            return out.reshape(t, self.hidden_size_per_partition)
        k_sample, k_pos = (
            torch.cat(parts) for parts in zip(*(thd_context_parallel_layout(cu, cp, r, t) for r in range(cp)))
        )  # (t,) each
        allowed = (q_sample[:, None] == k_sample[None, :]) & (k_pos[None, :] <= q_pos[:, None])  # (t/cp, t)
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))  # (1, heads, ., d)
        k, v = self._kv_per_query_head(k, v, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        return out.squeeze(0).permute(1, 0, 2).reshape(t, self.hidden_size_per_partition)

    def _varlen(self, query, key, value, cu_q, cu_k, max_q, max_k):
        """torch's varlen flash attention, causal (bottom-right aligned where a query sequence is
        shorter than its key sequence, as in flash attention): query (t_q, heads/tp, d), key /
        value (t_k, groups/tp, d), sequences cut at cu_q / cu_k. -> (t_q, heads/tp, v_d)."""
        from torch.nn.attention.varlen import varlen_attn

        gqa_flag = {}
        if self.heads_per_partition != self.groups_per_partition:
            if _varlen_takes_gqa():
                gqa_flag = dict(enable_gqa=True)
            else:  # torch < 2.13's varlen_attn: one k/v head per query head
                key, value = self._kv_per_query_head(key, value, dim=1)
        # MLA: flash wants one head size. Zero columns change nothing: in the values they
        # only pad the output (cut off below), in q and k they add 0 to every score.
        size = max(self.head_dim, self.v_head_dim)
        query, key, value = (F.pad(x, (0, size - x.shape[-1])) for x in (query, key, value))
        out = varlen_attn(
            query, key, value, cu_q, cu_k, max_q, max_k, scale=self.softmax_scale, window_size=(-1, 0), **gqa_flag
        )  # (-1, 0): causal
        return out[..., : self.v_head_dim]

    def _kv_per_query_head(self, key, value, dim):
        """key/value with their groups repeated to one per query head along `dim` (GQA for the
        kernels without it: masked SDPA, older varlen attention); unchanged without GQA."""
        repeat = self.heads_per_partition // self.groups_per_partition
        if repeat == 1:
            return key, value
        return key.repeat_interleave(repeat, dim=dim), value.repeat_interleave(repeat, dim=dim)


def per_micro_batch(params, key, make):
    """make(), computed by the first layer that asks for a micro-batch's packed layout and
    reused by the others (and by recompute): kept on the micro-batch's PackedSeqParams, which
    megatron hands to every layer. Saves each layer ~10 small kernels of index arithmetic."""
    cache = params.__dict__.setdefault("_sdpa_layouts", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def varlen_usable(query):
    """torch's varlen attention runs: flash attention, CUDA, half precision (VARLEN = False
    forces the masked-SDPA path, e.g. to compare the two on a GPU)."""
    if not (VARLEN and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


VARLEN = True


@functools.cache
def _varlen_takes_gqa():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters
