"""The gated delta net (Qwen3.5's linear-attention layers), as a megatron self-attention module.

    GatedDeltaNet            the layer's token mixer: in_proj -> causal depthwise conv -> gated delta
                             rule -> gated RMSNorm -> out_proj; tensor parallel over heads
    chunk_gated_delta_rule   the recurrence in chunks (pure torch, autograd through it)
    fla_gated_delta_rule     the recurrence on flash-linear-attention's fused kernels (GPU)

The recurrence runs on one of two kernels (build_model's gdn_kernel, the scripts' --gdn-kernel):
  torch  chunk_gated_delta_rule below (the default): any device, fp32 inside, packed samples as a
         padded batch;
  fla    the fused Triton kernels of flash-linear-attention (the `fla-core` package, forward and
         backward; what vLLM runs for these layers too): CUDA only, packed samples by cu_seqlens.
         Opt-in: refused where fla cannot train (common/model/gdn_kernels.py), which includes Hopper
         GPUs with Triton 3.4-3.7.0, the pinned GPU stack's case. docs/models.md says what was checked.

Why not megatron-core 0.16.1's GatedDeltaNet (ssm/gated_delta_net.py): it imports the `fla`
package at construction (not in the pinned stack), refuses packed sequences and context
parallelism, and its in_proj is one column-parallel weight whose TP layout is a plain chunk of
[qkv, z, b, a]; this one keeps the same math, runs on a CPU, restarts the conv and the recurrence
at every packed sample, and its shards are the bridge's "gdn_in" / "gdn_conv" kinds
(common/model/bridge_gdn.py).

The recurrence, per value head, state S (dk, dv), decay a_t = exp(g_t), strength beta_t:
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t / sqrt(dk)
(q, k L2-normalised). In chunks of C tokens with G the in-chunk cumulative log decay and S_0 the
state entering the chunk, the corrections u_i = beta_i (v_i - a_i S_{i-1}^T k_i) solve the unit
lower-triangular system (I + L) U = beta (V - e^G K S_0), L_ij = beta_i e^{G_i - G_j} k_i.k_j
(j < i); then o_i = e^{G_i} q_i S_0 + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) u_j and
S_C = e^{G_C} S_0 + sum_j e^{G_C - G_j} k_j u_j^T. The triangular solves of all chunks run at
once; only the state passes from chunk to chunk.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from common.model.gdn_kernels import resolve_gdn_kernel


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk=64):
    """q, k (b, s, h, dk) L2-normalised, v (b, s, h, dv), g (b, s, h) log decays (<= 0),
    beta (b, s, h) in (0, 1) -> (b, s, h, dv), computed in fp32, returned in v's dtype."""
    dtype = v.dtype
    b, s, h, dk = k.shape
    chunk = min(chunk, s)  # short sequences: one chunk of their own length, not zeros up to 64
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads before time
    q = q * dk**-0.5
    pad = (-s) % chunk  # zero tokens at the end: decay 1, beta 0, no effect on the real ones
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    G = g.reshape(b, h, n, chunk).cumsum(-1)  # (b, h, n, C)
    beta = beta.reshape(b, h, n, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (b, h, n, C, C)
    lower = (beta * (k @ k.transpose(-1, -2)) * decay).masked_fill(causal.diag().diag_embed(), 0)  # strict
    system = lower + torch.eye(chunk, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    w = solve(beta * v)  # U = w - kd @ S_0
    kd = solve(beta * G.exp()[..., None] * k)
    qk = (q @ k.transpose(-1, -2)) * decay
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for c in range(n):
        u = w[:, :, c] - kd[:, :, c] @ state
        out.append((q[:, :, c] * G[:, :, c, :, None].exp()) @ state + qk[:, :, c] @ u)
        last = G[:, :, c, -1:]  # (b, h, 1)
        state = (
            last[..., None].exp() * state + (k[:, :, c] * (last - G[:, :, c]).exp()[..., None]).transpose(-1, -2) @ u
        )
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, -1)[:, :, :s]
    return o.transpose(1, 2).to(dtype)


def fla_gated_delta_rule(q, k, v, g, beta, starts=None):
    """chunk_gated_delta_rule's arguments (q, k already L2-normalised) on fla's fused kernel: q, k, v and
    beta in v's dtype, g in fp32. starts: for a packed row (b = 1), the first token of each sample (a list),
    each sample from a zero state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    dtype = v.dtype
    q, k, beta = (x.to(dtype).contiguous() for x in (q, k, beta))
    cu = {}
    if starts is not None:  # the boundaries on the host too: fla plans its chunks without a device sync
        host = torch.tensor([*starts, q.shape[1]], dtype=torch.long)
        cu = dict(cu_seqlens=host.to(q.device, non_blocking=True), cu_seqlens_cpu=host)
    o, _ = fla_rule(q, k, v.contiguous(), g.float().contiguous(), beta, scale=q.shape[-1] ** -0.5, **cu)
    return o


def _pack(x, bounds):
    """The packed samples [x, y) of a (1, s, ...) row as a batch (samples, longest, ...), zeros after each:
    the conv and the recurrence are causal, so what follows a sample's tokens cannot reach them, and each
    row starts from a zero state (the restart at every sample), one batched call for all samples."""
    return torch.nn.utils.rnn.pad_sequence([x[0, a:b] for a, b in bounds], batch_first=True)


def _unpack(x, bounds):
    """_pack's inverse: the samples' own tokens back into one (1, s, ...) row."""
    return torch.cat([x[i, : b - a] for i, (a, b) in enumerate(bounds)])[None]


class GatedDeltaNet(MegatronModule):
    """The token mixer of a gated-delta-net layer: (s, b, hidden) -> ((s, b, hidden), None).

    Parameters (per TP rank; heads split over TP, key and value heads alike):
      in_proj   ColumnParallelLinear, rows [q; k; v; z; b; a] of this rank's heads
      conv1d    depthwise causal conv over [q; k; v] (conv_dim/tp, 1, kernel), no bias, then SiLU
      dt_bias, A_log  (value heads/tp,): g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
      out_norm  RMSNorm over each value head (value_head_dim,), times silu(z); replicated
      out_proj  RowParallelLinear
    Packed sequences (megatron's THD: s tokens of b = 1 with cu_seqlens): the conv and the
    recurrence restart at every sample. Context parallelism is refused at build time.
    kernel: the recurrence's kernel, "torch" | "fla" (resolve_gdn_kernel).
    """

    def __init__(
        self, config, submodules=None, layer_number=None, gdn=None, kernel="torch", pg_collection=None, **unused
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if config.context_parallel_size > 1:
            raise NotImplementedError(
                "gated delta net layers (Qwen3.5) do not run under context parallelism: use --cp 1"
            )
        tp = mpu.get_tensor_model_parallel_world_size()
        self.gdn, self.tp = gdn, tp
        self.kernel = resolve_gdn_kernel(kernel)
        self.layer_number = layer_number
        self.pieces = gdn.in_pieces(tp)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(gdn.in_pieces(1)),
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        conv_dim = gdn.conv_dim // tp
        heads = gdn.num_value_heads // tp
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, gdn.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = torch.nn.Parameter(torch.ones(heads))
        self.A_log = torch.nn.Parameter(torch.zeros(heads))
        self.out_norm = torch.nn.RMSNorm(gdn.value_head_dim, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            gdn.value_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):  # sharded over TP: counted once per rank
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        for p in self.out_norm.parameters():  # summed over TP in forward (copy_to_...), so never again by
            p.sequence_parallel = False  # finalize_model_grads' sequence-parallel all-reduce (it would double it)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, inference_context=None, **unused):
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        if inference_context is not None:
            raise NotImplementedError("GatedDeltaNet: no KV-cache inference (the rollout engine generates)")
        gdn = self.gdn
        mixed, _ = self.in_proj(hidden_states)  # (s, b, rows/tp), s the full sequence under SP
        mixed = mixed.transpose(0, 1)  # (b, s, .)
        qkv, z, beta, a = mixed.split([sum(self.pieces[:3])] + self.pieces[3:], dim=-1)
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.tolist()
            if cu[-1] < qkv.shape[1]:
                cu.append(qkv.shape[1])  # the padding after the last sample: its own (ignored) segment
            bounds = list(zip(cu[:-1], cu[1:]))
            qkv = _unpack(self._conv(_pack(qkv, bounds)), bounds)
        else:
            qkv = self._conv(qkv)
        b, s = qkv.shape[:2]
        q, k, v = qkv.split(self.pieces[:3], dim=-1)
        q = l2norm(q.reshape(b, s, -1, gdn.key_head_dim).float())
        k = l2norm(k.reshape(b, s, -1, gdn.key_head_dim).float())
        v = v.reshape(b, s, -1, gdn.value_head_dim)
        repeat = gdn.num_value_heads // gdn.num_key_heads
        if repeat > 1:  # value head j reads key head j // repeat
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (b, s, heads/tp)
        beta = beta.sigmoid()
        if self.kernel == "fla":  # packed: cu_seqlens restarts the state at every sample
            starts = None if packed_seq_params is None else [a for a, _ in bounds]
            o = fla_gated_delta_rule(q, k, v, g, beta, starts)
        elif packed_seq_params is not None:  # the state restarts at every sample
            o = _unpack(chunk_gated_delta_rule(*(_pack(x, bounds) for x in (q, k, v, g, beta))), bounds)
        else:
            o = chunk_gated_delta_rule(q, k, v, g, beta)
        # gated RMSNorm per value head; its weight serves this rank's heads, so its gradient is summed
        # over TP (copy_to_...: identity forward, all-reduce backward)
        weight = copy_to_tensor_model_parallel_region(self.out_norm.weight)
        normed = F.rms_norm(o.float(), (gdn.value_head_dim,), eps=self.out_norm.eps)
        z = z.reshape(b, s, -1, gdn.value_head_dim)
        o = (weight.to(o.dtype) * normed.to(o.dtype)) * F.silu(z.float()).to(o.dtype)
        out, bias = self.out_proj(o.reshape(b, s, -1).transpose(0, 1))  # (s, b, hidden) reduced over TP
        return out, bias

    def _conv(self, x):
        """Causal depthwise conv + SiLU of (b, s, channels), the state zero before x[:, 0]."""
        y = F.conv1d(x.transpose(1, 2), self.conv1d.weight, padding=self.gdn.conv_kernel - 1, groups=x.shape[-1])
        return F.silu(y[..., : x.shape[1]]).transpose(1, 2)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """Distributed-checkpoint tensors that reshard to any TP: in_proj and conv1d saved as their
        logical pieces (q, k, v[, z, b, a]) each split over TP, as megatron-core's GatedDeltaNet
        saves them; dt_bias and A_log split over TP."""
        from megatron.core import parallel_state as mpu
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = tp_group if tp_group is not None else mpu.get_tensor_model_parallel_group()
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            {"A_log": 0, "dt_bias": 0},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        for name, module in self.named_children():
            if name == "conv1d":
                out.update(
                    make_sharded_tensors_for_checkpoint(
                        module.state_dict(prefix="", keep_vars=True),
                        f"{prefix}{name}.",
                        {"weight": 0},
                        sharded_offsets,
                        tp_group=tp_group,
                        dp_cp_group=metadata["dp_cp_group"],
                    )
                )
            else:
                out.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group)
                )
        names = ["query", "key", "value", "z", "beta", "alpha"]
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(out[f"{prefix}in_proj.weight"], self.pieces, names, 0)
        out[f"{prefix}conv1d.weight"] = _split_tensor_factory(
            out[f"{prefix}conv1d.weight"], self.pieces[:3], names[:3], 0
        )
        return out
