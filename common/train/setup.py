"""Training wrappers for model chunks: megatron DDP (+ distributed optimizer), Adam and an LR schedule.

  ddp_chunks, optimizer, scheduler = setup_training(chunks, lr=..., ...)
  torch_adams(optimizer)   the torch Adam instances inside
  global_grad_norm(grads, group)             the L2 norm over ranks, one host wait
  listed_optimizer_copies(optimizer)         the distributed optimizer's per-parameter copies as lists made once
  fuse_wgrad_accumulation(ddp_chunks)        weight gradients written straight into the fp32 buffer (experts too)
  ensure_adam_state / load_optimizer_state   megatron's torch-Adam path, made loadable
                                             (common/train/save.py uses them)
  adam_state_to_come(optimizer)              the moments Adam's first step will create (host buffer sizes)

Kept apart from common/model/gpt.py (builds the model) and common/model/weights.py (moves HF weights in and out).
"""

import functools

import torch

from common.model.chunks import unwrap


def setup_training(
    chunks,
    *,
    lr,
    min_lr=0.0,
    weight_decay=0.0,
    adam_betas=(0.9, 0.999),
    adam_eps=1e-8,
    clip_grad=1.0,
    warmup_steps=0,
    total_steps=1,
    decay_style="constant",
    use_distributed_optimizer=True,
    overlap_grad_reduce=False,
    listed_copies=True,
):
    """Wrap model chunks for training. Returns (ddp_chunks, optimizer, scheduler).

    - megatron DDP: gradients reduced over the data-parallel group into fp32 buffers;
      by default DDP *averages* gradients over DP ranks (loss per rank is a local mean).
    - megatron's optimizer: Adam with fp32 main params for bf16 models, grad clipping
      (clip_grad = max global grad norm), sharded over DP when use_distributed_optimizer.
    - OptimizerParamScheduler: linear warmup over warmup_steps, then decay_style
      ("constant", "linear", "cosine") from lr to min_lr at total_steps. One scheduler
      step per optimizer step.
    - listed_copies: the distributed optimizer's copies from lists (ListedCopies); False gives
      megatron's per-parameter loop (bench/train.py --ab listed-copies times both).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = unwrap(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp_chunks = [
        # only the first chunk's buckets start the grad reduce early (megatron's convention)
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # the pipeline schedule calls these: grad all-reduce (DP, tied embeddings, SP norms) ...
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    config.grad_scale_func = None
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            adam_beta1=adam_betas[0],
            adam_beta2=adam_betas[1],
            adam_eps=adam_eps,
            clip_grad=clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        ddp_chunks,
    )
    # Without TE/apex megatron falls back to torch.optim.AdamW in its default multi-tensor
    # (foreach) mode: ~10 passes over the fp32 params and moments per step. torch's fused
    # kernel makes one (docs/performance.md). Set before the first step, which creates the
    # step counters (on the device for fused).
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            group.update(fused=True, foreach=False)
        adam.defaults.update(fused=True, foreach=False)
    fuse_wgrad_accumulation(ddp_chunks)
    listed_optimizer_copies(optimizer, enabled=listed_copies)
    # the gradient norm for clipping without megatron's one host wait per tensor (no TE/apex)
    optimizer = _foreach_norm_optimizer_class()(getattr(optimizer, "chained_optimizers", [optimizer]))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_steps else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, warmup_steps + 1),
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return ddp_chunks, optimizer, scheduler


def fuse_wgrad_accumulation(ddp_chunks, enabled=True):
    """Megatron's linear layers in these DDP-wrapped chunks accumulate their weight gradients
    into the parameters' fp32 main_grad buffers inside the gradient GEMM (megatron's
    gradient_accumulation_fusion, with common/model/cpu_compat.py's torch stand-in for apex's
    kernel), instead of a bf16 gradient that DDP's hook adds afterwards; and MoE layers'
    grouped experts add their weight gradients into main_grad per layer, not per expert
    (common/model/moe_experts.py _StackedWeights; not with overlap_grad_reduce, which waits for DDP's
    per-parameter hooks). Only for wrapped chunks: the fused paths need each weight's
    main_grad, which DDP makes. Returns the number of layers switched."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from common.model.cpu_compat import wgrad_accumulation_without_apex
    from common.model.moe_experts import GroupedExperts

    wgrad_accumulation_without_apex()
    layers = []
    for chunk in ddp_chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.gradient_accumulation_fusion = enabled
                # what megatron's CUDA graph runner reads to restore grad_added_to_main_grad on replay
                module.config.gradient_accumulation_fusion = enabled
                layers.append(module)
            elif isinstance(module, GroupedExperts):
                module.fuse_wgrad = enabled and not chunk.ddp_config.overlap_grad_reduce
                layers.append(module)
    return len(layers)


