"""Training checkpoints: the full state needed to resume a run exactly, written atomically,
resumable at any TP/PP/DP layout, optionally written in the background.

  save_training_checkpoint(ckpt_root, step, ...)   synchronous, returns the step directory
  writer = CheckpointWriter()                      in the background (see the class):
      writer.save(ckpt_root, step, ...)            blocks for checks, planning, host copies
      writer.poll()                                every step, all ranks: publishes it
      writer.wait()                                before exit: waits for the last save
  load_training_checkpoint(ckpt_root, ...)         the newest usable checkpoint -> live objects
                                                   (common/train/resume.py: the load side)

  ckpt_root/
    latest                  text: the name of the newest complete step directory
    step_000010/            written as step_000010.tmp, renamed once complete
      metadata.json, *.distcp, .metadata, common.pt   dist_checkpointing of
                            {"model": ..., "optimizer": <megatron optimizer state>}
      train_state.json      step, the script's `extra` (data position, ...), the LR scheduler,
                            the parallel layout and optimizer kind it was written with
      rng/rank_00000.pt     per rank: python, numpy, torch (+CUDA) and megatron's
                            model-parallel RNG tracker states
      rl_meta.json, hf/     when the script passes meta (then merge_to_hf.py reads it too)
      critic/               one subdirectory per model of `extra_models` (train_ppo.py's
                            critic): its own dist_checkpointing of {"model", "optimizer"}
                            (a separate save: its sharded keys are the same as the policy's),
                            its scheduler in train_state.json under "extra_models"
      complete              written last: every file above with its size in bytes
The model part is a model checkpoint of common/train/checkpoint.py; the writing (background
threads) is in common/train/checkpoint_io.py, the step-directory protocol in common/train/checkpoint_dirs.py.
"""

import json
import os
import re
import shutil
import time

import torch
import torch.distributed as dist

from common.model.bridge import stage_layers
from common.model.chunks import named_global_parameters, unwrap
from common.model.lora import is_adapter, lora_modules
from common.train import checkpoint_dirs, checkpoint_io
from common.train.checkpoint import HF_DIR, model_sharded_state_dict, write_meta
from common.train.host_pool import HostPool
from common.train.setup import adam_state_to_come, ensure_adam_state, model_space_optimizer_state, torch_adams

TRAIN_STATE_FILE = "train_state.json"
RNG_DIR = "rng"
# How the distributed optimizer lays its state out on disk (megatron's names):
#   fully_reshardable (default) gathered over the DP group (inside save()'s blocking part) and
#     written per parameter in model shapes, as a plain optimizer's: loads at any TP/PP/VPP/EP/DP.
#     At DP=1 there is nothing to gather: common/training.model_space_optimizer_state builds
#     the same entries as views of the live state (no gather, no extra copy).
#     Cost at DP>1 (megatron's gather): every DP rank builds fp32 main param + exp_avg + exp_avg_sq of its
#     whole TPxPP slice in host memory (12 bytes/param, megatron's get_parameter_state_dp_zero) plus copies.
#     Measured (CPU, fp32 57M-param model, DP=2; docs/checkpoints.md): peak extra host memory
#     1.7 GB per rank (~30 B/param) vs 0.14-0.22 GB for dp_reshardable; save() blocking
#     3.0-4.1 s vs 0.5-1.9 s. Qwen2-1.5B at TP=PP=1: >= 18 GB per DP rank, 8 ranks on a node.
#   dp_reshardable: each DP rank writes its own flat shard of the optimizer buckets: no gather,
#     no copy beyond the staging; loads at another DP size but only at the same TP/PP/VPP/EP
#     (refused otherwise, naming both layouts). The choice for frequent background saves.
# A plain (non-distributed) optimizer keeps per-parameter state: any layout, either way.
# megatron's own default, fully_sharded_model_space (deprecated), fails in 0.16.1: it builds
# ShardedTensors with flattened_range, which ShardedTensor itself now rejects.
# Room in the staging's own buffer beyond the training tensors for what megatron makes at a save
# (dp_reshardable's padding between parameters: < 1 KB per parameter).
STAGING_SLACK = 16 << 20
OPTIMIZER_SHARDINGS = ("fully_reshardable", "dp_reshardable")
DEFAULT_OPTIMIZER_SHARDING = "fully_reshardable"
_EXTRA_MODEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# what dp_reshardable optimizer state depends on (the distributed optimizer's flat buffers)
DP_RESHARDABLE_FIXED = ("tp", "pp", "vpp", "ep", "stage_layers")


