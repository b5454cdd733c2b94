"""The features bench/train.py --ab times off and on in alternate steps of one process.

Each is a switch, a function(on) over a built model, that the bench calls between steps:
FEATURES names them (the --ab choices and their help), ab_switches makes them for a model.
A new feature is an entry in both.
"""

FEATURES = {
    "wgrad-fusion": "weight gradients accumulated into main_grad in the GEMM and the MoE experts' per layer, "
    "common/train/setup.py fuse_wgrad_accumulation, vs megatron's gradient then DDP's hook",
    "device-sort": "MoE at EP=1: tokens sorted by expert on the device, common/model/moe.py, vs megatron's all-gather "
    "dispatcher",
    "allgather": "MoE at EP > 1: the all-gather dispatcher, common/model/moe.py DeviceSortDispatcher, vs megatron's "
    "all-to-all",
    "padding-mask": "the MoE routers told which positions are padding, common/model/moe.py moe_padding_mask",
    "logprob-micro-batch": "the old-logprob (forward-only) pass in micro-batches of --logprob-micro-batch-size "
    "sequences, as the scripts' flag, vs the update's --micro-batch-size",
    "swiglu-kernel": "the MLPs' SwiGLU backward as one Triton kernel reading its inputs once, "
    "common/model/swiglu.py, vs megatron's compiled swiglu_back",
    "qkv-bias-gemm": "the QKV bias added by the GEMM, common/model/linear.py, vs megatron's separate add",
    "cp-split": "with --cp, each chunk's attention split at its own keys and run on cuDNN, "
    "common/model/attention_cp.py, vs one varlen flash call per chunk",
    "listed-copies": "the distributed optimizer's grad views and param copies from lists made once, "
    "common/train/setup.py ListedCopies, vs megatron's per-parameter loop",
    "compiled-dispatch": "the all-gather dispatcher's bookkeeping as one compiled call, "
    "common/model/moe.py permuted_rows, vs the same function eager",
    "compiled-router": "the routers' top-k, aux-loss scores and load-balancing loss compiled, "
    "common/model/moe_router.py, vs megatron's eager routing",
    "in-place-experts": "the MoE experts' GEMMs read their weights in megatron's buffer and add their gradients there "
    "in place, common/model/moe_experts.py GroupedExperts.stacks, vs weights stacked per pass and gradients cast "
    "and added by foreach",
}


def ab_switches(model, optimizer, passes):
    """{feature: function(on)} for these DDP-wrapped chunks and their optimizer. passes: the bench's
    dict of how it runs its passes, which two switches set: "padding_mask" (whether the passes hand
    megatron the padding mask) and "logprob_micro_batch" (whether the old-logprob pass takes
    --logprob-micro-batch-size sequences per micro-batch or the update's)."""
    from common.model import attention_cp, linear, swiglu
    from common.model.moe_experts import GroupedExperts
    from common.model.moe_router import Router
    from common.rl import fused
    from common.train.setup import fuse_wgrad_accumulation, listed_optimizer_copies

    routers = [m for chunk in model for m in chunk.modules() if isinstance(m, Router)]
    experts = [m for chunk in model for m in chunk.modules() if isinstance(m, GroupedExperts)]

    return {
        "wgrad-fusion": lambda on: fuse_wgrad_accumulation(model, enabled=on),
        "device-sort": device_sort_switch(model),
        "allgather": allgather_switch(model),
        "padding-mask": lambda on: passes.__setitem__("padding_mask", on),
        "logprob-micro-batch": lambda on: passes.__setitem__("logprob_micro_batch", on),
        "qkv-bias-gemm": lambda on: setattr(linear, "ENABLED", on),
        "swiglu-kernel": lambda on: setattr(swiglu, "TRITON", on),
        "cp-split": lambda on: setattr(attention_cp, "SPLIT", on),
        "listed-copies": lambda on: listed_optimizer_copies(optimizer, enabled=on),
        "compiled-dispatch": lambda on: (fused.EAGER.discard if on else fused.EAGER.add)("permuted_rows"),
        "compiled-router": lambda on: [setattr(router, "compiled", on) for router in routers],
        "in-place-experts": lambda on: [setattr(layer, "in_place", on) for layer in experts],
    }


def device_sort_switch(model):
    """MoE at EP=1: a function(on) that gives the layers common/model/moe.py sorts tokens for its
    device-sorted dispatch (on) or megatron's all-gather dispatcher (off)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from common.model.moe import DeviceSortDispatcher

    dispatchers = [
        m.token_dispatcher
        for chunk in model
        for m in chunk.modules()
        if type(getattr(m, "token_dispatcher", None)) is DeviceSortDispatcher
    ]

    def switch(on):
        for dispatcher in dispatchers:
            dispatcher.__class__ = DeviceSortDispatcher if on else MoEAllGatherTokenDispatcher

    return switch


def allgather_switch(model):
    """MoE at EP > 1: a function(on) that gives the layers whose experts are spread over EP ranks
    the all-gather dispatch of --moe-dispatcher allgather (common/model/moe.py DeviceSortDispatcher;
    on) or megatron's all-to-all (off). Both dispatchers are made now, the one the model lacks
    with megatron's own constructor arguments; a switch swaps the layers' objects."""
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

    from common.model.moe import device_sort_possible, device_sorted

    pairs = []
    for module in (m for chunk in model for m in chunk.modules()):
        if not (
            isinstance(module, MoELayer)
            and module.num_local_experts < module.config.num_moe_experts
            and device_sort_possible(module)
        ):
            continue
        made = {}
        for kind in (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher):
            made[kind] = (
                module.token_dispatcher
                if isinstance(module.token_dispatcher, kind)
                else kind(
                    module.num_local_experts,
                    module.local_expert_indices,
                    config=module.config,
                    pg_collection=moe_layer.get_default_pg_collection(),
                )
            )
        pairs.append(
            (module, device_sorted(made[MoEAllGatherTokenDispatcher], module), made[MoEAlltoAllTokenDispatcher])
        )

    def switch(on):
        for module, allgather, alltoall in pairs:
            module.token_dispatcher, module.experts.mask_tail = (allgather, True) if on else (alltoall, False)

    return switch
