"""How much one rank of a parallel layout holds of a model: parameters, activations, KV cache.

    count_parameters(spec, layers, tp=2, ...)     exact: what build_model's chunks hold on the rank
    stage_activation_bytes(spec, layers, ...)     bytes the update's forward saves per token
    stage_layer_indices(num_layers, pp, vpp, ...) the decoder layers of each pipeline rank

Pure arithmetic on the HFModelSpec (no torch, no megatron): common/run/memory_plan.py builds the
run's memory plan from these. tests/test_memory_plan.py and tests/test_model_parity.py check them
against the models megatron builds and the tensors autograd saves.
"""

import dataclasses
import math
from dataclasses import dataclass

from common.model.bridge import expected_hf_names, expected_hf_shape, padded_vocab_size, pipeline_layout

FP32 = 4


# ---------------------------------------------------------------------------------------
# Layers and parameters per pipeline rank
# ---------------------------------------------------------------------------------------
def stage_layer_indices(num_layers, pp=1, vpp=None, first=None, last=None):
    """The global decoder layer indices each pipeline rank builds, as megatron places them: the
    stage sizes of bridge.pipeline_layout (even unless the layers do not divide or
    --first/--last-stage-layers ask), each stage's layers cut into vpp virtual stages, virtual
    stage v of every rank before v + 1 (6 layers, pp 2 x vpp 2, first stage 4: [0, 1, 3, 4], [2, 5])."""
    v = vpp or 1
    fields = pipeline_layout(num_layers, pp, vpp, first, last)
    if not fields:
        counts = [num_layers // pp] * pp
    else:
        head = fields["num_layers_in_first_pipeline_stage"]
        tail = fields.get("num_layers_in_last_pipeline_stage", num_layers - head if pp == 2 else None)
        middle = (num_layers - head - tail) // (pp - 2) if pp > 2 else 0
        counts = [head] + [middle] * (pp - 2) + [tail]
    ranks, layer = [[] for _ in range(pp)], 0
    for _ in range(v):
        for rank in range(pp):
            ranks[rank] += range(layer, layer + counts[rank] // v)
            layer += counts[rank] // v
    return ranks


@dataclass
class ParamCount:
    """One rank's parameters: dense ones (replicated over data parallelism: embedding, attention,
    dense MLPs, norms, routers, shared experts) and routed experts (split over EP x ETP, their
    optimizer state over the expert-data-parallel ranks)."""

    dense: int = 0
    experts: int = 0

    @property
    def total(self):
        return self.dense + self.experts


def count_parameters(spec, layers, *, tp=1, ep=1, etp=1, first_stage=True, last_stage=True, pp=1, value_head=False):
    """The parameters megatron builds on one rank for these global decoder layers (exact: what
    build_model's chunks hold). value_head: the critic's / reward model's Linear(hidden, 1) in
    place of the output layer (their embeddings are untied)."""
    h, n = spec.hidden_size, ParamCount()
    vocab = padded_vocab_size(spec.vocab_size, tp) // tp * h  # (V padded to 128 * tp) / tp rows
    if first_stage:
        n.dense += vocab
    if last_stage:
        n.dense += h  # final norm
        if value_head:
            n.dense += h + 1
        elif not (spec.tie_word_embeddings and pp == 1):  # tied at PP > 1: the last stage keeps its own copy
            n.dense += vocab
    for layer in layers:
        n.dense += 2 * h + _attention_params(spec, tp, layer)  # input and pre-MLP norms
        moe = spec.moe
        if moe is not None and moe.moe_layers[layer]:
            n.dense += moe.num_experts * h  # router (replicated; DeepSeek's expert bias is a buffer)
            n.experts += moe.num_experts // ep * 3 * moe.ffn_hidden_size * h // etp
            if moe.shared_expert_size:
                n.dense += 3 * moe.shared_expert_size * h // tp + (h if moe.shared_gate else 0)
            if spec.gptoss is not None:  # o_proj bias, sinks, router bias; each expert's fc1 and fc2 biases
                n.dense += h + spec.num_heads // tp + moe.num_experts
                n.experts += moe.num_experts // ep * (2 * moe.ffn_hidden_size // etp + h)
        else:
            n.dense += 3 * spec.ffn_hidden_size * h // tp  # gate+up (fc1), down (fc2)
    return n


def _attention_params(spec, tp, layer=0):
    h, heads = spec.hidden_size, spec.num_heads
    g = spec.gdn
    if (
        g is not None and g.linear_layers[layer]
    ):  # common/model/gdn.py: in_proj, conv1d, dt_bias, A_log | norm, out_proj
        return (
            sum(g.in_pieces(1)) * h // tp
            + g.conv_dim * g.conv_kernel // tp
            + 2 * g.num_value_heads // tp
            + (g.value_head_dim + g.value_dim * h // tp)
        )
    if g is not None:  # gated full attention: q_proj holds a gate row per query row; q/k norms
        rows = (2 * heads + 2 * spec.num_kv_heads) * spec.head_dim
        return rows * h // tp + h * heads * spec.head_dim // tp + 2 * spec.head_dim
    if spec.mla is not None:  # common/model/bridge_mla.py: every projection split over TP by rows, norms replicated
        m = spec.mla
        if m.q_lora_rank:
            q = m.q_lora_rank * h // tp + m.q_lora_rank + heads * m.qk_head_dim * m.q_lora_rank // tp
        else:
            q = heads * m.qk_head_dim * h // tp
        kv = (m.kv_lora_rank + m.qk_rope_head_dim) * h // tp + m.kv_lora_rank
        kv += heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank // tp
        return q + kv + h * heads * m.v_head_dim // tp
    rows = (heads + 2 * spec.num_kv_heads) * spec.head_dim  # fused q, k, v
    n = rows * h // tp + h * heads * spec.head_dim // tp  # linear_qkv, linear_proj
    n += rows // tp if spec.qkv_bias else 0
    n += 2 * spec.head_dim if spec.qk_norm else 0
    return n


def count_lora_parameters(spec, layers, *, rank, targets, tp=1):
    """LoRA adapters on one rank for these global decoder layers (common/model/lora.py): r x (in + out) per
    adapted linear, the factor sharded like W divided by tp (column: B, row: A), the other replicated.
    Multi-latent attention: its projections counted as column-parallel (an estimate within r x in)."""
    h, heads, n = spec.hidden_size, spec.num_heads, 0

    def column(i, o):
        return rank * (i + o // tp)

    def row(i, o):
        return rank * (i // tp + o)

    for layer in layers:
        if "attention" in targets:
            if spec.mla is not None:
                m = spec.mla
                q = [(h, m.q_lora_rank), (m.q_lora_rank, heads * m.qk_head_dim)] if m.q_lora_rank else []
                q = q or [(h, heads * m.qk_head_dim)]
                kv = [
                    (h, m.kv_lora_rank + m.qk_rope_head_dim),
                    (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                ]
                n += sum(column(i, o) for i, o in q + kv) + row(heads * m.v_head_dim, h)
            elif spec.gdn is not None and spec.gdn.linear_layers[layer]:  # the delta net's in_proj, out_proj
                n += column(h, sum(spec.gdn.in_pieces(1))) + row(spec.gdn.value_dim, h)
            else:  # (Qwen3.5's gated attention: a gate row per query row)
                q_rows = (2 if spec.gdn is not None else 1) * heads
                n += column(h, (q_rows + 2 * spec.num_kv_heads) * spec.head_dim) + row(heads * spec.head_dim, h)
        if "mlp" in targets:
            moe = spec.moe
            ffn = (moe.shared_expert_size if moe is not None and moe.moe_layers[layer] else spec.ffn_hidden_size) or 0
            if ffn:
                n += column(h, 2 * ffn) + row(ffn, h)  # fc1 (gate + up), fc2
    return n


def hf_parameter_count(spec):
    """Parameters of the HF checkpoint (unpadded vocabulary, tied embeddings once): the engine's model
    (gpt-oss's MXFP4 experts counted as the dequantised tensors the engine holds)."""
    if spec.gptoss is not None and spec.gptoss.mxfp4:
        spec = dataclasses.replace(spec, gptoss=dataclasses.replace(spec.gptoss, mxfp4=False))
    return sum(math.prod(expected_hf_shape(name, spec)) for name in expected_hf_names(spec))


# ---------------------------------------------------------------------------------------
# Activations: bytes the update saves for the backward, per token and layer
# ---------------------------------------------------------------------------------------
def layer_activation_bytes(spec, moe_layer, *, tp=1, sp=False, cp=1, etp=1, dtype_bytes=2, device="cuda", skip=()):
    """Bytes one decoder layer saves for its backward per token of a micro-batch on one rank: the
    saved inputs of each op of the local spec (common/model/gpt.py layer_spec), each tensor once.
    Calibrated on a CPU against what autograd really saves (tests/test_memory_plan.py, within 10%).
    device "cpu" adds what torch's eager ops keep there and a GPU's kernels do not: the normalised
    input of each RMSNorm (on CUDA torch's fused norm keeps input and 1/rms only) and the SiLU
    of the SwiGLU (common/model/swiglu.py keeps its input only). skip: selective recompute's
    modules (megatron's recompute_modules): their internals are recomputed, their inputs kept."""
    b, h = dtype_bytes, spec.hidden_size
    seq = tp if sp and tp > 1 else 1  # sequence parallel: the (T, h) tensors split over TP
    cpu = device == "cpu"

    def norm(width, split=1):  # torch.nn.RMSNorm: input, 1/rms (fp32) [+ the normalised input]
        return (width * b * (2 if cpu else 1) + FP32) / split

    total = 2 * norm(h, seq) + 2 * h * b / seq  # input/pre-MLP norms, their outputs (the next linear's input)
    heads = spec.num_heads // tp
    if spec.mla is not None:
        m = spec.mla
        qk, v = m.qk_head_dim, m.v_head_dim
        if m.q_lora_rank:  # q down -> q norm -> q up
            total += norm(m.q_lora_rank) + m.q_lora_rank * b
        # kv down -> kv norm (its input a view of the down projection's output) -> kv up
        total += (m.kv_lora_rank + m.qk_rope_head_dim) * b + norm(m.kv_lora_rank) - m.kv_lora_rank * b
        total += m.kv_lora_rank * b + 4 * m.qk_rope_head_dim * FP32  # kv up's input; megatron's eager RoPE
        # the kernel's q, k, v (keys and values all-gathered over CP) and output, linear_proj's input:
        # on a GPU varlen flash attention pads v and the output to the q/k head size
        # (common/model/attention.py _varlen) and keeps the log-sum-exp; the CPU's math kernel
        # keeps the (T, T) probabilities instead, which are no per-token cost and not counted
        padded = v if cpu else qk
        kernel = heads * ((qk + padded) * cp * b + (0 if cpu else padded * b + FP32))
        total += heads * qk * b + kernel + heads * v * b
        recomputed = kernel - heads * qk * cp * b  # core_attn recompute keeps q, k, v, drops the rest
    else:
        d, groups = spec.head_dim, spec.num_kv_heads // tp
        # q out of the fused qkv output: a copy where the rank holds several query groups (their q
        # heads are not adjacent there), else a view; k and v are views
        q_copy = heads * d * b if groups > 1 else 0
        if spec.qk_norm:  # q/k norms over each head: their inputs (q's copy, k's view), 1/rms [, normalised]
            total += heads * norm(d) - (heads * d * b - q_copy) + groups * (norm(d) - d * b)
        # the angles per position: eager RoPE keeps cos and sin for q and for k; the compiled one
        # (common/model/attention.py apply_rope_qk on a GPU) keeps the angles and recomputes them
        rope = (4 if cpu else 1) * d * FP32
        # the fused qkv output (v stays a view of it), q and k after RoPE (k and v all-gathered
        # over CP), the output (linear_proj's input), the log-sum-exp
        gathered = groups * d * b * (cp - 1)
        total += (heads + 2 * groups) * d * b + (heads + groups) * d * b + 2 * gathered + heads * d * b
        total += heads * FP32 + rope
        # core_attn recompute: keeps the kernel's inputs (q and k normed, or q's copy and views of
        # the qkv output) and drops the rotated q and k, the angles, the gathered k and v
        kept = (heads + groups) * d * b if spec.qk_norm else q_copy
        recomputed = heads * FP32 + rope + 2 * gathered + (heads + groups) * d * b - kept
    if "core_attn" in skip:
        total -= recomputed
    if moe_layer:
        total += _moe_bytes(spec, b, tp, seq, etp, cpu, skip)
    elif "mlp" not in skip:
        f = spec.ffn_hidden_size // tp
        total += (2 * f + f + (f if cpu else 0)) * b  # fc1 output (SwiGLU's input), [SiLU], fc2's input
    return total


def _moe_bytes(spec, b, tp, seq, etp, cpu, skip):
    """A MoE layer's MLP per token: the router, the dispatch's indices, the routed experts' rows
    (each token topk times, balanced over the EP ranks) and the shared experts."""
    moe, h = spec.moe, spec.hidden_size
    if "moe" in skip:
        return 0
    k, f = moe.topk, moe.ffn_hidden_size // etp
    # the router's scores (its input is the pre-MLP norm's output, counted), top-k, the dispatch's maps
    router = (moe.num_experts * FP32 + k * (8 + FP32 + 8 + 8 + 8 + 1)) / seq
    activation = f + (2 * f + FP32 / b if cpu else 0)  # fc2's input [the eager SwiGLU's pieces]; the router prob
    if "moe_act" in skip:
        activation = 0
    experts = k * (h + 2 * f + activation) * b + k * (FP32 + 8)  # permuted rows, fc1 output
    shared = 0
    if moe.shared_expert_size and "shared_experts" not in skip:
        s = moe.shared_expert_size // tp
        shared = (2 * s + s + (s if cpu else 0)) * b
        if moe.shared_gate:  # sigmoid(x @ g) * shared(x): the gate and the shared output
            shared += (1 + h / seq) * b
    return router + experts + shared


def stage_activation_bytes(spec, layers, *, recompute="none", recompute_modules=(), recompute_layers=1, **kw):
    """(saved, recomputed) bytes per token of one micro-batch on one pipeline stage: what its
    forward saves for the backward (its layers' activations; with --recompute full only each
    chunk's input), and what the backward holds on top while it recomputes one chunk of
    --recompute-layers layers (0 without full recompute). kw: layer_activation_bytes'."""
    per_layer = [
        layer_activation_bytes(
            spec,
            spec.moe is not None and spec.moe.moe_layers[i],
            skip=recompute_modules if recompute == "selective" else (),
            **kw,
        )
        for i in layers
    ]
    if recompute != "full" or not per_layer:
        return sum(per_layer), 0
    seq = kw.get("tp", 1) if kw.get("sp") and kw.get("tp", 1) > 1 else 1
    chunk_input = spec.hidden_size * kw.get("dtype_bytes", 2) / seq
    return math.ceil(len(per_layer) / recompute_layers) * chunk_input, recompute_layers * max(per_layer)


def in_flight_micro_batches(pp_rank, pp, vpp, num_micro_batches):
    """Micro-batches whose activations one pipeline rank holds at once, in units of the rank's whole
    stage: 1F1B keeps pp - rank; the interleaved schedule's warm-up runs (pp - rank - 1) * 2 +
    (vpp - 1) * pp chunks of 1/vpp of the stage before the first backward (megatron's
    schedules.py). Never more than the micro-batches there are."""
    if pp == 1:
        return 1
    v = vpp or 1
    if v == 1:
        return min(pp - pp_rank, num_micro_batches)
    chunks = min((pp - pp_rank - 1) * 2 + (v - 1) * pp + 1, num_micro_batches * v)
    return chunks / v


def kv_cache_bytes_per_token(spec, rollout_tp, dtype_bytes=2):
    """KV-cache bytes per token on one engine rank: keys and values of every layer (split over the
    engine's TP by kv heads, replicated where TP exceeds them); MLA caches one latent + rope key."""
    if spec.mla is not None:
        return spec.num_layers * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * dtype_bytes
    heads = max(1, spec.num_kv_heads // rollout_tp)
    # gated delta nets (Qwen3.5) keep a fixed-size state per sequence, no per-token cache
    layers = spec.num_layers - (sum(spec.gdn.linear_layers) if spec.gdn is not None else 0)
    return 2 * layers * heads * spec.head_dim * dtype_bytes


def layer_working_bytes(spec, kw):
    """Per token, the tensors a forward-only pass holds at once inside one layer: its input and
    norm output, then the widest of the attention's (q, k, v, output) and the MLP's (fc1 output,
    the activation) intermediates. Nothing is kept for a backward."""
    b, tp, h = kw["dtype_bytes"], kw["tp"], spec.hidden_size
    attention = (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim // tp
    if spec.moe is not None and any(spec.moe.moe_layers):
        moe = spec.moe
        mlp = moe.topk * (h + 3 * moe.ffn_hidden_size // kw["etp"]) + 3 * moe.shared_expert_size // tp
        mlp = max(mlp, 3 * spec.ffn_hidden_size // tp)
    else:
        mlp = 3 * spec.ffn_hidden_size // tp
    return (2 * h + max(attention, mlp)) * b