def check_extra_models(extra_models):
    """{name: (ddp_chunks, optimizer, scheduler)}: names become subdirectories of the step dir."""
    extra_models = dict(extra_models or {})
    for name in extra_models:
        if not _EXTRA_MODEL_NAME.match(name) or name in (RNG_DIR, HF_DIR):
            raise ValueError(
                f"extra model name {name!r}: use lowercase letters, digits, _ (not {RNG_DIR!r}/{HF_DIR!r})"
            )
    return extra_models


def is_distributed_optimizer(ddp_chunks):
    return bool(ddp_chunks[0].ddp_config.use_distributed_optimizer)


def optimizer_metadata(ddp_chunks, optimizer_sharding):
    # only the distributed optimizer reads it; a plain one keeps per-parameter state regardless
    return {"distrib_optim_sharding_type": optimizer_sharding} if is_distributed_optimizer(ddp_chunks) else None


def _training_tensors(ddp_chunks, optimizer):
    """(name, tensor) of this rank's model weights and the optimizer's fp32 main params, and
    all tensors of the live training state (for checkpoint_io.live_storages)."""
    lora = bool(lora_modules(ddp_chunks))  # a LoRA checkpoint holds the adapters, not the frozen base
    named = [
        (name, p) for chunk in ddp_chunks for name, p in named_global_parameters(chunk) if not lora or is_adapter(name)
    ]
    live = [p for _, p in named]
    # + the modules' buffers that training changes in place (DeepSeek-V3's router bias after each
    # step): on a CPU a save writes them from the live tensor in the background, so they are cloned too
    live += [b for chunk in ddp_chunks for b in unwrap(chunk).buffers() if b.dim() > 0]
    for adam in torch_adams(optimizer):
        for group_index, group in enumerate(adam.param_groups):
            for index, main in enumerate(group["params"]):
                named.append((f"optimizer main param {group_index}.{index} {tuple(main.shape)}", main))
                live += [main] + [v for v in adam.state.get(main, {}).values() if torch.is_tensor(v)]
    return named, live


def _optimizer_sharded_state_dict(ddp_chunks, optimizer, model_sd, optimizer_sharding):
    ensure_adam_state(optimizer)  # DistributedOptimizer.state_dict() needs Adam state to exist
    if optimizer_sharding == "fully_reshardable":
        own = model_space_optimizer_state(optimizer, model_sd)  # None where megatron must gather
        if own is not None:
            return own
    return optimizer.sharded_state_dict(
        model_sd, is_loading=False, metadata=optimizer_metadata(ddp_chunks, optimizer_sharding)
    )


def _start_model_save(ckpt_dir, ddp_chunks, optimizer, optimizer_sharding, background, staging=None):
    """Plan one dist_checkpointing save of {"model", "optimizer"} into ckpt_dir (empty) and start
    writing it. Collective; returns a checkpoint_io.PendingWrite."""
    from megatron.core import parallel_state as mpu

    model_sd = model_sharded_state_dict(ddp_chunks)
    optim_sd = _optimizer_sharded_state_dict(ddp_chunks, optimizer, model_sd, optimizer_sharding)
    _, live = _training_tensors(ddp_chunks, optimizer)
    return checkpoint_io.start_save(
        {"model": model_sd, "optimizer": optim_sd},
        ckpt_dir,
        background=background,
        live=checkpoint_io.live_storages(live) if background else (),
        parallel_group=mpu.get_data_parallel_group(with_context_parallel=True),
        staging=staging,
    )


