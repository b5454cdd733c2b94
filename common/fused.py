"""torch.compile'd elementwise kernels on a GPU, the same Python functions eagerly elsewhere.

    @on_gpu_compiled
    def f(x, ...): ...     # pure tensor math; x decides: CUDA -> compiled, else eager

Why: without TransformerEngine or apex, megatron-core's local spec runs RoPE as ~10 separate
kernels per tensor, and a vocabulary log-softmax in eager torch writes (tokens, vocab) fp32
copies; inductor fuses each such function into one or two Triton kernels that read the input
once (numbers: docs/benchmarks.md). Eager mode runs the very same function, so the CPU tests
check its math, and tests/gpu/ compares the compiled kernels with eager/float64 references.

COMPILE = False turns compilation off everywhere (bench/train.py --kernels eager); a function
named in EAGER stays eager (bench/train.py --kernels no-rope measures one fusion's gain).
"""
import functools

import torch

COMPILE = True
EAGER = set()  # names of decorated functions to run eagerly even on a GPU


def compile_fn(fn):
    # dynamic shapes: micro-batches of any length reuse one kernel; fullgraph: fail, not fall back
    return torch.compile(fn, dynamic=True, fullgraph=True)


def on_gpu_compiled(fn):
    """Decorator: fn compiled (once, on first use) when its first argument is a CUDA tensor."""
    compiled = []

    @functools.wraps(fn)
    def call(x, *args):
        if not (COMPILE and x.is_cuda) or fn.__name__ in EAGER:
            return fn(x, *args)
        if not compiled:
            compiled.append(compile_fn(fn))
        return compiled[0](x, *args)

    call.eager = fn  # the undecorated function (tests compile it on a CPU)
    return call
