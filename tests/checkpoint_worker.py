"""Worker for tests/test_train_checkpoint.py (gloo, CPU): runs a list of jobs in one process.

    python tests/checkpoint_worker.py --hf-dir D --out-dir O --jobs JSON            (one process)
    torchrun --nproc_per_node 2 tests/checkpoint_worker.py --tp 2 --hf-dir D --out-dir O --jobs JSON
    (--ep N: a Mixture-of-Experts model's experts split over N ranks)

Each job builds a fresh model from the HF weights and its own DDP + optimizer + LR schedule
(so one process can run several, with and without the distributed optimizer), then trains
up to step TOTAL_STEPS, either from step 1 or after load_training_checkpoint(job["resume"]).
Job keys (all optional but name):
  name                  results in O/<name>.json, final full weights in O/<name>.pt (rank 0)
  dist_opt (True)       use_distributed_optimizer
  first_stage_layers    decoder layers of the first pipeline stage (None: automatic)
  critic                also train a PPO critic (common/model/critic.py, own Adam and schedule) on the
                        same batches, saved and loaded as extra_models={"critic": ...}
  resume                checkpoint root to resume from (else: train from step 1); the RNG
                        fingerprints before and after the load are recorded
  try_first             roots to load before `resume`; each error message is recorded
  saves                 [{step, root, sharding, keep_last, meta, background, hold_until,
                        fail_first_write}] after that step; background saves go through one
                        CheckpointWriter, polled every step (fail_first_write: the first file
                        write fails once, the writer must write it again)
  compare_model_space_at  at this step compare our model-space optimizer state with megatron's
                        (None at DP>1, where ours does not apply)
  nan_save_at           at this step first try a save with a NaN in one weight of the last
                        rank (must be refused on every rank, nothing written), then go on
  fail_save_at          at this step a background save into O/<name>_fail on which the last
                        rank's file writes fail (RLIMIT_FSIZE: "File too large"); records the
                        error wait() raises on every rank
  break_copy            after training, copy `resume` there, damage every checkpoint in it and
                        record the error of loading it
  exit_hard             (last job only) end like train_grpo.py with vLLM: writer.wait(), then
                        os._exit(0)
  megatron_queue        (with exit_hard) the control: megatron's own results queue (its spawned
                        Manager process) made before the saves
Every step draws its batch from the global python, numpy and torch RNGs, so the losses
after a resume only match if those RNG states were restored; and it draws from megatron's
model-parallel RNG tracker (as dropout does), so each TP rank's tracker state moves on too.
The RNG fingerprints of every rank are recorded after each step with a save.
"""

import argparse
import hashlib
import json
import os
import pathlib
import random
import resource
import shutil
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.distributed as dist

TOTAL_STEPS, GLOBAL_BATCH, SEQ_LEN = 5, 4, 16