# --- save ---------------------------------------------------------------------------------
class _PendingSave:
    """A training checkpoint between its start and its publication (rename + `latest`)."""

    def __init__(self, ckpt_root, step, keep_last):
        self.step, self.keep_last, self.writes, self.started = step, keep_last, [], time.perf_counter()
        self.final_dir = os.path.join(ckpt_root, f"step_{step:06d}")
        self.tmp_dir = self.final_dir + ".tmp"


def _start_save(
    ckpt_root,
    step,
    ddp_chunks,
    optimizer,
    scheduler,
    extra,
    *,
    keep_last,
    meta,
    hf_source_dir,
    optimizer_sharding,
    extra_models,
    background,
    staging=None,
    before_model=None,
):
    """Everything of a save up to the writing of the tensor files (started, or done when not
    background). Collective. before_model(name): called before each model's part ("" the policy,
    then extra_models' names), e.g. to bring that model's optimizer state onto the GPU."""
    if optimizer_sharding not in OPTIMIZER_SHARDINGS:
        raise ValueError(f"optimizer_sharding must be one of {OPTIMIZER_SHARDINGS}, not {optimizer_sharding!r}")
    extra_models = check_extra_models(extra_models)
    extra = dict(extra or {})
    json.dumps(extra)  # not JSON-able -> TypeError on every rank, before any collective
    rank = dist.get_rank()
    rng_state = checkpoint_dirs.rng_state()  # first: nothing below may advance a generator before
    models = {"": (ddp_chunks, optimizer, scheduler), **extra_models}  # "": the step directory itself

    def check_finite(model_name):  # a diverged run must not overwrite good checkpoints with NaNs (keep_last)
        chunks, opt, _ = models[model_name]
        named = [(f"{model_name}/{name}" if model_name else name, t) for name, t in _training_tensors(chunks, opt)[0]]
        checkpoint_io.check_finite(named, f"the training checkpoint of step {step}")  # collective

    if before_model is None:  # every model on the device: all checked before anything is written
        for model_name in models:
            check_finite(model_name)
    save = _PendingSave(ckpt_root, step, keep_last)
    if rank == 0:
        if os.path.exists(save.tmp_dir):  # left by an interrupted save of this same step
            shutil.rmtree(save.tmp_dir)
        os.makedirs(save.tmp_dir)  # empty: dist_checkpointing warns about a non-empty directory
    dist.barrier()

    # Each further model in its own subdirectory, by its own save: one save of both would
    # collide (the critic's sharded keys, decoder.layers.0..., are the policy's).
    for model_name, (chunks, model_optimizer, _) in models.items():
        if before_model is not None:
            before_model(model_name)
            check_finite(model_name)
        if model_name:
            if rank == 0:
                os.makedirs(os.path.join(save.tmp_dir, model_name))
            dist.barrier()
        save.writes.append(
            _start_model_save(
                os.path.join(save.tmp_dir, model_name), chunks, model_optimizer, optimizer_sharding, background, staging
            )
        )  # collective
    os.makedirs(os.path.join(save.tmp_dir, RNG_DIR), exist_ok=True)
    torch.save(rng_state, os.path.join(save.tmp_dir, RNG_DIR, f"rank_{rank:05d}.pt"))
    if rank == 0:
        checkpoint_dirs.write_atomic(
            os.path.join(save.tmp_dir, TRAIN_STATE_FILE),
            json.dumps(
                {
                    "step": step,
                    "extra": extra,
                    "optimizer_sharding": optimizer_sharding,
                    "distributed_optimizer": is_distributed_optimizer(ddp_chunks),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "extra_models": {
                        model_name: {"scheduler": s.state_dict() if s is not None else None}
                        for model_name, (_, _, s) in extra_models.items()
                    },
                    "layout": run_layout(ddp_chunks),
                },
                indent=1,
            ),
        )
        if meta is not None:
            write_meta(save.tmp_dir, meta, hf_source_dir)
    return save


