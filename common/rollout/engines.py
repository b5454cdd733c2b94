"""Which rollout engine a run gets: vLLM colocated on GPUs, the HF engine on CPUs.

engine, rollout_tp = make_engine(use_vllm, hf_dir, rollout_tp=..., gpu_memory_utilization=...)
vllm_available()   whether vLLM can be imported here, without importing it
"""

import torch


def make_engine(
    use_vllm,
    hf_dir,
    *,
    rollout_tp=1,
    gpu_memory_utilization=0.5,
    max_model_len=4096,
    seed=0,
    device=None,
    return_routes=False,
    enforce_eager=False,
    batch_invariant=False,
):
    """(engine, rollout TP size): a VLLMEngine (one per vLLM TP group of `rollout_tp` ranks)
    or, on CPUs, an HFEngine in fp32 (each rank its own replica: rollout TP 1). Both cap
    max_model_len at the model's positions and end a response that reaches it.
    return_routes: the engine can return MoE routes (generate(return_routes=True); vLLM turns
    on its route capture at start-up, the HF engine hooks its routers per call). enforce_eager: vLLM
    without torch.compile and CUDA graphs (the CPU engine always runs eagerly). batch_invariant: --true-on-policy's
    vLLM (common/model/exact.py)."""
    if use_vllm:
        from common.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            hf_dir,
            rollout_tp=rollout_tp,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            return_routes=return_routes,
            enforce_eager=enforce_eager,
            batch_invariant=batch_invariant,
        ), rollout_tp
    from common.rollout.hf_engine import HFEngine

    return HFEngine(hf_dir, dtype=torch.float32, device=device, max_model_len=max_model_len), 1


def vllm_available():
    """Whether vllm can be imported here (without importing it: it is slow and GPU-only)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