def train_step(ddp_chunks, optimizer, scheduler, vocab_size, critic=None):
    """One optimizer step on a random global batch of GLOBAL_BATCH sequences; returns
    (global mean loss, grad norm, lr used). Every rank draws the same global batch.
    critic: (ddp_chunks, optimizer, scheduler) of a value model, also stepped on the batch
    (regressing V(t) onto (token % 7) / 7); then (loss, grad norm, lr) of the critic follow."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN))  # torch RNG
    order = list(range(GLOBAL_BATCH))
    random.shuffle(order)  # python RNG
    shift = int(np.random.randint(0, SEQ_LEN))  # numpy RNG
    tokens = torch.roll(tokens[order], shift, dims=1)
    dp_size, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    # the model's device: CPU in CI; a GPU in tests/gpu/run_all.sh (NCCL, pinned staging)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with get_cuda_rng_tracker().fork():  # as dropout would: megatron's tracker (per TP rank) moves on
        torch.rand(1, device=device)
    local = tokens.chunk(dp_size)[dp_rank].to(device)  # (GLOBAL_BATCH/dp, T)
    positions = torch.arange(SEQ_LEN, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        ids = next(data_iterator)  # on later pipeline stages only the labels are used
        per_token_loss = model(ids, positions, None, labels=torch.roll(ids, -1, 1))  # (1, T)

        def loss_func(output):
            loss = output.float().mean()
            # clone: megatron divides the returned loss by num_microbatches in place
            return loss, {"loss": loss.detach().clone()}

        return per_token_loss, loss_func

    result = optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local)
    if critic is None:
        return result
    return result + critic_step(*critic, local, positions)


def critic_step(ddp_chunks, optimizer, scheduler, local, positions):
    """One step of the value model: V(t) regressed onto (token % 7) / 7."""

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        values = model(ids, positions, None).squeeze(-1)  # (1, T)

        def loss_func(output):
            loss = ((output - (ids % 7) / 7.0) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return values, loss_func

    return optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local)


def optimizer_step(ddp_chunks, optimizer, scheduler, forward_step, local):
    """forward/backward of this rank's micro-batches (one sequence each), one optimizer and
    scheduler step; returns (global mean loss, grad norm, lr used)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(local.split(1)),
        model=ddp_chunks,
        num_microbatches=local.shape[0],
        seq_length=SEQ_LEN,
        micro_batch_size=1,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    # only the last pipeline stage has losses: the sum over the PP group carries them to all
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    loss = torch.stack([entry["loss"] for entry in losses]).mean() if losses else torch.zeros((), device=device)
    dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=mpu.get_data_parallel_group())
    return loss.item() / mpu.get_data_parallel_world_size(), float(grad_norm), lr