def _publish(save):
    """Finalize the tensor files (rank 0 writes their metadata), then publish the step
    directory (marker, rename, `latest`, pruning). Collective, once every rank's files are
    written; raises on every rank if any rank failed."""
    checkpoint_io.finish(save.writes, f"the training checkpoint {save.tmp_dir}")  # collective
    dist.barrier()  # every rank's small files (rng/) are on disk too
    error = None
    if dist.get_rank() == 0:
        try:
            checkpoint_dirs.publish(save.tmp_dir, save.final_dir, save.step, save.keep_last)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    error = broadcast_from_rank0(error)  # also the barrier: on return every rank sees it published
    if error is not None:
        raise RuntimeError(f"publishing the training checkpoint {save.final_dir} failed on rank 0: {error}")
    return save.final_dir


def save_training_checkpoint(
    ckpt_root,
    step,
    ddp_chunks,
    optimizer,
    scheduler,
    extra=None,
    *,
    keep_last=2,
    meta=None,
    hf_source_dir=None,
    optimizer_sharding=DEFAULT_OPTIMIZER_SHARDING,
    extra_models=None,
):
    """Save everything needed to resume at `step` into ckpt_root/step_{step:06d}. All ranks call
    this; on return every rank sees it complete and `latest` names it. Returns the step dir.

    extra: JSON-able dict the script wants back on resume (data position, best reward, ...).
    extra_models: {name: (ddp_chunks, optimizer, scheduler)} of further trained models (the
    PPO critic), each saved into the subdirectory `name` of the same step directory, before
    the one complete marker: the step is complete with all its models or not at all.
    meta/hf_source_dir: when given, rl_meta.json and hf/ as in write_meta (merge_to_hf.py can
    then convert the step directory). keep_last: older step directories beyond the newest
    keep_last complete ones are deleted (never the one just written; newer ones are left alone).
    optimizer_sharding: see OPTIMIZER_SHARDINGS. Raises RuntimeError before writing anything
    if a weight or fp32 main param of any rank is not finite.
    """
    save = _start_save(
        ckpt_root,
        step,
        ddp_chunks,
        optimizer,
        scheduler,
        extra,
        keep_last=keep_last,
        meta=meta,
        hf_source_dir=hf_source_dir,
        optimizer_sharding=optimizer_sharding,
        extra_models=extra_models,
        background=False,
    )
    checkpoint_io.all_written(save.writes, block=True)
    return _publish(save)


