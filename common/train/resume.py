"""The load side of training checkpoints (common/train/save.py writes them): the newest
usable step directory of a checkpoint root into the live model, optimizer, scheduler and RNGs,
at any layout the optimizer state allows, falling back past damaged checkpoints, never past
one that is good but of another layout (a clear refusal instead).

  extra = load_training_checkpoint(ckpt_root, ddp_chunks, optimizer, scheduler)   # --resume
  changed_flags(extra["flags"], flags_now, step)    one line per schedule flag given a new value
  check_step_dir(step_dir)                          None, or why step_dir is not complete

The learning-rate schedule takes only its position (the optimizer steps taken) from the
checkpoint: its shape (peak and final LR, warmup, decay style and length, weight decay) is
this run's flags, so a --lr or --steps given at --resume applies from the resumed step on.
"""

import json
import os

import torch
import torch.distributed as dist

from common.train import checkpoint_dirs
from common.train.checkpoint import load_into_chunks, model_sharded_state_dict
from common.train.guard import UsageError
from common.train.save import (
    DP_RESHARDABLE_FIXED,
    RNG_DIR,
    TRAIN_STATE_FILE,
    broadcast_from_rank0,
    check_extra_models,
    is_distributed_optimizer,
    optimizer_metadata,
    run_layout,
)
from common.train.setup import ensure_adam_state, load_optimizer_state


