"""The console of a run: the one place where known-harmless third-party warnings are silenced, the log
levels of vLLM and megatron-core, and the progress bar of the training steps.

    quiet_known_warnings()                           # first thing in main(), before the heavy imports
    quiet_third_party_logging(verbose=args.verbose)  # before vllm is imported
    for step in progress_bar(range(start, steps), "grpo", enabled=master_process): ...
"""

import os
import sys
import warnings

# ---- known-harmless third-party warnings ---------------------------------------------------

# (message regex, category, module regex, on_gpu_too): warnings a new user sees on every run
# (train_grpo.py / train_ppo.py, 1 process and torchrun) that say nothing about their run.
# Each is matched by its own message AND the module it is attributed to, so the same words
# from elsewhere, and every other warning, still print. Seen with megatron-core 0.16.1,
# torch 2.13 (CPU); recheck after an upgrade by running without quiet_known_warnings().
KNOWN_HARMLESS_WARNINGS = [
    # megatron-core's import-time notices (optimizer/, clip_grads, megatron_fsdp): this repo runs
    # without TransformerEngine/apex by design (requirements-gpu.txt: TE optional); the fallbacks
    # are the torch paths common/rl/fused.py and common/train/setup.py are written for.
    (r"Transformer Engine and Apex are not installed\. Falling back", UserWarning, r"megatron\.", True),
    # megatron-core's local layer spec (models/backends.py, gpt_layer_specs.py): same reason; the
    # norms are RMSNorm in torch (common/model/gpt.py:layer_spec).
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.", True),
    # megatron-core 0.16.1's own TransformerConfig default cuda_graph_scope="full" warns on every
    # config it builds; the default is then converted to the new spelling, and no CUDA graphs are
    # captured here.
    (
        r"full scope is deprecated\. Use empty cuda_graph_scope",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        True,
    ),
    # torch renamed these collectives; the old names still work. Callers: megatron-core 0.16.1
    # (distributed optimizer, TP gathers) and common/model/weights.py's weight export. Attributed to
    # torch's deprecation wrapper (torch/distributed/c10d_logger.py).
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.",
        True,
    ),
    # megatron's DistributedOptimizer.zero_grad reads .grad of its fp32 shard views, which are not
    # leaves (megatron's source says so: "throws grad-access warning"); nothing is lost, the
    # optimizer's real grads are the main_grad buffers. On a CPU the read goes through
    # common/model/cpu_compat.py's TorchFunctionMode, so the warning is attributed there.
    (
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"(megatron\.core\.optimizer|common\.model\.cpu_compat)\b",
        True,
    ),
    # Loading a megatron checkpoint (--resume, --mcore-ckpt, merge_to_hf.py): megatron-core 0.16.1's
    # torch_dist loader (dist_checkpointing/strategies/torch.py) calls torch's deprecated
    # checkpoint.load_state_dict and builds ShardedTensors, which torch 2.13 plans to retire. Both
    # still load exactly (the round trips in tests/test_convert.py are bit-exact). The ShardedTensor
    # notice comes from its __torch_function__ and is attributed to the Python frame of the torch call
    # (megatron's or torch's checkpoint code; on a CPU common/model/cpu_compat.py's TorchFunctionMode).
    (
        r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load` instead",
        FutureWarning,
        r"megatron\.core\.dist_checkpointing\.",
        True,
    ),
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"(megatron\.core\.dist_checkpointing\.|torch\.distributed\.checkpoint\.|common\.model\.cpu_compat\b)",
        True,
    ),
    # TP > 1: a GPU stream-ordering hint (megatron/core/tensor_parallel/layers.py). Meaningless on
    # a CPU (no CUDA streams), so filtered only there; on a GPU it is real tuning advice and shows.
    (
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.core\.tensor_parallel",
        False,
    ),
]


def quiet_known_warnings(rank: int | None = None, on_gpu: bool | None = None):
    """Silence KNOWN_HARMLESS_WARNINGS, and every warning on ranks != 0. Call it first thing in
    main(), before the imports of megatron / transformers (several warnings fire at import).

    rank: this process's global rank; default: the launcher's (torchrun RANK / srun
    SLURM_PROCID, common.run.dist.launcher_rank), so it works before init_distributed.
    Ranks != 0: all warnings are ignored. Every rank runs the same program (SPMD), so rank 0
    prints each one once instead of world-size times; and Hugging Face progress bars (the
    per-rank "Loading weights" bar) are turned off there too.
    on_gpu: default torch.cuda.is_available(); decides the CPU-only entries.
    A user who passes -W or sets PYTHONWARNINGS gets exactly those filters: this does nothing.
    """
    if sys.warnoptions:
        return
    if rank is None:
        from common.run.dist import launcher_rank

        rank = launcher_rank()
    if rank != 0:
        warnings.simplefilter("ignore")
        # Read by huggingface_hub when transformers is first imported; an explicit setting wins.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers.utils.logging" in sys.modules:  # already imported: switch off directly
            sys.modules["transformers.utils.logging"].disable_progress_bar()
        return
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    for message, category, module, on_gpu_too in KNOWN_HARMLESS_WARNINGS:
        if on_gpu_too or not on_gpu:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_third_party_logging(verbose: bool = False, rank: int | None = None):
    """vLLM's and megatron-core's INFO lines off: a colocated vLLM logs ~40 lines while it starts
    and a few every step (sleep, wake: under the progress bar), megatron-core its set-up. Rank 0
    keeps their warnings, the other ranks only errors (every rank runs the same program: one
    copy of each warning is enough). Call it before vllm is imported: vLLM reads its level from
    VLLM_LOGGING_LEVEL once, at import (vllm/logger.py); an explicit VLLM_LOGGING_LEVEL wins.

    verbose (--verbose): their INFO lines, on every rank: vLLM's level INFO (its own default),
    megatron-core's INFO printed to stderr (given a handler when nothing configured logging).
    rank: default the launcher's (common.run.dist.launcher_rank), so it works before init_distributed."""
    import logging

    if rank is None:
        from common.run.dist import launcher_rank

        rank = launcher_rank()
    level = "INFO" if verbose else "WARNING" if rank == 0 else "ERROR"
    vllm_level = os.environ.setdefault("VLLM_LOGGING_LEVEL", level)
    if "vllm" in sys.modules:  # imported already: its logger is configured, set it directly
        logging.getLogger("vllm").setLevel(vllm_level)
    megatron = logging.getLogger("megatron.core")  # python logging, read at each message
    megatron.setLevel(level)
    if verbose and not megatron.hasHandlers():  # else INFO would reach only logging's last resort (WARNING+)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        megatron.addHandler(handler)


def progress_bar(iterable, desc, enabled=True):
    """tqdm over the training steps, on the master process only (the others pass enabled=False)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, disable=not enabled, dynamic_ncols=True)
