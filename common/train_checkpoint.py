"""Training checkpoints (save_training_checkpoint / load_training_checkpoint): the full
state needed to resume a run exactly, written atomically. The model part is a model
checkpoint of common/checkpoint.py.

  ckpt_root/
    latest                  text: the name of the newest complete step directory
    step_000010/            written as step_000010.tmp, renamed once complete
      metadata.json, *.distcp, .metadata, common.pt   dist_checkpointing of
                            {"model": ..., "optimizer": <distributed optimizer state>}
      train_state.json      step, the script's `extra` (data position, ...), the LR
                            scheduler, the parallel layout it was written at
      rng/rank_00000.pt     per rank: python, numpy, torch (+CUDA) and megatron's
                            model-parallel RNG tracker states
      rl_meta.json, hf/     when the script passes meta (then merge_to_hf.py reads it too)
      critic/               one subdirectory per model of `extra_models` (train_ppo.py's
                            critic): its own dist_checkpointing of {"model", "optimizer"}
                            (a separate save: its sharded keys are the same as the policy's),
                            its scheduler in train_state.json under "extra_models"
      complete              written last: every file above with its size in bytes
"""
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from common.checkpoint import HF_DIR, load_into_chunks, model_sharded_state_dict, write_meta
from common.training import ensure_adam_state, load_optimizer_state


def barrier():
    if dist.is_initialized():
        dist.barrier()


LATEST_FILE = "latest"
COMPLETE_FILE = "complete"
TRAIN_STATE_FILE = "train_state.json"
RNG_DIR = "rng"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# How the distributed optimizer lays its state out on disk (megatron's names):
#   dp_reshardable    each DP rank writes its own flat shard of the optimizer buckets: no
#                     gather, fully parallel; resumable at another DP size but the same TP/PP.
#   fully_reshardable the state is gathered (in host memory, on every DP rank) and written per
#                     parameter in model shapes; resumable at any TP/PP/DP, costs host memory
#                     ~ 3 fp32 copies of this rank's TPxPP slice of the model during the save.
# megatron's default, fully_sharded_model_space (deprecated), fails in 0.16.1: it builds
# ShardedTensors with flattened_range, which ShardedTensor itself now rejects.
OPTIMIZER_SHARDINGS = ("dp_reshardable", "fully_reshardable")
_EXTRA_MODEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _check_extra_models(extra_models):
    """{name: (ddp_chunks, optimizer, scheduler)}: names become subdirectories of the step dir."""
    extra_models = dict(extra_models or {})
    for name in extra_models:
        if not _EXTRA_MODEL_NAME.match(name) or name in (RNG_DIR, HF_DIR):
            raise ValueError(f"extra model name {name!r}: use lowercase letters, digits, _ (not {RNG_DIR!r}/{HF_DIR!r})")
    return extra_models


def _save_model_and_optimizer(ckpt_dir, ddp_chunks, optimizer, optimizer_sharding):
    """One dist_checkpointing save of {"model", "optimizer"} into ckpt_dir (empty). Collective."""
    from megatron.core import dist_checkpointing

    ensure_adam_state(optimizer)  # DistributedOptimizer.state_dict() needs Adam state to exist
    model_sd = model_sharded_state_dict(ddp_chunks)
    optim_sd = optimizer.sharded_state_dict(
        model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": optimizer_sharding})
    dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, ckpt_dir)


def _load_model_and_optimizer(ckpt_dir, ddp_chunks, optimizer, optimizer_sharding):
    """Inverse of _save_model_and_optimizer, into the live objects. Collective."""
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": optimizer_sharding}  # as it was written
    # A fresh torch Adam has no state until its first step; megatron's DistributedOptimizer
    # reads it while building the sharded state dict for loading, so create zeros to load into.
    ensure_adam_state(optimizer)
    model_sd = model_sharded_state_dict(ddp_chunks)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, ckpt_dir)
    load_into_chunks(ddp_chunks, loaded["model"])
    # Also sets the fp32 main params (the exact master weights of a bf16 model) and Adam moments.
    load_optimizer_state(optimizer, loaded["optimizer"])