def load_training_checkpoint(ckpt_root, ddp_chunks, optimizer, scheduler, *, extra_models=None):
    """Resume from the newest usable checkpoint in ckpt_root. All ranks call this, after
    setup_training and before the first step.

    Restores model, optimizer, scheduler and RNG states, and those of every model of
    extra_models ({name: (ddp_chunks, optimizer, scheduler)}, as given to the save);
    returns the `extra` dict given to save_training_checkpoint, or None when ckpt_root
    holds no checkpoint (a fresh run). Any TP/PP/VPP/EP/DP layout loads a fully_reshardable
    or plain-optimizer checkpoint; a dp_reshardable one at another TP/PP/VPP/EP (or layers per
    pipeline stage), or one of the other optimizer kind, is refused (RuntimeError saying what
    to do), never skipped.
    A damaged newest checkpoint (no complete marker, a file missing or truncated, a
    requested extra model missing, the load failing) is reported and the previous one is
    used; if none is usable this raises.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    extra_models = check_extra_models(extra_models)
    rank = dist.get_rank()
    candidates = broadcast_from_rank0(checkpoint_dirs.candidates(ckpt_root) if rank == 0 else None)
    if not candidates:
        return None
    rejected = []
    for name in candidates:
        step_dir = os.path.join(ckpt_root, name)
        # Rank 0 decides, everyone follows: a half-written directory on a network
        # filesystem may look different from different nodes.
        problem = broadcast_from_rank0(check_step_dir(step_dir, extra_models=list(extra_models)) if rank == 0 else None)
        if problem is None:
            refusal = broadcast_from_rank0(_layout_refusal(step_dir, ddp_chunks) if rank == 0 else None)
            if refusal is not None:  # a good checkpoint, not for this run: never fall back past it
                raise UsageError(refusal)
            try:
                extra = _load_step_dir(step_dir, ddp_chunks, optimizer, scheduler, extra_models)
            # any failure means: not this checkpoint. torch's CheckpointException (a BaseException)
            # is how DCP reports a read error of any rank on all ranks.
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                detail = (str(e).strip().splitlines() or [""])[-1][:300]  # DCP's message ends in the cause
                problem = f"loading failed on rank {rank}: {type(e).__name__}: {detail}"
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p is not None), None)
        if problem is None:
            if rejected and rank == 0:
                print(f"[checkpoint] resumed from {step_dir} instead of the newer damaged checkpoint(s)", flush=True)
            return extra
        rejected.append(f"{step_dir}: {problem}")
        if rank == 0:
            print(f"[checkpoint] WARNING: skipping damaged checkpoint {step_dir}: {problem}", flush=True)
    raise UsageError(
        f"no usable training checkpoint in {ckpt_root}; refusing to start from scratch "
        "or from garbage. Tried:\n  " + "\n  ".join(rejected) + "\nMove the directory away to start a new run."
    )


def _describe(layout):
    stages = layout.get("stage_layers") or []
    return (
        " ".join(f"{key.upper()}={layout.get(key) or 1}" for key in ("tp", "pp", "vpp", "ep", "cp", "dp"))
        + f" ({layout['world_size']} ranks)"
        + (f", layers per stage {stages}" if len(stages) > 1 else "")
    )


def _layout_refusal(step_dir, ddp_chunks):
    """Why the (complete) checkpoint step_dir cannot be loaded by this run, or None."""
    try:
        with open(os.path.join(step_dir, TRAIN_STATE_FILE)) as f:
            state = json.load(f)
        saved, sharding = state["layout"], state["optimizer_sharding"]
    except (OSError, ValueError, KeyError):
        return None  # unreadable: the load fails and calls it damaged
    current, distributed = run_layout(ddp_chunks), is_distributed_optimizer(ddp_chunks)
    saved_distributed = state.get("distributed_optimizer", distributed)  # not recorded before 2026-11
    if saved_distributed != distributed:
        kinds = {True: "the distributed optimizer", False: "a plain optimizer (--no-distributed-optimizer)"}
        return (
            f"{step_dir} was written with {kinds[saved_distributed]}; this run uses {kinds[distributed]}. "
            "Their optimizer states are stored differently: resume with the optimizer kind it was "
            "written with."
        )
    moved = any(saved.get(key, current[key]) != current[key] for key in DP_RESHARDABLE_FIXED)
    if distributed and sharding == "dp_reshardable" and moved:
        return (
            f"{step_dir} holds distributed-optimizer state in optimizer_sharding='dp_reshardable', "
            "which only loads at the TP/PP/VPP/EP and layers per pipeline stage it was written at: "
            f"saved at {_describe(saved)}, this "
            f"run is at {_describe(current)}. Resume at the saved layout (DP may differ), or resume "
            "there once and save with optimizer_sharding='fully_reshardable' (the scripts' default "
            "--save-any-layout), which loads at any layout."
        )
    return None


def _load_step_dir(step_dir, ddp_chunks, optimizer, scheduler, extra_models):
    """Load one step directory into the live objects; returns its extra dict."""
    with open(os.path.join(step_dir, TRAIN_STATE_FILE)) as f:
        state = json.load(f)
    saved_models = state.get("extra_models", {})
    missing = sorted(set(extra_models) - set(saved_models))
    if missing:  # before touching any live object
        raise RuntimeError(f"the checkpoint has no {', '.join(missing)} (saved: {sorted(saved_models) or 'none'})")
    _load_model_and_optimizer(step_dir, ddp_chunks, optimizer, state["optimizer_sharding"])  # collective
    _load_scheduler(scheduler, state["scheduler"])
    for model_name, (chunks, model_optimizer, model_scheduler) in extra_models.items():
        _load_model_and_optimizer(
            os.path.join(step_dir, model_name), chunks, model_optimizer, state["optimizer_sharding"]
        )
        _load_scheduler(model_scheduler, saved_models[model_name]["scheduler"])
    _restore_rng(step_dir, state["layout"])  # last: nothing after it may draw random numbers
    return state["extra"]


def check_step_dir(step_dir, extra_models=()):
    """None if step_dir looks complete (with the subdirectories of the named extra models),
    else why not (cheap: sizes, not checksums)."""
    required = ("metadata.json", TRAIN_STATE_FILE) + tuple(f"{name}/metadata.json" for name in extra_models)
    return checkpoint_dirs.check_step_dir(step_dir, required)


def _load_model_and_optimizer(ckpt_dir, ddp_chunks, optimizer, optimizer_sharding):
    """Inverse of train_checkpoint._start_model_save, into the live objects. Collective. The
    param groups keep this run's peak and final LR (megatron's max_lr/min_lr, which the
    scheduler reads from them), not the checkpoint's."""
    from megatron.core import dist_checkpointing

    schedule = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]

    # A fresh torch Adam has no state until its first step; megatron's DistributedOptimizer
    # reads it while building the sharded state dict for loading, so create zeros to load into.
    ensure_adam_state(optimizer)
    model_sd = model_sharded_state_dict(ddp_chunks)
    optim_sd = optimizer.sharded_state_dict(
        model_sd,
        is_loading=True,  # as it was written
        metadata=optimizer_metadata(ddp_chunks, optimizer_sharding),
    )
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, ckpt_dir)
    load_into_chunks(ddp_chunks, loaded["model"])
    # Also sets the fp32 main params (the exact master weights of a bf16 model) and Adam moments.
    load_optimizer_state(optimizer, loaded["optimizer"])
    for group, values in zip(optimizer.param_groups, schedule, strict=True):
        group.update(values)