def global_grad_norm(grads, group):
    """The L2 norm of all these gradients on all ranks of group (each rank passes the ones it
    owns), as a float: torch's foreach norms, one all-reduce of the squared sum, one host wait."""
    if grads:
        squared = torch.nn.utils.get_total_norm(grads, 2.0).float().reshape(1) ** 2
    else:  # e.g. a distributed-optimizer rank whose shard holds no gradient of this group
        squared = torch.zeros(1, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(squared, group=group)
    return squared.item() ** 0.5


@functools.cache
def _foreach_norm_optimizer_class():
    """megatron's ChainedOptimizer with the gradient norm of global_grad_norm and the clipping
    as one foreach multiply.

    Without TE/apex megatron-core computes the norm for clipping with a fallback that copies
    each parameter's norm to the host in turn (utils.py local_multi_tensor_l2_norm: one host
    wait per gradient tensor, 198 per step at Qwen2-1.5B, 1,581 in a 6-layer Qwen3-30B-A3B
    with 128 experts, each draining the GPU's queue; docs/performance.md). The same norm from
    torch's foreach kernels waits once. Optimizers whose gradient statistics use different
    process groups keep megatron's way. The clipping's fallback (local_multi_tensor_scale)
    multiplies into a new tensor and copies it back, tensor by tensor: 3,850 launches per step
    of a 14-layer Qwen3-30B-A3B at EP=2 (1,925 gradient shards); torch._foreach_mul_ scales
    them in place in a few (the same products: one fp32 multiply each).
    """
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    class ForeachNormOptimizer(ChainedOptimizer):
        def _ours(self):
            return (
                self.chained_optimizers
                and self.grads_states_parallel_group_is_shared()
                and not any(
                    opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 for opt in self.chained_optimizers
                )
            )

        @torch.no_grad()
        def get_grad_norm(self):
            if not self._ours():
                return super().get_grad_norm()
            grads = [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]
            return global_grad_norm(grads, self.get_grad_stats_parallel_group())

        @torch.no_grad()
        def step(self):
            """ChainedOptimizer.step (megatron-core 0.16.1) with the clipping of clip_grads.py
            clip_grad_by_total_norm_fp32 done by one foreach multiply."""
            if not self._ours():
                return super().step()
            if self.prepare_grads():  # found inf/nan (loss scaling; bf16 has none)
                return False, None, None
            grad_norm = self.get_grad_norm()
            for opt in self.chained_optimizers:
                if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
                    continue
                coeff = opt.config.clip_grad / (grad_norm + 1.0e-6)
                grads = [p.grad for p in opt.get_parameters() if p.grad is not None]
                if coeff < 1.0 and grads:
                    torch._foreach_mul_(grads, coeff)
            num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
            return self.step_with_ready_grads(), grad_norm, num_zeros

    return ForeachNormOptimizer


def listed_optimizer_copies(optimizer, enabled=True):
    """Give the distributed optimizers in this megatron optimizer (a chain or one) the copies of
    ListedCopies, or megatron's own back (enabled False; bench/train.py --ab listed-copies).
    Returns the number switched."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    listed = _listed_copies_class()
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and type(opt) in (DistributedOptimizer, listed):
            opt.__class__ = listed if enabled else DistributedOptimizer
            switched += 1
    return switched


@functools.cache
def _listed_copies_class():
    """megatron's DistributedOptimizer whose two per-parameter copies around the Adam step run
    from lists made on first use.

    megatron-core 0.16.1 (distrib_optimizer.py) points each fp32 main shard's .grad at its slice
    of DDP's gradient buffer, and after Adam copies each main shard into its slice of the bf16
    parameter buffer, parameter by parameter, looking up the slice's ranges in dicts each time:
    11-14 us of host time per tensor each way on a CPU, 1,925 tensors per step in a 14-layer
    Qwen3-30B-A3B at EP=2, while the GPU waits (docs/performance.md). The slices are views of
    buffers that live as long as the model (offload shrinks and regrows their storages in
    place: views stay valid), so they are made once; each step then assigns the grads from a
    list and copies (and casts) all shards with one torch._foreach_copy_. Same tensors, same
    values: tests/test_training.py compares both with megatron's. Only the plain case (bf16 or
    fp32 params, no FSDP, no precision-aware or FP8 optimizer); anything else is megatron's.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class ListedCopies(DistributedOptimizer):
        def _listed(self):
            """([main shard], [its grad's view], [its model slice's view]) or None (megatron's way)."""
            if "_copy_lists" not in self.__dict__:
                self._copy_lists = None
                if not (
                    self.is_stub_optimizer
                    or self.ddp_config.use_megatron_fsdp
                    or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                    or self.config.reuse_grad_buf_for_mxfp8_param_ag
                    or self.config.fp8_recipe
                ):
                    self._copy_lists = self._make_lists()
            return self._copy_lists

        def _make_lists(self):
            mains, grads, slices = [], [], []
            pairs = (
                (self.model_float16_groups, self.shard_fp32_from_float16_groups),
                (self.model_fp32_groups, self.shard_fp32_groups),
            )
            for model_groups, main_groups in pairs:
                for model_group, main_group in zip(model_groups, main_groups):
                    for model_param, main in zip(model_group, main_group):
                        ranges = self._get_model_param_range_map(model_param)
                        grad = model_param.main_grad.view(-1)[ranges["param"].start : ranges["param"].end]
                        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                        world = ranges["gbuf_world_in_bucket"]
                        target = (
                            self.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)[world.start : world.end]
                        )
                        if grad.dtype != main.dtype or target.numel() != main.numel():
                            return None  # not the fp32 gradient buffer assumed here
                        mains.append(main)
                        grads.append(grad)
                        slices.append(target)
            return mains, grads, slices

        def _copy_model_grads_to_main_grads(self):
            lists = self._listed()
            if lists is None:
                return super()._copy_model_grads_to_main_grads()
            for main, grad in zip(lists[0], lists[1]):
                main.grad = grad

        def _copy_main_params_to_model_params(self):
            lists = self._listed()
            if lists is None:
                return super()._copy_main_params_to_model_params()
            if lists[0]:
                torch._foreach_copy_(lists[2], lists[0])

    return ListedCopies


