"""The one place that adapts megatron-core 0.16.1's CUDA assumptions to a CPU.

Applied by common.dist only when torch.cuda is unavailable; on a GPU nothing here
runs. Megatron-core is written for CUDA: it hard-codes device="cuda" and
torch.cuda.current_device() in tensor factories, keeps a CUDA RNG tracker, and
compares Tensor.type() strings against 'torch.cuda.FloatTensor'. Each patch below
says which of those it adapts and where megatron does it (file:line of 0.16.1).

This is the only monkey-patching in the project (STYLE.md rule 6). Two functions here also
run on GPUs: megatron_without_te fixes a megatron bug that any machine without
TransformerEngine hits, and wgrad_accumulation_without_apex gives megatron's linear layers
the fused weight-gradient accumulation that otherwise needs apex's CUDA extension.
"""

import sys

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def _is_cuda(device):
    """True for every way megatron names a CUDA device: "cuda", "cuda:0", 0, torch.device("cuda")."""
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites device="cuda" (and .to("cuda"), .cuda(), pin_memory) to the CPU inside torch calls.

    NB: a TorchFunctionMode is not active inside autograd's backward pass, which is why
    torch.cuda.current_device and Tensor.cuda are also patched directly in apply().
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory") and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _called_from_megatron(depth=2):
    return "megatron" in sys._getframe(depth).f_code.co_filename


def apply():
    """Install the CPU adaptations once per process. Safe to call again (no-op)."""
    global _applied
    if _applied:
        return
    assert not torch.cuda.is_available(), "cpu_compat is for machines without CUDA only"

    # 1. Device literals: torch.cuda.current_device() is used as a device in megatron's
    #    parameter allocation and in backward (tensor_parallel/layers.py, mappings.py).
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None

    # 2. RNG: megatron keeps a CUDA RNG state tracker (tensor_parallel/random.py) that
    #    attention forks for dropout; route the CUDA RNG calls to the CPU generator.
    #    (Not torch.manual_seed here: it calls torch.cuda.manual_seed_all -> recursion.)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed, *a, **k: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda *a, **k: None
    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 3. The optimizer and grad clipping select parameters by Tensor.type() string
    #    ('torch.cuda.FloatTensor': optimizer/clip_grads.py, optimizer.py, distrib_optimizer.py).
    #    Report CPU float tensors under their CUDA names, to megatron callers only.
    original_type = torch.Tensor.type
    cuda_names = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }

    def tensor_type(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and name in cuda_names and _called_from_megatron():
            return cuda_names[name]
        return name

    torch.Tensor.type = tensor_type

    # 4. MoE's all-to-all token dispatcher (transformer/moe/token_dispatcher.py:445) creates a
    #    torch.cuda.Stream and records events on it to overlap copies; on a CPU there is
    #    nothing to overlap: streams and events that do nothing.
    class _NullEvent:
        def synchronize(self):
            pass

        def wait(self, *args, **kwargs):
            pass

    class _NullStream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, *args, **kwargs):
            pass

        def record_event(self, *args, **kwargs):
            return _NullEvent()

        def synchronize(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: _NullStream()

    # 5. The same dispatcher turns its split sizes into numpy through
    #    maybe_move_tensor_to_cpu(as_numpy=True), which converts only CUDA tensors
    #    (moe_utils.py:1078); a CPU tensor stays a tensor and all_to_all_single refuses it
    #    (mappings.py:444). token_dispatcher.py imports the function by name.
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    _CudaToCpu().__enter__()  # stays active for the life of the process
    _applied = True


def megatron_without_te():
    """megatron-core 0.16.1's multi_latent_attention.py decides HAVE_TE by importing
    megatron.core.extensions.transformer_engine, which imports without TE and exports mock
    stubs; MLASelfAttention then calls isinstance(linear_proj, TELinear) on a mock and dies
    with "isinstance() arg 2 must be a type" (multi_latent_attention.py:185), on a GPU as on
    a CPU. Tell it the truth when TE is absent. Called by common/model/gpt.py before building MLA."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


class _TorchWgradAccumulation:
    """Stands in for apex's fused_weight_gradient_mlp_cuda extension: main_grad (out, in) +=
    grad_output^T (out, N) @ total_input (N, in), one GEMM writing into the gradient buffer.
    On CUDA the bf16 product is accumulated into the fp32 buffer by the GEMM itself
    (torch.addmm with out_dtype, cuBLAS beta=1); torch's CPU backend has no such kernel, so
    there the product is formed in fp32 first."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == torch.float32:
            torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)
        elif main_grad.is_cuda:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
        else:
            main_grad.addmm_(grad_output.t().float(), total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)


def wgrad_accumulation_without_apex():
    """megatron-core 0.16.1's linear layers (tensor_parallel/layers.py:561-577), with
    gradient_accumulation_fusion, hand each weight gradient to apex's
    fused_weight_gradient_mlp_cuda, which layers.py imports at its top (:44-48) and, without
    apex, never has. Otherwise every weight gradient is a bf16 tensor that megatron's DDP hook
    then adds into the fp32 buffer (distributed_data_parallel.py:438): at Qwen2-1.5B 792
    separate adds per step, 28 ms on an H100 (docs/performance.md). Give layers.py a
    torch stand-in for that extension (no-op where apex provides it); common/train/setup.py
    switches the fusion on for the layers of the models it wraps for training."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _TorchWgradAccumulation