class CheckpointWriter:
    """Training checkpoints written in the background, one at a time. All ranks make the same calls.

        writer = CheckpointWriter()
        for step in range(start_step, steps):
            ...                                   # rollout, train, optimizer step
            writer.poll()                         # every step: publishes a finished save
            if (step + 1) % save_every == 0:
                writer.save(ckpt_root, step + 1, model, optimizer, scheduler, extra=..., ...)
        writer.wait()                             # before exit: waits for the last save and publishes it

    save() blocks for the finite check, the planning and the copy of this rank's share to host
    memory (and, for fully_reshardable, the distributed optimizer's gather: pass
    optimizer_sharding="dp_reshardable" where blocking time matters more than resuming at
    another TP/PP); threads write the files from those copies while training goes on. A save
    first waits for the previous one. It is published (step_N.tmp renamed, `latest` updated)
    by the poll/wait/close that finds every rank's files written; a write failure of any rank
    is raised there, on every rank, and the step stays step_N.tmp (never loaded). Use one
    writer for all saves of a run.
    """

    def __init__(self, models=(), shared=None):
        """models: [(ddp_chunks, optimizer), ...], everything this writer will save. shared: the
        colocation's SharedHostBuffers (common/train/offload.py): tensors in storages the offload
        keeps in host memory are staged in those buffers. For the others, host memory is pinned
        now, once (seconds per 10 GB, checkpoint_io.HostStaging), so that a save only copies:
        host_bytes(models, shared)."""
        self.pending = None  # the save in flight (a _PendingSave)
        self.wait_s = 0.0  # of the last save(): waiting for the one before it to be written
        self.last = {}  # the last published save: step, dir, blocking_s, stage_s, total_s (for the metrics)
        self.staging = checkpoint_io.HostStaging(shared)
        self.staging.reserve(self.host_bytes(models, shared))

    @staticmethod
    def host_bytes(models, shared=None):
        """Host memory a CheckpointWriter of these models pins for its own staging buffer: the
        bytes of their GPU tensors (params, fp32 main params, Adam's moments, those its first
        step will create included) that the offload does not keep in its host buffers (shared).
        0 without GPU tensors. Arithmetic: creates nothing."""
        include_cpu = shared is not None and shared.include_cpu
        held = shared.held_storages() if shared is not None else set()
        sizes = []
        for chunks, optimizer in models:
            for tensor in _training_tensors(chunks, optimizer)[1]:
                if tensor.dim() == 0 or not (tensor.is_cuda or include_cpu):  # not Adam's step counters
                    continue
                if (tensor.device, tensor.untyped_storage().data_ptr()) not in held:
                    sizes.append(tensor.numel() * tensor.element_size())
            if shared is None or not shared.holds_state_of(optimizer):
                sizes += [
                    p.numel() * p.element_size() for p, _ in adam_state_to_come(optimizer) if p.is_cuda or include_cpu
                ]
        if sizes or held:  # and the small tensors megatron makes at a save (dp_reshardable's padding)
            sizes.append(STAGING_SLACK)
        return HostPool.size_for(sizes, align=checkpoint_io.HostStaging.ALIGN)

    def save(
        self,
        ckpt_root,
        step,
        ddp_chunks,
        optimizer,
        scheduler,
        extra=None,
        *,
        keep_last=2,
        meta=None,
        hf_source_dir=None,
        optimizer_sharding=DEFAULT_OPTIMIZER_SHARDING,
        extra_models=None,
        before_model=None,
    ):
        """save_training_checkpoint's arguments (+ before_model: _start_save's); returns once the files
        are being written. self.wait_s: the seconds it first waited for the previous save's files."""
        started = time.perf_counter()
        self.wait()
        self.wait_s = time.perf_counter() - started
        self.staging.clear()  # the previous save's files are written: its host copies may go
        self.pending = _start_save(
            ckpt_root,
            step,
            ddp_chunks,
            optimizer,
            scheduler,
            extra,
            keep_last=keep_last,
            meta=meta,
            hf_source_dir=hf_source_dir,
            optimizer_sharding=optimizer_sharding,
            extra_models=extra_models,
            background=True,
            staging=self.staging,
            before_model=before_model,
        )
        self.pending.blocking_s = time.perf_counter() - self.pending.started
        self.pending.stage_s = sum(write.stage_s for write in self.pending.writes)

    def poll(self):
        """Publish the save in flight if every rank has written its files (one all_reduce while a
        save is in flight, nothing otherwise). Returns the step directory published now, or None."""
        return self._finish(block=False)

    def wait(self):
        """Block until the save in flight (if any) is written everywhere, and publish it."""
        return self._finish(block=True)

    def _finish(self, block):
        if self.pending is None or not checkpoint_io.all_written(self.pending.writes, block):
            return None
        save, self.pending = self.pending, None  # a failed save is dropped, not retried
        step_dir = _publish(save)
        self.last = {
            "step": save.step,
            "dir": step_dir,
            "blocking_s": save.blocking_s,
            "stage_s": save.stage_s,
            "total_s": time.perf_counter() - save.started,
        }
        return step_dir


# --- layout, rank 0's word ------------------------------------------------------------
def run_layout(ddp_chunks=None):
    """This run's parallel layout; given the model, also its decoder layers per pipeline stage
    (uneven stages: bridge.pipeline_layout), which a PP size alone does not fix."""
    from megatron.core import parallel_state as mpu

    layout = {
        "world_size": dist.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
    }
    if ddp_chunks is not None:
        layout["stage_layers"] = stage_layers(unwrap(ddp_chunks[0]).config)
    return layout


def broadcast_from_rank0(obj):
    """obj as rank 0 has it, on every rank (collective; also a barrier)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