def _load_scheduler(scheduler, state):
    if scheduler is not None and state is not None:
        scheduler.num_steps = 0  # load_state_dict *adds* the saved steps to num_steps
        scheduler.load_state_dict(state)


def save_training_checkpoint(ckpt_root, step, ddp_chunks, optimizer, scheduler, extra=None, *,
                             keep_last=2, meta=None, hf_source_dir=None,
                             optimizer_sharding="dp_reshardable", extra_models=None):
    """Save everything needed to resume at `step` into ckpt_root/step_{step:06d}. All ranks call this.

    extra: JSON-able dict the script wants back on resume (data position, best reward, ...).
    extra_models: {name: (ddp_chunks, optimizer, scheduler)} of further trained models (the
    PPO critic), each saved into the subdirectory `name` of the same step directory, before
    the one complete marker: the step is complete with all its models or not at all.
    meta/hf_source_dir: when given, rl_meta.json and hf/ as in write_meta (merge_to_hf.py can
    then convert the step directory). keep_last: older step directories beyond the newest
    keep_last complete ones are deleted (never the one just written; newer ones are left alone).
    Returns the step directory. On return every rank sees it complete and `latest` names it.
    """
    if optimizer_sharding not in OPTIMIZER_SHARDINGS:
        raise ValueError(f"optimizer_sharding must be one of {OPTIMIZER_SHARDINGS}, not {optimizer_sharding!r}")
    extra_models = _check_extra_models(extra_models)
    extra = dict(extra or {})
    json.dumps(extra)  # not JSON-able -> TypeError on every rank, before any collective
    rank = dist.get_rank()
    rng_state = _rng_state()  # first, so nothing below can advance a generator before it is saved
    name = f"step_{step:06d}"
    final_dir = os.path.join(ckpt_root, name)
    tmp_dir = final_dir + ".tmp"
    if rank == 0:
        if os.path.exists(tmp_dir):  # left by an interrupted save of this same step
            shutil.rmtree(tmp_dir)
        os.makedirs(tmp_dir)  # empty: dist_checkpointing warns about a non-empty directory
    barrier()

    _save_model_and_optimizer(tmp_dir, ddp_chunks, optimizer, optimizer_sharding)  # collective
    # Each further model in its own empty subdirectory, by its own save: one save of both
    # would collide (the critic's sharded keys, decoder.layers.0..., are the policy's).
    for model_name, (chunks, model_optimizer, _) in extra_models.items():
        if rank == 0:
            os.makedirs(os.path.join(tmp_dir, model_name))
        barrier()
        _save_model_and_optimizer(os.path.join(tmp_dir, model_name), chunks, model_optimizer, optimizer_sharding)

    os.makedirs(os.path.join(tmp_dir, RNG_DIR), exist_ok=True)
    torch.save(rng_state, os.path.join(tmp_dir, RNG_DIR, f"rank_{rank:05d}.pt"))
    if rank == 0:
        _write_atomic(os.path.join(tmp_dir, TRAIN_STATE_FILE), json.dumps({
            "step": step, "extra": extra, "optimizer_sharding": optimizer_sharding,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra_models": {model_name: {"scheduler": s.state_dict() if s is not None else None}
                             for model_name, (_, _, s) in extra_models.items()},
            "layout": _layout()}, indent=1))
        if meta is not None:
            write_meta(tmp_dir, meta, hf_source_dir)
    barrier()  # every rank's files are on disk

    if rank == 0:
        # The marker lists every file with its size, so a deleted or truncated file (a crash
        # mid-write, a full disk, a careless rm) is caught before loading.
        files = {}
        for dirpath, _, filenames in os.walk(tmp_dir):
            for filename in filenames:
                path = os.path.join(dirpath, filename)
                files[os.path.relpath(path, tmp_dir)] = os.path.getsize(path)
        _write_atomic(os.path.join(tmp_dir, COMPLETE_FILE), json.dumps({"step": step, "files": files}, indent=1))
        if os.path.exists(final_dir):  # e.g. a damaged step_N we fell back from, now redone
            shutil.rmtree(final_dir)
        os.rename(tmp_dir, final_dir)
        _write_atomic(os.path.join(ckpt_root, LATEST_FILE), name + "\n")
        _prune(ckpt_root, step, keep_last)
    barrier()
    return final_dir