def torch_adams(optimizer):
    """The torch Adam/AdamW instances inside a megatron optimizer (megatron's choice without
    TE/apex); TE / apex FusedAdam keep their state their own way and are not listed."""
    inners = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [inner for inner in inners if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))]


# --- optimizer state on megatron's torch-Adam path (no TE/apex): what checkpoints need ---
def _step_tensor(value, group, param):
    # where torch Adam itself keeps the step: on the param's device for fused/capturable, else host
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(value), dtype=torch.float32, device=param.device if on_device else "cpu")


def load_optimizer_state(optimizer, state_dict):
    """optimizer.load_state_dict for megatron's DistributedOptimizer over torch Adam (the GPU
    stack without TE/apex, and every CPU run). megatron-core 0.16.1's method, called as it is,
    fails on that path (distrib_optimizer.py):
      - its per-parameter loaders copy every key of the live Adam state into place, 'step'
        included, from checkpoint tensors that have no 'step' (KeyError, line 940);
      - the dp_reshardable loader runs with autograd on and copies into the fp32 main params,
        which require grad ("a view of a leaf Variable ... in-place operation");
      - it gives every parameter one shared 'step' tensor (line 825), which torch Adam would
        then increment once per parameter.
    So: no_grad, and a load hook on each torch Adam takes 'step' out of its state right after
    torch's own load_state_dict (before megatron's parameter loaders run); each parameter then
    gets its own step tensor back. Nothing of megatron is patched (STYLE.md rule 6).
    tests/test_train_checkpoint.py checks exact resumes at DP=2 -> 1 and TP=2."""
    steps, hooks = {}, []

    def take_steps(inner):
        for state in inner.state.values():
            if "step" in state:
                steps[id(state)] = state.pop("step")

    for inner in torch_adams(optimizer):
        hooks.append(inner.register_load_state_dict_post_hook(take_steps))
    try:
        with torch.no_grad():
            optimizer.load_state_dict(state_dict)
    finally:
        for hook in hooks:
            hook.remove()
    for inner in torch_adams(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if id(state) in steps:
                    state["step"] = _step_tensor(steps[id(state)], group, param)


def ensure_adam_state(optimizer):
    """Give torch Adam/AdamW (megatron's optimizer without TE/apex) zero state for every
    parameter that has none yet, exactly what Adam itself creates on its first step. Only where
    the state must exist (a checkpoint's save or load): it takes device memory."""
    for inner in torch_adams(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = _step_tensor(0, group, param)
                    for name in _moment_names(group):
                        state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)


def adam_state_to_come(optimizer):
    """[(param, name)] of the moments torch Adam/AdamW will create at its first step for the
    parameters that have no state yet (ensure_adam_state's zeros): each with its parameter's
    shape, dtype and device. What host buffers are sized by before the state exists."""
    return [
        (param, name)
        for inner in torch_adams(optimizer)
        for group in inner.param_groups
        for param in group["params"]
        if not inner.state.get(param)
        for name in _moment_names(group)
    ]


def _moment_names(group):
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def model_space_optimizer_state(optimizer, model_sharded_state_dict):
    """The distributed optimizer's sharded state dict in megatron's 'fully_reshardable' format
    (any-layout checkpoints), built without megatron's data-parallel gather where there is
    nothing to gather: one data-parallel rank holds every element of its parameters. Returns
    None where that does not hold (DP > 1, a chained or non-distributed optimizer, state that
    is not fp32): the caller then asks megatron.

    Why: megatron-core 0.16.1 builds this format through get_parameter_state_dp_zero, which
    copies all state into fresh CPU buffers, all-gathers them over DP (even a group of one) and
    concatenates: 6.6 of 8.3 s of a CPU save at 126M parameters (docs/checkpoints.md). Here each
    entry is a view of the live state in model shape, copied once, by the save's staging.
    Same keys, shapes, dtypes and replica ids as megatron's, so megatron's loader reads it
    (tests/test_train_checkpoint.py compares the two dicts tensor by tensor)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) != 1:  # megatron prefixes each member's keys (chained_{i}.): left to megatron
        return None
    optimizer = chained[0]  # megatron wraps even a single optimizer; that one passes straight through
    if (
        type(optimizer) not in (DistributedOptimizer, _listed_copies_class())
        or optimizer.data_parallel_group.size() != 1
        or not torch_adams(optimizer)
    ):
        return None
    ensure_adam_state(optimizer)
    model_entries, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sharded.data: sharded for sharded in nested_values(model_entries)}
    param_state = {}
    # megatron's order (sharded_param_state_fully_reshardable): buffers, then each buffer's
    # params; its loader pairs entries with parameters by this index
    for buffer in optimizer.buffers:
        for model_param in buffer.param_index_map:
            sharded = by_param[model_param]
            # private in megatron, but the one place that knows where a param's main copy and
            # Adam moments live (also for precision-aware optimizers)
            tensors = optimizer._get_main_param_and_optimizer_states(model_param)
            entry = {}
            for key in ("param", "exp_avg", "exp_avg_sq"):
                tensor = tensors[key].detach()
                if tensor.dtype != torch.float32 or tensor.numel() != model_param.numel():
                    return None  # not the plain fp32 whole-parameter state assumed here
                tensor = tensor.view(sharded.data.shape)  # (the param's local TP shard shape)
                fields = dict(key=f"optimizer.state.{key}.{sharded.key}", data=tensor, replica_id=sharded.replica_id)
                if not isinstance(sharded, ShardedTensorFactory):
                    fields["dtype"] = tensor.dtype
                entry[key] = replace(sharded, **fields)
                entry[key].validate_metadata_integrity()
            param_state[len(param_state)] = entry
    state_dict = optimizer.state_dict()  # param groups, step, grad scaler: no tensors of size
    state_dict.update(param_state=param_state, param_state_sharding_type="fully_reshardable")
    return state_dict
