"""LoRA (Hu et al. 2021) on megatron's tensor-parallel linears: the base frozen, low-rank adapters trained.

  add_lora(chunks, rank=, alpha=, targets=, seed=)   freeze every base parameter, adapt the targeted linears
  parse_targets("attention,mlp")                     --lora-targets -> a tuple of target names (ValueError if bad)
  adapters_disabled(chunks)                          a context: the base model's outputs (the reference model)
  merged_weight(module)                              W + scale * B A of one adapted linear, in W's dtype
  MergedTensors(local, chunks)                       the export's name -> tensor map with merged weights in place
  is_adapter(name), lora_modules(chunks)             adapter parameter names; the adapted linears by global name

Each targeted ColumnParallelLinear / RowParallelLinear (its weight W: (out, in), sharded by megatron)
gets two parameters beside W, `lora_a` (r, in) and `lora_b` (out, r), and a forward hook that adds
scale * (x A^T) B^T to the linear's output, scale = alpha / r. Nothing of megatron is patched: the hook is
torch's, the base weight keeps its name (the bridge, the HF loader and the checkpoints see it unchanged) and
megatron's own frozen-weight path runs the base GEMM (no weight gradient is computed for it).

Sharding under tensor parallelism (TP), chosen so that the adapters' collectives carry (tokens, r), not
(tokens, hidden):
  column-parallel (W sharded on out): A replicated (full in), B sharded on out like W. u = x A^T is the
      same on every rank; its gradient (dY_local B_local, a partial sum) is all-reduced in the backward
      (megatron's copy_to_tensor_model_parallel_region on u, r columns wide).
  row-parallel (W sharded on in): A sharded on in like W, B replicated. u = x_local A_local^T is a partial
      sum, all-reduced in the forward (reduce_from_tensor_model_parallel_region on u), then u B^T is
      the same full output on every rank, added to the base's all-reduced output.
  sequence parallelism (SP): the same with the sequence all-gathered / reduce-scattered on u, not x; the
      replicated factor (A of a column, B of a row) then sees a slice of the tokens, so it carries
      megatron's `sequence_parallel` tag and finalize_model_grads sums its gradient over TP.
Sharded factors carry megatron's tensor-parallel attributes (the gradient norm counts them on every rank,
replicated ones on TP rank 0 only). A is drawn for the full (r, in) matrix from a generator seeded by
(seed, the linear's global name), then sliced: every TP layout starts from the same adapters, and B = 0
makes the model at step 0 the base model, bit for bit. Routed experts (GroupedExperts) are not adapted.
The frozen output layer gets one more hook, which hands its logits' gradient on with row-major strides
(_RowMajorGrad: otherwise its backward runs as one small product per token).
"""

import contextlib
import math
import zlib

import torch

TARGETS = ("attention", "mlp", "experts")
ADAPTER_NAMES = ("lora_a", "lora_b")


def parse_targets(text):
    """--lora-targets "attention,mlp" -> ("attention", "mlp"); ValueError with the fix for anything else."""
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"--lora-targets {text!r}: choose a comma-separated subset of {','.join(TARGETS[:2])}")
    if "experts" in targets:
        raise ValueError(
            "--lora-targets experts: adapters on the routed experts (grouped GEMMs) are not supported; "
            "use attention,mlp (an MoE model's shared experts count as mlp)"
        )
    return targets


