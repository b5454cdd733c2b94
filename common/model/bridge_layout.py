"""How the model is split and what it recomputes: the TransformerConfig fields and checks of
the parallel layout (pipeline stages, even or not; what TP/EP/ETP must divide) and of
activation recompute. Pure functions beside common/model/bridge.py, which uses them in
transformer_config and re-exports them (common.model.bridge.pipeline_layout etc.).
"""

from common.model.bridge_mla import check_mla_layout


def pipeline_layout(num_layers, pp=1, vpp=None, first=None, last=None):
    """The TransformerConfig fields that split num_layers decoder layers over pp pipeline
    stages (each cut into vpp virtual stages): {} when the layers divide evenly over pp * vpp
    and no stage size is asked for (megatron's even split), else megatron's uneven split
    num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage.

    megatron-core 0.16.1 (TransformerConfig.__post_init__) gives the first and the last
    stage their own layer counts and the middle stages equal shares of the rest; every stage
    holds at least one layer and, with vpp, a multiple of vpp (one share per virtual stage).
    first / last (--first-stage-layers / --last-stage-layers) fix those two counts; what is
    not given is chosen: the split whose busiest stage has the fewest layers (the pipeline
    runs at that stage's pace), then the fewest layers on the last stage (it also runs the
    output layer and the loss, a matmul and a softmax over the whole vocabulary), then the
    most on the first (it only adds the embedding lookup). Per stage: 3 layers on 2 stages
    [2, 1], 5 on 2 [3, 2], 7 on 4 [2, 2, 2, 1], 6 on 2 x vpp 2 [4, 2].
    Raises ValueError (what is wrong, how to fix it) for a split megatron cannot build.
    """
    v = vpp or 1
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--first-stage-layers/--last-stage-layers size pipeline stages: they need --pp > 1")
        return {}
    if first is None and last is None and num_layers % (pp * v) == 0:
        return {}
    splits = []  # layers per stage: first, the middle ones (all the same), last
    for f in [first] if first is not None else range(v, num_layers + 1, v):
        for m in range(v, num_layers + 1, v) if pp > 2 else [0]:
            stages = [f] + [m] * (pp - 2) + [num_layers - f - (pp - 2) * m]
            if all(n >= v and n % v == 0 for n in stages) and last in (None, stages[-1]):
                splits.append(stages)
    if not splits:
        asked = " and ".join(
            f"{flag} {value}"
            for flag, value in (("--first-stage-layers", first), ("--last-stage-layers", last))
            if value is not None
        )
        where = f"--pp {pp}" + (f" x --vpp {vpp}" if vpp else "") + (f" with {asked}" if asked else "")
        why = (
            "every stage needs "
            + (f"a positive multiple of --vpp {v} layers" if v > 1 else ">= 1 layer")
            + (f", the {pp - 2} middle stage(s) equal shares" if pp > 2 else "")
            + "; choose other --first-stage-layers/--last-stage-layers, --pp or --vpp"
        )
        if num_layers < pp * v:
            why = f"fewer layers than (virtual) pipeline stages ({pp * v}); use a smaller --pp or --vpp"
        raise ValueError(f"num_hidden_layers={num_layers} cannot be split over {where}: {why}")
    stages = min(splits, key=lambda s: (max(s), s[-1], -s[0]))
    if pp == 2:  # the last stage gets the rest; megatron-core 0.16.1's interleaved offset
        return dict(num_layers_in_first_pipeline_stage=stages[0])  # divides by the middle stages' count
    return dict(num_layers_in_first_pipeline_stage=stages[0], num_layers_in_last_pipeline_stage=stages[-1])


def stage_layers(config):
    """Decoder layers of each pipeline stage (all its virtual stages) as megatron builds them
    for this TransformerConfig, e.g. [2, 1]: what a checkpoint's optimizer shards and a log need."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    vpp = config.virtual_pipeline_model_parallel_size
    return [
        get_num_layers_to_build(config, vp_stage=0 if vpp else None, pp_rank=rank) * (vpp or 1)
        for rank in range(config.pipeline_model_parallel_size)
    ]


def check_parallel_layout(spec, tp=1, pp=1, vpp=None, ep=1, etp=1, first_stage_layers=None, last_stage_layers=None):
    """Clear errors for layouts the model's shapes cannot be split into."""
    if spec.moe is None and ep * etp > 1:
        raise ValueError(f"--ep/--etp need a Mixture-of-Experts model; {spec.architecture} is dense")
    if spec.moe is not None:
        if spec.moe.num_experts % ep:
            raise ValueError(f"--ep {ep} must divide the number of experts ({spec.moe.num_experts})")
        if spec.moe.ffn_hidden_size % etp:
            raise ValueError(f"--etp {etp} must divide the experts' intermediate size ({spec.moe.ffn_hidden_size})")
        if spec.moe.shared_expert_size % tp:
            raise ValueError(f"--tp {tp} must divide shared_expert_intermediate_size={spec.moe.shared_expert_size}")
    if spec.mla is not None:
        check_mla_layout(spec.mla, tp)
    if spec.gdn is not None and spec.gdn.num_key_heads % tp:
        raise ValueError(f"--tp {tp} must divide linear_num_key_heads={spec.gdn.num_key_heads} (the delta net's heads)")
    if spec.num_kv_heads % tp:
        raise ValueError(
            f"--tp {tp} must divide num_key_value_heads={spec.num_kv_heads} "
            "(megatron keeps whole query groups on a rank)"
        )
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"--tp {tp} must divide intermediate_size={spec.ffn_hidden_size}")
    pipeline_layout(spec.num_layers, pp, vpp, first_stage_layers, last_stage_layers)


RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts")  # selective, without TE


def recompute_config(recompute="none", modules=("core_attn",), num_layers=1):
    """--recompute -> megatron TransformerConfig fields: activation recompute trades compute
    for memory. "selective" recomputes `modules` of every layer in the backward (megatron's
    recompute_modules; "layernorm" needs TE in megatron-core 0.16.1: its checkpoint helper
    calls TE's FP8 state manager); "full" stores only each chunk of num_layers layers' input
    and recomputes the chunk (recompute_method "uniform")."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(
                f"recompute modules {unknown} are not available without TransformerEngine; "
                f"choose from {', '.join(RECOMPUTE_MODULES)}"
            )
        return dict(recompute_granularity="selective", recompute_modules=list(modules))
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=num_layers)
    raise ValueError(f"recompute={recompute!r}: none, selective or full")
