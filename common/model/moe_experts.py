"""The MoE layers' experts without TransformerEngine: GroupedExperts, megatron's SequentialMLP run
as two grouped GEMMs (torch._grouped_mm) instead of a Python loop over experts.

The parameters, their names and the checkpoint layout stay SequentialMLP's
(`experts.local_experts.{j}.linear_fc1/fc2`), so the bridge, checkpoints and the weight sync
are the same as without grouping. Under training (fuse_wgrad) the experts' weight gradients
are added into megatron DDP's fp32 buffers by _StackedWeights, in place where the buffers hold
the weights evenly spaced (GroupedExperts.stacks). The loop remains where torch has no grouped
GEMM for the tensors (CUDA other than bf16, rows not 16-byte aligned). common/model/moe.py's
DeviceSortDispatcher sorts the rows in the order these GEMMs read the weights;
tests/gpu/test_moe_gpu.py checks grouped and loop equal on a GPU; bench/moe.py times them.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from common.rl.fused import on_gpu_compiled


def _grouped_mm_usable(weight, num_local_experts):
    """torch's grouped GEMM takes these weights: bf16 on CUDA (sm90's kernel), any float dtype on a
    CPU (torch's reference loop there, the same per-expert matmuls as SequentialMLP's); rows of
    16-byte multiples either way."""
    if not hasattr(torch, "_grouped_mm") or num_local_experts < 2:
        return False
    if weight.is_cuda and weight.dtype != torch.bfloat16:
        return False
    return all(size * weight.element_size() % 16 == 0 for size in weight.shape)


@on_gpu_compiled
def swiglu_weighted(h, probs):
    """(N, 2F) fc1 output -> (N, F): SiLU(gate) * up, weighted by each row's router prob (N,), in
    h's dtype. On a GPU one kernel forward and backward (eager: silu, two multiplies, a cast)."""
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(h.dtype)


def evenly_spaced(tensors):
    """The same-shape contiguous tensors as one (len, *shape) view of the storage they share,
    where they lie in it evenly spaced, one after another: (view, reverse), view[i] being
    tensors[i], or tensors[-1 - i] where they lie in reverse order; None otherwise. megatron
    DDP's buffers lay a layer's parameters (and their main_grads) out this way, last first."""
    first = tensors[0]
    if len(tensors) < 2 or any(
        t.shape != first.shape
        or t.dtype != first.dtype
        or not t.is_contiguous()
        or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        for t in tensors
    ):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0]
    if abs(step) < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    base = (first if step > 0 else tensors[-1]).detach()
    return base.as_strided((len(tensors), *first.shape), (abs(step), *first.stride())), step < 0


