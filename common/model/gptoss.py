"""gpt-oss's layers on megatron's local spec: attention with sinks and sliding windows, YaRN RoPE,
and the experts' clamped SwiGLU. The mapping of the weights: common/model/bridge_gptoss.py.

  SinkAttention   the core attention of every gpt-oss layer (common/model/gpt.py decoder_spec puts a
                  partial of it, window or not per config.layer_types, in each layer's spec)
  ClampedSwiGLU   the experts' activation module
  GptOssExperts   the routed experts: megatron's SequentialMLP loop with the biases added out of place
  gptoss_layer_spec(layer, spec, window)   a layer spec made gpt-oss's

SinkAttention computes, per head h, softmax([q.k_j * scale for the allowed keys j] + [sink_h])
without the sink's column, times v (transformers' eager_attention_forward for gpt-oss): the
sink takes probability mass away from the keys. Allowed keys: causal, in the query's own sample
(packed rows, megatron's THD format), and with a window the last `window` positions up to the
query's own. The sink enters as one more key of value 0 (sink_attention), so the attention is
torch SDPA with a boolean mask: on a GPU the memory-efficient kernel (no (s, s) scores; torch 2.13
has no flash kernel that takes a sink or a window). The weights `softmax_offset` (heads/tp,) are the
megatron name of megatron's "learnable" softmax (transformer_config.softmax_type), split over TP
with the heads.
RoPE is applied here (the GPTModel is built with position_embedding_type "none", as for
SDPAttention): YaRN's inverse frequencies from config.json (bridge_gptoss.rope_frequencies) and its
attention factor m scaling cos and sin, i.e. the scores by m^2.
"""

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from common.model.attention import apply_rope_qk, per_micro_batch
from common.model.moe_experts import GroupedExperts
from common.model.swiglu import SwiGLU


def sink_attention(q, k, v, sinks, allowed, scale):
    """softmax([scale * q.k_j for the allowed keys j] + [sinks_h]) without the sink's column, times v:
    q, k, v (b, heads, s, d) (one key/value head per query head), sinks (heads,), allowed (s, s) or
    (b, 1, s, s) bool. The sink is one more key that every query sees, with value 0: a dimension
    appended to q holding sink / scale, 0 on the keys and 1 on the sink key, makes its score the sink
    logit. Then it is plain masked attention (torch SDPA: on a GPU the memory-efficient kernel, no
    (s, s) scores, only the boolean mask); head dims are padded with zeros (which add nothing) to a
    multiple of 8 for the kernels. The gradient reaches the sinks through q's extra dimension."""
    b, h, s, d = q.shape
    pad = -(d + 1) % 8
    sink = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1)
    q = torch.cat([q, sink, q.new_zeros(b, h, s, pad)], dim=-1)
    sink_key = F.pad(k.new_ones(b, h, 1, 1), (d, pad))  # (b, h, 1, d + 1 + pad): 1 in the sink dimension
    k = torch.cat([sink_key, F.pad(k, (0, 1 + pad))], dim=2)  # (b, h, 1 + s, .)
    v = F.pad(v, (0, 1 + pad, 1, 0))  # the sink's value row 0 first
    allowed = torch.cat([allowed.new_ones(*allowed.shape[:-1], 1), allowed], dim=-1)  # the sink: always seen
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out[..., :d]


