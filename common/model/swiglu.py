"""SwiGLU, the MLPs' activation: the module megatron-core builds from the layer spec.

    out = silu(a) * b,   (a, b) = the two halves of the fc1 output's last dimension

Why: without TransformerEngine megatron-core 0.16.1 runs SwiGLU as its `bias_swiglu_impl`,
whose backward (`swiglu_back`, torch.compile'd) builds the gradient as a `cat` of its two
halves: every output element reloads its inputs, so the kernel reads the fc1 output about twice.
On an H200 at Qwen2-1.5B's micro-batch (16384 x 2 x 8960 bf16) it took 0.52 ms, this module's
Triton kernel, which loads a, b and the gradient once and writes both halves, 0.36 ms: ~9 ms of a
0.89-s training step, 56 calls (docs/performance.md). The forward is the
same compiled expression as megatron's (at bandwidth already). Both round once from fp32, as
megatron's compiled kernels do: the same values (tests/gpu/test_swiglu_gpu.py).

How it is selected: common/model/gpt.py layer_spec puts SwiGLU in every MLP's spec
(MLPSubmodules.activation_func) and build_model sets TransformerConfig
use_te_activation_func=True, megatron's switch for "the activation is the spec's module" (named
for TransformerEngine's, which its TE spec supplies), with bias_activation_fusion off (megatron
refuses both). No megatron code is patched. On a CPU the module computes megatron's unfused
expression with torch's autograd, as before it (the CPU runs' numbers do not move);
swiglu_backward_reference is the kernel's formula in torch ops (tests/test_swiglu.py).
"""

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from common.rl.fused import on_gpu_compiled


@on_gpu_compiled
def swiglu_forward(y):
    """silu(a) * b of the halves (a, b) of y's last dimension (megatron's expression)."""
    a, b = torch.chunk(y, 2, -1)
    return F.silu(a) * b


def swiglu_backward_reference(grad, y):
    """The gradient of swiglu_forward with respect to y, in torch ops, fp32 inside: (dA, dB)
    side by side, dA = grad * b * s * (1 + a * (1 - s)), dB = grad * a * s, s = sigmoid(a)
    (fp64 stays fp64)."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    a, b = (t.to(dtype) for t in torch.chunk(y, 2, -1))
    g, s = grad.to(dtype), torch.sigmoid(a)
    return torch.cat((g * b * s * (1 + a * (1 - s)), g * a * s), -1).to(y.dtype)


@functools.cache
def _backward_kernel():
    """The Triton kernel, made on first use (the CPU stack has no Triton): one program per row
    and BLOCK columns of the half width F; loads a, b and the gradient once, writes both halves."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(y, grad, dy, F_: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F_
        a = tl.load(y + row * 2 * F_ + cols, inside).to(tl.float32)
        b = tl.load(y + row * 2 * F_ + F_ + cols, inside).to(tl.float32)
        g = tl.load(grad + row * F_ + cols, inside).to(tl.float32)
        s = tl.sigmoid(a)
        tl.store(dy + row * 2 * F_ + cols, (g * b * s * (1 + a * (1 - s))).to(dy.dtype.element_ty), inside)
        tl.store(dy + row * 2 * F_ + F_ + cols, (g * a * s).to(dy.dtype.element_ty), inside)

    return kernel, triton.cdiv


BLOCK = 1024  # columns per program (512-2048 measured alike on an H200)
TRITON = True  # False: megatron's compiled swiglu_back on GPUs (bench/train.py --ab swiglu-kernel)


def swiglu_backward(grad, y):
    if not y.is_cuda:
        return swiglu_backward_reference(grad, y)
    if not TRITON:  # megatron's compiled backward, what ran before this module
        from megatron.core.fusions.fused_bias_swiglu import swiglu_back

        return swiglu_back(grad, y)
    kernel, cdiv = _backward_kernel()
    y, grad = y.contiguous(), grad.contiguous()
    half = y.shape[-1] // 2
    rows = y.numel() // y.shape[-1]
    dy = torch.empty_like(y)
    kernel[(rows, cdiv(half, BLOCK))](y, grad, dy, half, BLOCK=BLOCK)
    return dy


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return swiglu_forward(y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return swiglu_backward(grad, y)


def swiglu(y):
    if not y.is_cuda:  # megatron's unfused expression and torch's autograd, as without this module
        return swiglu_forward(y)
    return _SwiGLUFunction.apply(y)


class SwiGLU(MegatronModule):  # a MegatronModule: megatron's MLP asks its children for sharded_state_dict
    """The activation module of the MLP spec: (..., 2F) -> (..., F). No parameters."""

    exact = False  # --true-on-policy (common/model/exact.py convert): vLLM's silu_and_mul in the forward

    def __init__(self, config):
        super().__init__(config=config)
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("SwiGLU: the config is not a gated SiLU MLP (gated_linear_unit, activation_func=F.silu)")

    def forward(self, y):
        if not self.exact:
            return swiglu(y)
        from common.model import exact

        return exact.silu_and_mul(y, swiglu)
