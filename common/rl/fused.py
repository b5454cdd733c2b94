"""torch.compile'd elementwise kernels on a GPU, the same Python functions eagerly elsewhere.

    @on_gpu_compiled
    def f(x, ...): ...     # pure tensor math; x decides: CUDA -> compiled, else eager

Why: without TransformerEngine or apex, megatron-core's local spec runs RoPE as ~10 separate
kernels per tensor, and a vocabulary log-softmax in eager torch writes (tokens, vocab) fp32
copies; inductor fuses each such function into one or two Triton kernels that read the input
once (numbers: docs/performance.md). Eager mode runs the very same function, so the CPU tests
check its math, and tests/gpu/ compares the compiled kernels with eager/float64 references.

COMPILE = False turns compilation off everywhere (bench/train.py --kernels eager); a function
named in EAGER stays eager (bench/train.py --kernels no-rope measures one fusion's gain).
"""

import functools

import torch

COMPILE = True
EAGER = set()  # names of decorated functions to run eagerly even on a GPU


def compile_fn(fn):
    """fullgraph: fail, not fall back. Shapes: torch's automatic dynamic (dynamic=None). The
    first call compiles for its exact shapes; a call whose shape differs recompiles once with
    just the dimensions that changed (tokens, rows) symbolic, and later lengths reuse that
    kernel. The vocabulary, head count and head size stay constants, so the kernels index with
    constant divisors: with every dimension symbolic (dynamic=True) the vocabulary logprobs of
    4 x 4096 tokens took 17.3 ms forward + backward on an H200, 10.0 ms this way
    (docs/performance.md, section 3)."""
    return torch.compile(fn, dynamic=None, fullgraph=True)


COMPILED_ON_GPU = []  # the functions on_gpu_compiled decorates (bench/harness.py's count_ops counts each call as one)


def on_gpu_compiled(fn):
    """Decorator: fn compiled (once, on first use) when its first argument is a CUDA tensor."""
    compiled = []
    COMPILED_ON_GPU.append(fn)

    @functools.wraps(fn)
    def call(x, *args):
        if not (COMPILE and x.is_cuda) or fn.__name__ in EAGER:
            return fn(x, *args)
        if not compiled:
            compiled.append(compile_fn(fn))
        return compiled[0](x, *args)

    call.eager = fn  # the undecorated function (tests compile it on a CPU)
    return call