def load_training_checkpoint(ckpt_root, ddp_chunks, optimizer, scheduler, *, extra_models=None):
    """Resume from the newest usable checkpoint in ckpt_root. All ranks call this, after
    setup_training and before the first step.

    Restores model, optimizer, scheduler and RNG states, and those of every model of
    extra_models ({name: (ddp_chunks, optimizer, scheduler)}, as given to the save);
    returns the `extra` dict given to save_training_checkpoint, or None when ckpt_root
    holds no checkpoint (a fresh run).
    A damaged newest checkpoint (no complete marker, a file missing or truncated, a
    requested extra model missing, the load failing) is reported and the previous one is
    used; if none is usable this raises.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    extra_models = _check_extra_models(extra_models)
    rank = dist.get_rank()
    candidates = _broadcast_from_rank0(_candidates(ckpt_root) if rank == 0 else None)
    if not candidates:
        return None
    rejected = []
    for name in candidates:
        step_dir = os.path.join(ckpt_root, name)
        # Rank 0 decides, everyone follows: a half-written directory on a network
        # filesystem may look different from different nodes.
        problem = _broadcast_from_rank0(check_step_dir(step_dir, extra_models=list(extra_models))
                                        if rank == 0 else None)
        if problem is None:
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
                print(f"[checkpoint] resumed from {step_dir} instead of the newer damaged checkpoint(s)",
                      flush=True)
            return extra
        rejected.append(f"{step_dir}: {problem}")
        if rank == 0:
            print(f"[checkpoint] WARNING: skipping damaged checkpoint {step_dir}: {problem}", flush=True)
    raise RuntimeError(f"no usable training checkpoint in {ckpt_root}; refusing to start from scratch "
                       "or from garbage. Tried:\n  " + "\n  ".join(rejected) +
                       "\nMove the directory away to start a new run.")


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
        _load_model_and_optimizer(os.path.join(step_dir, model_name), chunks, model_optimizer,
                                  state["optimizer_sharding"])
        _load_scheduler(model_scheduler, saved_models[model_name]["scheduler"])
    _restore_rng(step_dir, state["layout"])  # last: nothing after it may draw random numbers
    return state["extra"]


def _candidates(ckpt_root):
    """Step directory names to try, preferred first: the one `latest` names, then older ones.

    Directories newer than `latest` were never published (crash between rename and update of
    `latest`, or a timeline we fell back from) and *.tmp directories are interrupted saves:
    both are ignored."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = {}
    for entry in os.listdir(ckpt_root):
        match = _STEP_DIR.match(entry)
        if match and os.path.isdir(os.path.join(ckpt_root, entry)):
            steps[entry] = int(match.group(1))
    newest_first = sorted(steps, key=steps.get, reverse=True)
    latest_path = os.path.join(ckpt_root, LATEST_FILE)
    if not os.path.isfile(latest_path):
        if newest_first:
            print(f"[checkpoint] WARNING: {latest_path} is missing; trying the step directories newest first",
                  flush=True)
        return newest_first
    with open(latest_path) as f:
        latest = f.read().strip()
    match = _STEP_DIR.match(latest)
    if not match:
        print(f"[checkpoint] WARNING: {latest_path} holds {latest[:80]!r}, not a step directory name; "
              "trying the step directories newest first", flush=True)
        return newest_first
    return [latest] + [name for name in newest_first if steps[name] < int(match.group(1))]


