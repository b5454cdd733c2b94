"""Model chunks as build_model returns them (DDP / Float16Module wrappers around a GPTModel),
and their tensors under global names.

  unwrap(chunk)                      the GPTModel inside the wrappers
  named_global_parameters(chunk)     parameters under global layer / expert indices
  named_global_tensors(chunk)        the same plus the buffers that are checkpoint tensors
"""

from common.model.bridge_moe import expert_index, global_expert_name


def unwrap(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def named_global_tensors(chunk, global_experts=True):
    """named_global_parameters, plus the buffers that are HF checkpoint tensors: DeepSeek-V3's
    router score-correction bias (`mlp.router.expert_bias`, fp32; not trained by the optimizer,
    moved only by --moe-router-bias-update-rate)."""
    yield from named_global_parameters(chunk, global_experts)
    model = unwrap(chunk)
    for layer in model.decoder.layers:
        bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
        if bias is not None:
            yield f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias", bias


def named_global_parameters(chunk, global_experts=True):
    """Yield (global_name, param): local decoder layer indices replaced by global ones
    (pipeline stages and virtual stages number their layers from 0), and with global_experts
    local expert indices replaced by global ones (expert e = ep_rank * E/ep + j lives in
    `local_experts.{j}` of EP rank ep_rank)."""
    from megatron.core import parallel_state as mpu

    model = unwrap(chunk)
    layer_index = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(model.decoder.layers)}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, local, rest = name.split(".", 3)
            name = f"decoder.layers.{layer_index[local]}.{rest}"
            if global_experts and expert_index(name) is not None:
                name = global_expert_name(
                    name,
                    mpu.get_expert_model_parallel_rank(),
                    mpu.get_expert_model_parallel_world_size(),
                    model.config.num_moe_experts,
                )
        yield name, param
