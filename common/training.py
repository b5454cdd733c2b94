"""Training wrappers for model chunks: megatron DDP (+ distributed optimizer), Adam and an LR schedule.

  ddp_chunks, optimizer, scheduler = setup_training(chunks, lr=..., ...)
  torch_adams(optimizer)   the torch Adam instances inside
  ensure_adam_state / load_optimizer_state   megatron's torch-Adam path, made loadable
                                             (common/train_checkpoint.py uses them)

Kept apart from common/model.py, which builds the model and moves weights (HF <-> megatron).
"""
import torch

from common.model import unwrap


def setup_training(chunks, *, lr, min_lr=0.0, weight_decay=0.0, adam_betas=(0.9, 0.999), adam_eps=1e-8,
                   clip_grad=1.0, warmup_steps=0, total_steps=1, decay_style="constant",
                   use_distributed_optimizer=True, overlap_grad_reduce=False):
    """Wrap model chunks for training. Returns (ddp_chunks, optimizer, scheduler).

    - megatron DDP: gradients reduced over the data-parallel group into fp32 buffers;
      by default DDP *averages* gradients over DP ranks (loss per rank is a local mean).
    - megatron's optimizer: Adam with fp32 main params for bf16 models, grad clipping
      (clip_grad = max global grad norm), sharded over DP when use_distributed_optimizer.
    - OptimizerParamScheduler: linear warmup over warmup_steps, then decay_style
      ("constant", "linear", "cosine") from lr to min_lr at total_steps. One scheduler
      step per optimizer step.
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
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # the pipeline schedule calls these: grad all-reduce (DP, tied embeddings, SP norms) ...
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    config.grad_scale_func = None
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
            adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_eps=adam_eps,
            clip_grad=clip_grad, bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        ddp_chunks,
    )
    # Without TE/apex megatron falls back to torch.optim.AdamW in its default multi-tensor
    # (foreach) mode: ~10 passes over the fp32 params and moments per step. torch's fused
    # kernel makes one (docs/benchmarks.md). Set before the first step, which creates the
    # step counters (on the device for fused).
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            group.update(fused=True, foreach=False)
        adam.defaults.update(fused=True, foreach=False)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(total_steps, warmup_steps + 1),
        lr_decay_style=decay_style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant",
    )
    return ddp_chunks, optimizer, scheduler


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
    parameter that has none yet, exactly what Adam itself creates on its first step."""
    for inner in torch_adams(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = _step_tensor(0, group, param)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