def check_step_dir(step_dir, extra_models=()):
    """None if step_dir looks complete (with the subdirectories of the named extra models),
    else why not (cheap: sizes, not checksums)."""
    if not os.path.isdir(step_dir):
        return "the directory does not exist"
    marker = os.path.join(step_dir, COMPLETE_FILE)
    if not os.path.isfile(marker):
        return f"no '{COMPLETE_FILE}' marker (the save did not finish)"
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable '{COMPLETE_FILE}' marker ({e})"
    for required in ("metadata.json", TRAIN_STATE_FILE) + tuple(f"{name}/metadata.json" for name in extra_models):
        if required not in files:
            return f"{required} was never written"
    for relpath, size in files.items():
        path = os.path.join(step_dir, relpath)
        if not os.path.isfile(path):
            return f"{relpath} is missing"
        if os.path.getsize(path) != size:
            return f"{relpath} has {os.path.getsize(path)} bytes, {size} were written (truncated?)"
    return None


def _prune(ckpt_root, step, keep_last):
    """Rank 0, after a save: keep the newest keep_last complete step dirs up to `step`; delete
    older ones (and older damaged ones) and interrupted saves (*.tmp; none is in flight now)."""
    older = []
    for entry in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, entry)
        if entry.endswith(".tmp") and _STEP_DIR.match(entry[:-4]) and os.path.isdir(path):
            shutil.rmtree(path)
        elif _STEP_DIR.match(entry) and int(entry[5:]) < step:
            older.append((int(entry[5:]), entry))
    keep = max(keep_last, 1) - 1  # the one just written counts
    for _, entry in sorted(older, reverse=True):
        path = os.path.join(ckpt_root, entry)
        if keep > 0 and check_step_dir(path) is None:
            keep -= 1
        else:
            shutil.rmtree(path)


# --- RNG ----------------------------------------------------------------------------------
def _layout():
    from megatron.core import parallel_state as mpu

    return {"world_size": dist.get_world_size(), "tp": mpu.get_tensor_model_parallel_world_size(),
            "pp": mpu.get_pipeline_model_parallel_world_size(), "cp": mpu.get_context_parallel_world_size(),
            "ep": mpu.get_expert_model_parallel_world_size(), "dp": mpu.get_data_parallel_world_size()}


def _rng_coordinates():
    """What megatron's RNG tracker seeds depend on (tensor_parallel/random.py)."""
    from megatron.core import parallel_state as mpu

    return {"tp": mpu.get_tensor_model_parallel_world_size(), "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "ep": mpu.get_expert_model_parallel_world_size(), "ep_rank": mpu.get_expert_model_parallel_rank()}


def _rng_state():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
        "coordinates": _rng_coordinates(),
    }


def _restore_rng(step_dir, saved_layout):
    """Each rank restores the RNG states its own rank saved. If the layout changed, every rank
    takes the global generators (python/numpy/torch/CUDA) of one saved rank -- our scripts seed
    all ranks alike, so these are the same on every rank -- and megatron's tracker (TP-rank
    dependent dropout streams) only from a saved rank with the same TP/EP coordinates."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    rank, layout, coordinates = dist.get_rank(), _layout(), _rng_coordinates()
    if saved_layout == layout:
        source = rank
    else:  # megatron's default rank order puts TP innermost: saved rank t has tp_rank t
        source = coordinates["tp_rank"] if saved_layout["tp"] == layout["tp"] else 0
    state = torch.load(os.path.join(step_dir, RNG_DIR, f"rank_{source:05d}.pt"), weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tracker_restored = state["coordinates"] == coordinates
    if tracker_restored:
        get_cuda_rng_tracker().set_states(state["tracker"])
    if saved_layout != layout and rank == 0:
        print(f"[checkpoint] saved at {saved_layout}, resuming at {layout}: python/numpy/torch RNG states "
              f"taken from saved rank {source}; megatron's model-parallel RNG tracker "
              f"{'restored' if tracker_restored else 'NOT restored (TP/EP changed), kept freshly seeded'}",
              flush=True)


def _broadcast_from_rank0(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_atomic(path, text):
    """Readers see the old file or the new one, never half of one (rename is atomic on POSIX)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