def is_adapter(name):
    """Whether a parameter name (local or global) is a LoRA factor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def _targeted(name, module, targets):
    """Whether the megatron module `name` (a Column/RowParallelLinear) is one of --lora-targets."""
    if ".self_attention." in name:
        return "attention" in targets
    if ".mlp." in name and ".experts." not in name.replace(".shared_experts.", "."):
        return "mlp" in targets
    return False


def _global_name(model, name):
    """`decoder.layers.{local}.rest` -> `decoder.layers.{global}.rest` (pipeline stages number from 0)."""
    if not name.startswith("decoder.layers."):
        return name
    _, _, local, rest = name.split(".", 3)
    return f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"


def lora_modules(chunks):
    """{global module name: adapted linear} over these chunks (empty without LoRA)."""
    from common.model.chunks import unwrap

    found = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for name, module in model.named_modules():
            if getattr(module, "lora_scale", None) is not None:
                found[_global_name(model, name)] = module
    return found


def add_lora(chunks, *, rank, alpha, targets=("attention", "mlp"), seed=0):
    """Freeze every parameter of these chunks and give each targeted linear its adapters (B = 0, A drawn as
    PEFT does: kaiming-uniform, U(-1/sqrt(in), 1/sqrt(in))). Before DDP / the optimizer are built (they
    take the parameters that require a gradient). All ranks call this. Returns the number of adapted linears."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    from common.model.chunks import unwrap

    if rank < 1:
        raise ValueError(f"--lora-rank {rank}: the adapters' rank must be >= 1")
    count = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        model = unwrap(chunk)
        for name, module in list(model.named_modules()):
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or not _targeted(
                name, module, targets
            ):
                continue
            row = isinstance(module, RowParallelLinear)
            if row and not module.input_is_parallel:  # (every row-parallel linear of a GPTModel takes its shard)
                raise ValueError(f"LoRA on {name}: a row-parallel linear that scatters its own input is not supported")
            weight = module.weight  # (out/tp, in) column, (out, in/tp) row
            tp_size, tp_rank = module.tp_group.size(), module.tp_group.rank()
            full_in = weight.shape[1] * (tp_size if row else 1)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(_global_name(model, name).encode()))
            a = (torch.rand(rank, full_in, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(full_in)
            if row:  # this rank's columns of A, as W's
                a = a.chunk(tp_size, dim=1)[tp_rank]
            module.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
            module.lora_b = torch.nn.Parameter(
                torch.zeros(weight.shape[0], rank, device=weight.device, dtype=weight.dtype)
            )
            sharded, replicated = (module.lora_a, module.lora_b) if row else (module.lora_b, module.lora_a)
            set_tensor_model_parallel_attributes(sharded, True, 1 if row else 0, 1)
            replicated.sequence_parallel = bool(module.sequence_parallel)  # its tokens: this rank's slice
            module.lora_scale = alpha / rank
            module.lora_enabled = True
            module.register_forward_hook(_add_adapter_output)
            count += 1
    if count == 0:
        raise ValueError(f"--lora-targets {','.join(targets)}: no linear of this model matched")
    for chunk in chunks:  # the frozen output layer's backward (last pipeline stage only)
        output_layer = getattr(unwrap(chunk), "output_layer", None)
        if output_layer is not None:
            output_layer.register_forward_hook(_row_major_logits_grad)
    return count


class _RowMajorGrad(torch.autograd.Function):
    """Identity forward; the backward hands on the gradient with row-major strides.

    Why: megatron's GPTModel returns logits.transpose(0, 1).contiguous(), so the output layer's gradient
    arrives as a transposed view, (s, b, V) with strides (V, s V, 1). At b = 1 torch counts that contiguous,
    but torch.matmul does not fold it into one GEMM: the frozen output layer's backward (megatron's
    LinearWithFrozenWeight, grad @ W) then ran as s batched (1 x V) @ (V x H) products, 339 ms per 4096-token
    micro-batch at Qwen2-1.5B on an H200 (a trained output layer's backward reshapes the gradient and runs
    one GEMM). At b = 1 the view takes row-major strides without a copy; otherwise it is copied."""

    @staticmethod
    def forward(ctx, logits):
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        row_major = torch.empty(grad.shape, device="meta").stride()  # (a new tensor's strides: row-major)
        if grad.stride() == row_major:
            return grad
        if grad.is_contiguous():  # only the strides of size-1 dims differ: the same memory, relabelled
            return grad.as_strided(grad.shape, row_major)
        return grad.contiguous()


def _row_major_logits_grad(module, inputs, output):
    """The frozen output layer's forward hook: its logits through _RowMajorGrad."""
    logits, bias = output
    return _RowMajorGrad.apply(logits) if torch.is_grad_enabled() else logits, bias


def _add_adapter_output(module, inputs, output):
    """The linear's forward hook: output + scale * (x A^T) B^T, with the sharding of the module docstring."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if not module.lora_enabled:
        return output
    out, bias = output
    x = inputs[0]
    group, tp_size = module.tp_group, module.tp_group.size()
    u = torch.nn.functional.linear(x, module.lora_a)  # (s, b, r); a partial sum for a row-parallel linear
    if isinstance(module, RowParallelLinear):
        if module.sequence_parallel:
            u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=group)  # (s/tp, b, r)
        elif tp_size > 1:
            u = mappings.reduce_from_tensor_model_parallel_region(u, group=group)
        return out + module.lora_scale * torch.nn.functional.linear(u, module.lora_b), bias
    if module.sequence_parallel:
        u = mappings.gather_from_sequence_parallel_region(u, group=group)  # (s, b, r)
    elif tp_size > 1:
        u = mappings.copy_to_tensor_model_parallel_region(u, group=group)  # the backward all-reduces dU
    delta = module.lora_scale * torch.nn.functional.linear(u, module.lora_b)  # (s, b, out/tp)
    if module.gather_output and tp_size > 1:
        delta = mappings.gather_from_tensor_model_parallel_region(delta, group=group)
    return out + delta, bias


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Within: the chunks compute the base model (the reference model of a LoRA run, no second copy)."""
    modules = list(lora_modules(chunks).values())
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True


@torch.no_grad()
def merged_weight(module):
    """This rank's shard of W + scale * B A (column: B's rows x full A; row: full B x A's columns), computed
    in fp32 and rounded once to W's dtype. W itself is not modified."""
    merged = module.lora_b.float() @ module.lora_a.float()  # the one fp32 temporary (W's shape)
    return merged.mul_(module.lora_scale).add_(module.weight).to(module.weight.dtype)


class MergedTensors(dict):
    """The weight export's {global name: local tensor} (common/model/weights.py), whose adapted weights read
    as merged_weight, computed when read (a bucket's worth at a time, never the whole model)."""

    def __init__(self, local, chunks):
        super().__init__(local)
        self.modules = {f"{name}.weight": module for name, module in lora_modules(chunks).items()}

    def __getitem__(self, name):
        module = self.modules.get(name)
        return merged_weight(module) if module is not None else super().__getitem__(name)


def adapter_bytes(chunks):
    """(adapter parameters, their bytes) on this rank."""
    params = [p for chunk in chunks for n, p in chunk.named_parameters() if is_adapter(n)]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def adapter_sharded_state_dict(model):
    """The adapters' part of a GPTModel's sharded_state_dict (what a LoRA checkpoint holds), loadable at any
    TP layout. megatron's linears save every tensor but weight and bias as replicated over TP: the factors
    sharded like W are given W's sharding here (B of a gated fc1 split into its gate and up halves as
    megatron does for W), the replicated ones keep megatron's entries."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    modules = dict(model.named_modules())
    state = {}
    for name, entry in model.sharded_state_dict().items():
        if not is_adapter(name):
            continue
        module_name, factor = name.rsplit(".", 1)
        module = modules[module_name]
        row = isinstance(module, RowParallelLinear)
        if (factor == "lora_a") == row:  # A of a row-parallel linear, B of a column-parallel one: sharded like W
            prepend = tuple(
                (i, entry.global_offset[i], entry.axis_fragmentations[i]) for i in range(entry.prepend_axis_num)
            )
            param = getattr(module, factor)
            entry = make_tp_sharded_tensor_for_checkpoint(param, entry.key, 1 if row else 0, prepend_offsets=prepend)
            if not row and module.config.gated_linear_unit and module_name.endswith("linear_fc1"):
                entry = apply_swiglu_sharded_factory(entry, prepend)
        state[name] = entry
    return state