def rng_fingerprints():
    """(global generators, megatron tracker) digests of this rank's RNG states; reads only."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    numpy_state = np.random.get_state()
    glob = hashlib.sha256(repr(random.getstate()).encode())
    glob.update(numpy_state[1].tobytes() + repr(numpy_state[2:]).encode())
    glob.update(torch.get_rng_state().numpy().tobytes())
    tracker = hashlib.sha256()
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        tracker.update(name.encode() + state.numpy().tobytes())
    return glob.hexdigest()[:16], tracker.hexdigest()[:16]


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def error_of(fn, *args, **kwargs):
    """The message of the error fn raises (None if it returns): a RuntimeError, or the
    UsageError (a ValueError) of a checkpoint refused for this run; and whether every rank got
    the same one."""
    try:
        fn(*args, **kwargs)
        message = None
    except (RuntimeError, ValueError) as e:
        message = str(e)
    return message, len(set(gather(message))) == 1


def run_job(job, args, info, spec, out_dir):
    from common.model.critic import build_critic, load_critic_weights
    from common.model.gpt import build_model
    from common.model.weights import export_hf_weights
    from common.model.weights_load import load_hf_weights
    from common.run.dist import set_seed
    from common.train.resume import load_training_checkpoint
    from common.train.save import CheckpointWriter, save_training_checkpoint
    from common.train.setup import setup_training

    set_seed(1234)  # as init_distributed: a job later in the process starts like a fresh process
    chunks = build_model(
        spec, tp=info.tp_size, pp=info.pp_size, ep=args.ep, first_stage_layers=job.get("first_stage_layers")
    )
    load_hf_weights(chunks, spec, args.hf_dir)
    # warmup + cosine decay: a scheduler that is not restored gives a different LR. clip_grad
    # never clips: clipping would scale updates by a norm whose rounding depends on the layout.
    ddp_chunks, optimizer, scheduler = setup_training(
        chunks,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=2,
        total_steps=10,
        decay_style="cosine",
        clip_grad=1e3,
        use_distributed_optimizer=job.get("dist_opt", True),
    )
    result = {"losses": {}, "grad_norms": {}, "lrs": {}, "saves": {}}
    critic, extra_models = None, None
    if job.get("critic"):
        critic_chunks = build_critic(spec, tp=info.tp_size)
        load_critic_weights(critic_chunks, spec, args.hf_dir)
        # another schedule than the policy's, so a scheduler mix-up shows in the LRs
        critic = setup_training(
            critic_chunks,
            lr=3e-2,
            min_lr=0.0,
            warmup_steps=1,
            total_steps=8,
            decay_style="linear",
            clip_grad=1e3,
            use_distributed_optimizer=job.get("dist_opt", True),
        )
        extra_models = {"critic": critic}
        result.update(critic_losses={}, critic_grad_norms={}, critic_lrs={})

    first_step = 1
    if job.get("resume"):
        # perturb every RNG so that only a restore can bring back the saved states
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        result["rng_before_load"] = gather(rng_fingerprints())
        result["try_first"] = [
            error_of(load_training_checkpoint, root, ddp_chunks, optimizer, scheduler, extra_models=extra_models)
            for root in job.get("try_first", [])
        ]
        extra = load_training_checkpoint(job["resume"], ddp_chunks, optimizer, scheduler, extra_models=extra_models)
        result["extra"] = extra
        result["rng_after_load"] = gather(rng_fingerprints())
        first_step = extra["step"] + 1

    # as the scripts: staging memory reserved for both models (pinned on a GPU)
    writer = CheckpointWriter(models=[(ddp_chunks, optimizer)] + ([critic[:2]] if critic is not None else []))
    hold_until, held_root, held_dir = None, None, None
    for step in range(first_step, TOTAL_STEPS + 1):
        out = train_step(ddp_chunks, optimizer, scheduler, spec.vocab_size, critic)
        result["losses"][step], result["grad_norms"][step], result["lrs"][step] = out[:3]
        if critic is not None:
            result["critic_losses"][step], result["critic_grad_norms"][step], result["critic_lrs"][step] = out[3:]
        published = writer.poll()
        if published:
            result["saves"][f"published_at_{step}"] = published
        if step == hold_until:  # the held writers (a slow disk) have missed the poll of this step
            result["saves"]["while_held"] = {
                "poll": published,
                "latest": latest_of(held_root),
                "step_dir_exists": os.path.exists(held_dir),
            }
            HELD.set()
        extra = {"step": step, "samples_seen": step * GLOBAL_BATCH}
        if step == job.get("compare_model_space_at"):
            result["model_space"] = compare_model_space(ddp_chunks, optimizer)
        if step == job.get("nan_save_at"):
            result["nan"] = nan_save(ddp_chunks, optimizer, scheduler, extra, out_dir / f"{job['name']}_nan", step)
        if step == job.get("fail_save_at"):
            result["fail"] = failing_save(
                writer, ddp_chunks, optimizer, scheduler, extra, out_dir / f"{job['name']}_fail", step
            )
        for save in job.get("saves", []):
            if save["step"] != step:
                continue
            kwargs = dict(
                keep_last=save.get("keep_last", 2),
                extra_models=extra_models,
                meta={"written_by": "tests/checkpoint_worker.py"} if save.get("meta") else None,
                **({"optimizer_sharding": save["sharding"]} if "sharding" in save else {}),
            )
            if save.get("background"):
                before = latest_of(save["root"])
                if save.get("hold_until"):
                    HELD.clear()
                    threading.settrace(hold_writers)  # for the threads the save starts
                if save.get("fail_first_write"):
                    fail_first_write()
                writer.save(save["root"], step, ddp_chunks, optimizer, scheduler, extra, **kwargs)
                threading.settrace(None)
                if save.get("hold_until"):
                    hold_until, held_root = save["hold_until"], save["root"]
                    held_dir = os.path.join(held_root, f"step_{step:06d}")
                # nothing is published by save() itself: `latest` and step_N appear at a poll
                result["saves"][f"{save['root']}@{step}"] = {
                    "latest_unchanged": latest_of(save["root"]) == before,
                    "step_dir_absent": not os.path.exists(os.path.join(save["root"], f"step_{step:06d}")),
                }
            else:
                save_training_checkpoint(save["root"], step, ddp_chunks, optimizer, scheduler, extra, **kwargs)
        if step == 3:
            result["rng_after_save"] = gather(rng_fingerprints())
        if any(save["step"] == step for save in job.get("saves", [])):  # (every rank runs the same jobs)
            result.setdefault("rng_at_save", {})[step] = gather(rng_fingerprints())
    published = writer.wait()
    if published:
        result["saves"]["published_at_end"] = published
    result["injected_write_failures"] = list(INJECTED)

    weights = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, spec, dtype=torch.float32)}
    if job.get("break_copy"):  # last: a failed load leaves the live objects half-loaded
        result["all_damaged"] = break_and_load(job["resume"], job["break_copy"], ddp_chunks, optimizer, scheduler)
    if info.rank == 0:
        torch.save(weights, out_dir / f"{job['name']}.pt")
        with open(out_dir / f"{job['name']}.json", "w") as f:
            json.dump(result, f, indent=1)
    return writer


HELD = threading.Event()
INJECTED = []  # failures fail_first_write raised


def fail_first_write():
    """Make the first tensor write of a checkpoint writer thread fail once (as a write can fail
    for a moment, e.g. a disk that had no room: common/train/checkpoint_io.py PendingWrite._write_file):
    the file must be written again from the host copies. One failure per process: afterwards
    the wrapper only passes writes on."""
    import functools

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    original = fa._write_item

    @functools.wraps(original)  # megatron inspects its signature
    def failing(*args, **kwargs):
        if not INJECTED and threading.current_thread().name.startswith("ckpt-write") and torch.is_tensor(args[-3]):
            INJECTED.append(threading.current_thread().name)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 (injected)")
        return original(*args, **kwargs)

    fa._write_item = failing


def hold_writers(frame, event, arg):
    """Trace function (threading.settrace) that holds this rank's checkpoint writer threads
    (common/train/checkpoint_io.py names them ckpt-write-*) of the last rank at their start until HELD
    is set: a slow disk on demand, so that training goes on while a save is in flight."""
    if threading.current_thread().name.startswith("ckpt-write") and dist.get_rank() == dist.get_world_size() - 1:
        HELD.wait()
    return None


def latest_of(root):
    path = os.path.join(root, "latest")
    return open(path).read().strip() if os.path.isfile(path) else None


def compare_model_space(ddp_chunks, optimizer):
    """common/training.model_space_optimizer_state against megatron's own fully_reshardable
    sharded state dict of the same optimizer: entries, their metadata and values."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from common.train.checkpoint import model_sharded_state_dict
    from common.train.setup import model_space_optimizer_state

    ours = model_space_optimizer_state(optimizer, model_sharded_state_dict(ddp_chunks))
    theirs = optimizer.sharded_state_dict(
        model_sharded_state_dict(ddp_chunks),
        is_loading=False,
        metadata={"distrib_optim_sharding_type": "fully_reshardable"},
    )
    if ours is None:
        return None

    def entries(state):
        return {
            entry.key: entry
            for index in sorted(state["param_state"])
            for entry in nested_values(state["param_state"][index])
        }

    def meta(entry):
        return repr(
            (
                type(entry).__name__,
                entry.data.dtype,
                tuple(entry.data.shape),
                *(
                    getattr(entry, f, None)
                    for f in (
                        "dtype",
                        "global_shape",
                        "global_offset",
                        "axis_fragmentations",
                        "replica_id",
                        "prepend_axis_num",
                    )
                ),
            )
        )

    a, b = entries(ours), entries(theirs)
    order = lambda state: [
        entry.key
        for index in sorted(state["param_state"])  # noqa: E731
        for entry in nested_values(state["param_state"][index])
    ]
    return {
        "entries": len(a),
        "same_keys_in_order": order(ours) == order(theirs),
        "metadata_differs": [k for k in a if k in b and meta(a[k]) != meta(b[k])],
        "values_differ": [k for k in a if k in b and not torch.equal(a[k].data.cpu(), b[k].data.cpu())],
        "rest_equal": repr({k: v for k, v in ours.items() if k != "param_state"})
        == repr({k: v for k, v in theirs.items() if k != "param_state"}),
    }


