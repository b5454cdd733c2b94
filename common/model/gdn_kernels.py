"""Which recurrence Qwen3.5's gated delta nets run (--gdn-kernel), without importing megatron-core
(common/run/preflight.py asks before anything is built):

    resolve_gdn_kernel(kernel)   "torch" | "fla" -> the kernel, or a one-line ValueError where fla cannot train
    fla_unavailable()            why fla's kernels cannot train here (a sentence), or None

The kernels themselves: common/model/gdn.py.
"""

import torch

GDN_KERNELS = ("torch", "fla")
FLA_HINT = "pip install fla-core==0.6.0 einops (requirements-gpu.txt)"


def fla_unavailable():
    """Why fla's kernels cannot train here (a sentence), or None where they can: no CUDA GPU, the package
    missing, or fla's own refusal of its backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (wrong
    gradients, fla issue #640) unless tilelang is installed (fla then runs that kernel on it)."""
    import importlib.util

    if not torch.cuda.is_available():
        return "fla runs on CUDA GPUs only (Triton kernels)"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import triton
    except ImportError:
        return f"flash-linear-attention's kernels do not import: {FLA_HINT}"
    from packaging.version import Version

    triton_version = Version(triton.__version__.split("+")[0])
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper and Version("3.4") <= triton_version < Version("3.7.1") and importlib.util.find_spec("tilelang") is None:
        return (
            f"fla's backward gives wrong gradients on Hopper GPUs with Triton {triton_version} (fla issue #640); "
            "Triton >= 3.7.1 or `pip install tilelang` lifts it"
        )
    return None


def resolve_gdn_kernel(kernel="torch"):
    """kernel ("torch" or "fla", see the module docstring) where it can run; "fla" where fla cannot train
    (fla_unavailable) is refused in one line."""
    if kernel not in GDN_KERNELS:
        raise ValueError(f"gdn_kernel={kernel!r}: choose one of {GDN_KERNELS}")
    why = fla_unavailable() if kernel == "fla" else None
    if why:
        raise ValueError(f"--gdn-kernel fla: {why}; or pass --gdn-kernel torch")
    return kernel