class SinkAttention(MegatronModule):
    """Causal attention with a learnable sink logit per head and an optional sliding window."""

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
        gptoss=None,
        window=None,
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.utils import divide

        if config.context_parallel_size > 1:
            raise ValueError("SinkAttention (gpt-oss) has no context-parallel path; use --cp 1")
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise NotImplementedError("SinkAttention: attention dropout (RL runs use 0.0)")
        self.tp_group = pg_collection.tp if pg_collection is not None else mpu.get_tensor_model_parallel_group()
        tp = self.tp_group.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.window = window
        scale = self.head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.softmax_scale = scale * gptoss.attention_factor**2  # YaRN scales cos and sin of q and k
        self.register_buffer("inv_freq", torch.tensor(gptoss.inv_freq, dtype=torch.float32), persistent=False)
        self.softmax_offset = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.softmax_offset, is_parallel=True, dim=0, stride=1)

    def _freqs(self, positions):  # (s,) int64 -> (s, 1, 1, head_dim) fp32 angles, rotate-half layout
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query (s, b, heads/tp, d), key/value (s, b, groups/tp, d); packed: (t, ., d), b = 1.
        -> (s, b, heads/tp * d), packed (t, heads/tp * d)."""
        if attention_bias is not None:
            raise NotImplementedError("SinkAttention: attention_bias is not supported")
        packed = packed_seq_params is not None
        if packed:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"SinkAttention: packed format {packed_seq_params.qkv_format!r}")
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        s, b = query.shape[:2]
        if packed:
            cu = packed_seq_params.cu_seqlens_q

            def layout():  # every token's sample and position in it
                index = torch.arange(s, device=query.device, dtype=cu.dtype)
                seg = torch.searchsorted(cu, index, right=True) - 1
                return seg, (index - cu[seg]).long()

            seg, pos = per_micro_batch(packed_seq_params, ("sink", s), layout)
        else:
            seg, pos = None, torch.arange(s, device=query.device)
        query, key = apply_rope_qk(query, key, self._freqs(pos))
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (b, ., s, d)
        repeat = self.heads // self.groups
        if repeat > 1:  # one key/value head per query head
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        qi, ki = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
        allowed = ki <= qi  # (s, s)
        if self.window is not None:
            allowed = allowed & (qi - ki < self.window)
        if seg is not None:
            allowed = allowed & (seg[:, None] == seg[None, :])
        if attention_mask is not None:  # megatron's convention: True = masked out
            allowed = allowed & ~attention_mask.bool()
        out = sink_attention(q, k, v, self.softmax_offset, allowed, self.softmax_scale)  # (b, heads, s, d)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        return out.squeeze(1) if packed else out

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The sinks as a TP-sharded tensor of distributed checkpoints (split by heads, axis 0),
        as megatron's DotProductAttention does for its learnable softmax offset."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def clamped_swiglu(y, alpha, limit):
    """gpt-oss's expert activation of the fc1 output y (..., 2F) = [gate | up] (megatron's halves):
    gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = torch.chunk(y, 2, -1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLU(SwiGLU):  # a SwiGLU for gpt.py's check that every MLP has its activation module
    """The experts' activation module (megatron's MLP applies it to fc1's output plus bias)."""

    def __init__(self, config, alpha, limit):
        super().__init__(config)
        self.alpha, self.limit = alpha, limit

    def forward(self, y):
        return clamped_swiglu(y, self.alpha, self.limit)


class GptOssExperts(GroupedExperts):
    """gpt-oss's local experts: fc1's bias added before the clamped SwiGLU, fc2's weighted by the router
    probability, as transformers' GptOssExperts. Same parameters and names as SequentialMLP (the bridge,
    the checkpoints and the weight sync are unchanged).

    Where torch's grouped GEMM takes the weights (bf16 on a GPU; a CPU: its reference loop) the experts run
    as GroupedExperts' two grouped GEMMs, the biases gathered per row (the row's expert from the groups'
    row ends: no host sync); else a loop of two GEMMs per expert (the token counts read on the host).
    megatron-core 0.16.1's MLP adds the weighted fc2 bias in place (`output += ...`) to the output of the
    expert-TP reduction, which autograd refuses at ETP = 1 (the reduction returns its input as a view);
    here it is added out of place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # megatron's RowParallelLinear tags fc2's bias `sequence_parallel` (config.sequence_parallel), so
        # finalize_model_grads would sum its gradient over TP, and DDP sums expert gradients over the
        # expert-data-parallel ranks, which at ETP = 1 are those TP ranks again: twice. Each rank's
        # experts see its own tokens, so the expert-DP sum alone is the gradient, as for the weights.
        for expert in self.local_experts:
            if expert.linear_fc2.bias is not None:
                expert.linear_fc2.bias.sequence_parallel = False

    def grouped_path(self):  # the biases and the clamped SwiGLU are this forward's own
        return self.grouped_gemm_takes()

    def forward(self, hidden, tokens_per_expert, probs):
        if not self.grouped_path():
            return self._loop(hidden, tokens_per_expert, probs)
        ends, experts, w1, w2 = self.grouped_weights(tokens_per_expert, hidden.device)
        rows = torch.arange(hidden.shape[0], device=hidden.device, dtype=ends.dtype)
        expert = torch.searchsorted(ends, rows, right=True)  # each row's group; len(experts) past the last
        mine = (expert < len(experts)).unsqueeze(-1)  # rows past ends[-1]: other EP ranks' (mask_tail)
        expert = expert.clamp(max=len(experts) - 1)
        b1 = torch.stack([e.linear_fc1.bias for e in experts])[expert].float()  # (N, 2F/etp)
        b2 = torch.stack([e.linear_fc2.bias for e in experts])[expert].float()  # (N, H)
        p = probs.unsqueeze(-1)
        y = torch.where(mine, torch._grouped_mm(hidden, w1.transpose(1, 2), offs=ends).float() + b1, 0)
        h = (experts[0].activation_func(y) * p).to(hidden.dtype)  # (N, F/etp)
        out = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends) + (b2 * p).to(hidden.dtype)
        return torch.where(mine, out, 0), None  # zeros where other ranks' rows are, as the loop

    def _loop(self, hidden, tokens_per_expert, probs):
        counts = [int(n) for n in tokens_per_expert.tolist()] if self.num_local_experts > 1 else [hidden.shape[0]]
        rows = sum(counts)  # (DeviceSortDispatcher's mask_tail: rows past these are other EP ranks')
        outputs = []
        for expert, x, p in zip(self.local_experts, hidden[:rows].split(counts), probs[:rows].split(counts)):
            fc1, fc2, p = expert.linear_fc1, expert.linear_fc2, p.unsqueeze(-1)
            h = (expert.activation_func(F.linear(x, fc1.weight, fc1.bias)) * p).to(x.dtype)  # (n, F)
            outputs.append(F.linear(h, fc2.weight) + (fc2.bias * p).to(x.dtype))  # (n, H)
        out = torch.cat(outputs)
        if rows < hidden.shape[0]:
            out = torch.cat([out, out.new_zeros(hidden.shape[0] - rows, out.shape[1])])
        return out, None


def gptoss_layer_spec(layer, spec, window):
    """The MoE layer spec `layer` (gpt.py layer_spec, a fresh object) made gpt-oss's: SinkAttention
    (with window: a sliding window of spec.gptoss.sliding_window keys), GptOssExperts with the clamped SwiGLU."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from common.model.bridge_gptoss import ALPHA, LIMIT

    attn = layer.submodules.self_attention.submodules
    attn.core_attention = functools.partial(
        SinkAttention, gptoss=spec.gptoss, window=spec.gptoss.sliding_window if window else None
    )
    layer.submodules.mlp.submodules.experts.module = GptOssExperts
    experts = layer.submodules.mlp.submodules.experts.submodules
    experts.activation_func = ModuleSpec(module=ClampedSwiGLU, params=dict(alpha=ALPHA, limit=LIMIT))
    return layer