def nan_save(ddp_chunks, optimizer, scheduler, extra, root, step):
    """A NaN in one weight of the last rank: the save must be refused everywhere, before writing."""
    from common.model.chunks import unwrap
    from common.train.save import save_training_checkpoint

    weight = unwrap(ddp_chunks[-1]).decoder.layers[-1].mlp.linear_fc2.weight
    original = weight.detach().clone()
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            weight[0, 0] = float("nan")
    from common.train.guard import NonFiniteError

    try:  # NonFiniteError: the scripts' run_training ends with one line and exit code 3
        save_training_checkpoint(str(root), step, ddp_chunks, optimizer, scheduler, extra)
        message, kind = None, None
    except RuntimeError as e:
        message, kind = str(e), type(e).__name__ if isinstance(e, NonFiniteError) else f"not NonFiniteError: {e!r}"
    with torch.no_grad():
        weight.copy_(original)
    return {
        "error": message,
        "errors_agree": len(set(gather(message))) == 1,
        "error_type": kind,
        "root_exists": os.path.exists(root),
    }


def failing_save(writer, ddp_chunks, optimizer, scheduler, extra, root, step):
    """A background save whose file writes fail on the last rank only: files larger than 64 KiB
    cannot be written by that process (RLIMIT_FSIZE with SIGXFSZ ignored -> EFBIG), which hits
    its .distcp files (~0.3 MB) in the writer threads and nothing before."""
    last = dist.get_rank() == dist.get_world_size() - 1
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if last:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        writer.save(str(root), step, ddp_chunks, optimizer, scheduler, extra)
        message, agree = error_of(writer.wait)
    finally:
        if last:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return {"error": message, "errors_agree": agree, "listing": sorted(os.listdir(root))}