class _StackedWeights(torch.autograd.Function):
    """The local experts' weights as one (E_local, ...) tensor, whose backward adds each expert's
    slice of the gradient straight into that weight's fp32 main_grad (megatron DDP's buffer) and
    hands autograd no gradient for the weights. The tensor is a view of DDP's parameter buffer
    where the weights lie there evenly spaced in the GEMMs' order (GroupedExperts.stacks; else a
    torch.stack copy), and the gradient is added with one in-place add into the same view of the
    gradient buffer (else one cast and one foreach add).

    Without it each expert weight's gradient goes through its own autograd accumulation and
    DDP's per-parameter hook (which adds it into main_grad): 2 x E_local per MoE layer and
    micro-batch, 8,192 per step of a 4-layer Qwen3-30B-A3B shape, the largest host cost of that
    step (docs/performance.md). The sums are the same: the bf16 gradient, cast exactly to fp32,
    then added. Valid when DDP reduces its whole buffer after the backward (no
    overlap_grad_reduce, which would wait for the per-parameter hooks): fuse_wgrad is set only
    then, by common/train/setup.py's fuse_wgrad_accumulation.
    """

    @staticmethod
    def forward(ctx, anchor, weights, views):
        """anchor: weights[0], the one weight autograd sees (it makes the result require a
        gradient); weights: all of them in the GEMMs' order, as a list, which autograd does not
        track (a tensor input per weight would still run autograd's accumulation node and DDP's
        hook per weight); views: [weights' view or None, main_grads' view or None]."""
        ctx.weights, ctx.main_view = weights, views[1]
        return torch.stack(weights) if views[0] is None else views[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.main_view is not None:
            ctx.main_view.add_(grad)  # one kernel: bf16 read, fp32 added in place
        else:
            main_grads = [w.main_grad for w in ctx.weights]
            torch._foreach_add_(main_grads, grad.to(main_grads[0].dtype).unbind(0))
        return None, None, None


class GroupedExperts(SequentialMLP):
    """SequentialMLP with its local experts run as two grouped GEMMs on a GPU.

    Tokens arrive sorted by local expert (tokens_per_expert[j] rows for the j-th group). The
    GEMMs take the expert weights as (E_local, 2F, H) and (E_local, H, F) tensors: views of
    megatron DDP's parameter buffer where the weights lie there evenly spaced (the distributed
    optimizer's buffer; megatron lays them out last expert first, so DeviceSortDispatcher then
    sorts the rows last expert first: order_descending), else a copy stacked per forward and
    freed after the layer's backward. The parameters stay the per-expert tensors of
    SequentialMLP, so checkpoints, the bridge and the weight sync are the same as without
    grouping. With expert TP (etp > 1) each rank multiplies its slice; the dispatcher reduces
    the partial sums, as for SequentialMLP.
    """

    grouped = True  # False: always the per-expert loop (bench/moe.py compares the two)
    fuse_wgrad = False  # True: weight gradients added into main_grad by _StackedWeights (set for training)
    mask_tail = False  # True: rows past this rank's experts' belong to other ranks (DeviceSortDispatcher at EP > 1):
    # no GEMM computes them (the loop returns zeros there), the combine leaves them out
    rows_descending = False  # set by DeviceSortDispatcher for the pass it sorted: its rows go last expert first
    in_place = True  # False: the weights always stacked, the gradients added by foreach (bench --ab in-place-experts)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Expert weights are megatron's "expert-parallel" parameters (not all-reduced over the
        # dense data-parallel group) at every EP size, EP=1 included, where megatron would
        # treat them as dense. The optimizer then always has its two parts (dense, experts),
        # so a training checkpoint's optimizer state has the same structure at every EP and
        # resumes at another one. The math is unchanged: at EP=1 the expert-data-parallel
        # group holds the same ranks.
        for param in self.parameters():
            param.allreduce = False

    def grouped_gemm_takes(self):
        """Whether torch's grouped GEMM takes these experts' weights (and grouping is on), the router's
        probabilities weighing the outputs (not the inputs)."""
        first = self.local_experts[0]
        return (
            self.grouped
            and _grouped_mm_usable(first.linear_fc1.weight, self.num_local_experts)
            and _grouped_mm_usable(first.linear_fc2.weight, self.num_local_experts)
            and not self.config.moe_apply_probs_on_input
        )

    def grouped_path(self):
        """Whether forward runs the grouped GEMMs (else megatron's loop over experts)."""
        return (
            self.grouped_gemm_takes()
            and self.config.gated_linear_unit
            and self.config.activation_func is F.silu
            and not self.config.add_bias_linear
        )

    def stacks(self):
        """{"descending": the order to read the experts in, "w1", "w2": (E_local, ...) views of the
        fc1 / fc2 weights in that order, "g1", "g2": the same of their main_grads (with
        fuse_wgrad)}, each None where those tensors do not lie evenly spaced in that order. The
        order is the gradients' layout where they have one (with fuse_wgrad), else the weights'.
        Checked once per placement of the buffers (offload moves their storage)."""
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        grads = self.fuse_wgrad and hasattr(fc1[0], "main_grad")
        key = (
            self.in_place,
            grads,
            fc1[0].data_ptr(),
            fc1[-1].data_ptr(),
            grads and fc1[0].main_grad.data_ptr(),
            grads and fc1[-1].main_grad.data_ptr(),
        )
        if self.__dict__.get("_stacks_key") != key:
            tensors = {"w1": fc1, "w2": fc2}
            if grads:
                tensors.update(g1=[w.main_grad for w in fc1], g2=[w.main_grad for w in fc2])
            found = {name: evenly_spaced(ts) if self.in_place else None for name, ts in tensors.items()}
            descending = False
            for a, b in (("g1", "g2"), ("w1", "w2")):  # the gradients' layout first, else the weights'
                if found.get(a) and found.get(b) and found[a][1] == found[b][1]:
                    descending = found[a][1]
                    break
            self._stacks = dict(
                descending=descending,
                **{name: view[0] if view and view[1] == descending else None for name, view in found.items()},
            )
            self._stacks_key = key
        return self._stacks

    def order_descending(self):
        """Whether the dispatcher should sort this layer's rows last local expert first (the order
        the weights lie in megatron's buffers: the GEMMs then read them in place)."""
        return self.grouped_path() and self.stacks()["descending"]

    def forward(self, hidden, tokens_per_expert, probs):
        if not self.grouped_path():
            if not self.mask_tail:
                return super().forward(hidden, tokens_per_expert, probs)
            # the loop over exactly this rank's rows; the tail gives zeros (e.g. fp32 on a GPU: the
            # first GPU run of --moe-dispatcher allgather failed in megatron's split here)
            n = int(tokens_per_expert.sum())
            out, bias = super().forward(hidden[:n], tokens_per_expert, probs[:n])
            return torch.cat([out, out.new_zeros(hidden.shape[0] - n, *out.shape[1:])]), bias
        ends, _, w1, w2 = self.grouped_weights(tokens_per_expert, hidden.device)
        h = swiglu_weighted(torch._grouped_mm(hidden, w1.transpose(1, 2), offs=ends), probs)  # (N, F/etp)
        out = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)  # (N, H); with mask_tail, rows past
        return out, None  # ends[-1] (other ranks' pairs) are written by no GEMM: the combine skips them

    def grouped_weights(self, tokens_per_expert, device):
        """What the grouped GEMMs of this pass read: (ends, experts, w1, w2): the row ends of the groups
        (E_local,) int32 on device, the local experts in the order of the rows' groups, their fc1 weights
        (E, 2F/etp, H) and fc2 weights (E, H, F/etp) stacked in that order (views in place, or copies)."""
        ends = torch.cumsum(tokens_per_expert.to(device), 0).to(torch.int32)
        descending, self.rows_descending = self.rows_descending, False  # this pass's rows' order
        experts = self.local_experts[::-1] if descending else self.local_experts
        stacks = self.stacks()
        if stacks["descending"] != descending:  # rows sorted the other way (megatron's dispatcher): copies
            stacks = {}
        training = torch.is_grad_enabled()

        def stack(weights, name):
            view = stacks.get("w" + name)
            if training and self.fuse_wgrad:
                return _StackedWeights.apply(weights[0], weights, [view, stacks.get("g" + name)])
            if training or view is None:  # autograd's gradients per weight (no DDP, or overlap_grad_reduce)
                return torch.stack(weights)
            return view

        w1 = stack([e.linear_fc1.weight for e in experts], "1")
        w2 = stack([e.linear_fc2.weight for e in experts], "2")
        return ends, experts, w1, w2