def _load_scheduler(scheduler, state):
    """The saved position of the schedule into the live scheduler, which keeps this run's values
    (megatron's override_opt_param_scheduler: otherwise its load_state_dict takes the
    checkpoint's LR, warmup, decay length and style over the ones the run was started with)."""
    if scheduler is not None and state is not None:
        scheduler.num_steps = 0  # load_state_dict *adds* the saved steps to num_steps
        override = scheduler.override_opt_param_scheduler
        scheduler.override_opt_param_scheduler = True
        try:
            scheduler.load_state_dict(state)  # (also sets every param group's lr for the new position)
        finally:
            scheduler.override_opt_param_scheduler = override


def changed_flags(saved, now, step):
    """One line per flag of `now` ({"--lr": 1e-6, ...}) whose value differs from `saved` (the same
    dict as the checkpoint recorded it; flags it lacks are not compared), resuming after `step`."""
    lines = []
    for flag, value in now.items():
        if flag not in saved or saved[flag] == value:
            continue
        if flag == "--steps" and value <= step:
            lines.append(
                f"{flag} {value} (checkpoint: {saved[flag]}): the checkpoint is at step {step}, nothing to train"
            )
        else:
            lines.append(f"{flag} {value} (checkpoint: {saved[flag]}): the new value applies from step {step + 1}")
    return lines


# --- RNG ------------------------------------------------------------------------------------
def _same_layout(saved, current):
    return all(saved.get(key, value) == value for key, value in current.items())  # vpp: recorded since 2026-11


def _restore_rng(step_dir, saved_layout):
    """Each rank restores the RNG states its own rank saved. If the layout changed, every rank
    takes the global generators (python/numpy/torch/CUDA) of one saved rank -- our scripts seed
    all ranks alike, so these are the same on every rank -- and megatron's tracker (TP-rank
    dependent dropout streams) only from a saved rank with the same TP/EP coordinates."""
    from megatron.core import parallel_state as mpu

    rank, layout, same = dist.get_rank(), run_layout(), _same_layout(saved_layout, run_layout())
    # megatron's default rank order puts TP innermost: saved rank t has tp_rank t
    source = rank if same else mpu.get_tensor_model_parallel_rank() if saved_layout["tp"] == layout["tp"] else 0
    state = torch.load(os.path.join(step_dir, RNG_DIR, f"rank_{source:05d}.pt"), weights_only=False)
    tracker_restored = checkpoint_dirs.set_rng_state(state)
    if not same and rank == 0:
        print(
            f"[checkpoint] saved at {_describe(saved_layout)}, resuming at {_describe(layout)}: "
            f"python/numpy/torch RNG states taken from saved rank {source}; megatron's model-parallel RNG "
            f"tracker {'restored' if tracker_restored else 'NOT restored (TP/EP changed), kept freshly seeded'}",
            flush=True,
        )