def break_and_load(root, copy, ddp_chunks, optimizer, scheduler):
    """Every checkpoint of a copy of root damaged: the newest one (already missing a file)
    structurally, the older one so that its files look complete but the load itself fails."""
    from common.train.resume import load_training_checkpoint

    if dist.get_rank() == 0:
        shutil.copytree(root, copy)
        step3 = os.path.join(copy, "step_000003")
        size = os.path.getsize(os.path.join(step3, ".metadata"))
        with open(os.path.join(step3, ".metadata"), "wb") as f:
            f.write(b"\0" * size)
    dist.barrier()
    message, agree = error_of(load_training_checkpoint, copy, ddp_chunks, optimizer, scheduler)
    return {"error": message, "errors_agree": agree}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--jobs", required=True, help="JSON list of jobs (see the module docstring)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()

    from common.model.gpt import load_hf_spec
    from common.run.dist import destroy_distributed, init_distributed

    info = init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, seed=1234)
    spec = load_hf_spec(args.hf_dir)
    jobs = json.loads(args.jobs)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if jobs[-1].get("megatron_queue"):
        filesystem_async._get_write_results_queue()  # what megatron makes unless given a queue
    for job in jobs:
        writer = run_job(job, args, info, spec, pathlib.Path(args.out_dir))
    if jobs[-1].get("exit_hard"):
        # train_grpo.py's exit with vLLM: no interpreter shutdown, so no atexit handler runs
        writer.wait()
        manager = getattr(filesystem_async._results_queue, "_manager", None)  # for the test to clean up
        print(f"[worker] megatron's results-queue Manager: pid {manager._process.pid if manager else None}", flush=True)
        dist.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    destroy_distributed()


if __name__ == "__main__":  # megatron's Manager process (spawned) re-imports __main__
    main()
