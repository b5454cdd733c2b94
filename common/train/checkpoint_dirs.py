"""The step directories of training checkpoints, and the RNG states saved in them.

Protocol (rank 0): a save is written into step_N.tmp; once every rank's files are there,
publish() writes a `complete` marker listing every file and its size, renames the directory to
step_N and points `latest` at it (each atomic), then prunes older step directories beyond
--keep-checkpoints. candidates()/check_step_dir() are the loader's side: which directories to
try, newest published first, and whether one is whole. rng_state()/set_rng_state(): every
rank's generators (rng/rank_N.pt). The tensor files themselves: common/train/checkpoint_io.py.
"""

import json
import os
import random
import re
import shutil

import numpy as np
import torch

# --- the step-directory protocol -----------------------------------------------------------
LATEST_FILE = "latest"
COMPLETE_FILE = "complete"
STEP_DIR = re.compile(r"^step_(\d+)$")


def publish(tmp_dir, final_dir, step, keep_last):
    """Rank 0, once every rank's files are in tmp_dir: the complete marker, the rename to
    final_dir and `latest` (each atomic), then pruning of older step directories."""
    # The marker lists every file with its size, so a deleted or truncated file (a crash
    # mid-write, a full disk, a careless rm) is caught before loading.
    files = {}
    for dirpath, _, filenames in os.walk(tmp_dir):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            files[os.path.relpath(path, tmp_dir)] = os.path.getsize(path)
    write_atomic(os.path.join(tmp_dir, COMPLETE_FILE), json.dumps({"step": step, "files": files}, indent=1))
    if os.path.exists(final_dir):  # e.g. a damaged step_N we fell back from, now redone
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    ckpt_root = os.path.dirname(final_dir)
    write_atomic(os.path.join(ckpt_root, LATEST_FILE), os.path.basename(final_dir) + "\n")
    _prune(ckpt_root, step, keep_last)


def candidates(ckpt_root):
    """Step directory names to try, preferred first: the one `latest` names, then older ones.

    Directories newer than `latest` were never published (crash between rename and update of
    `latest`, or a timeline we fell back from) and *.tmp directories are interrupted saves:
    both are ignored."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = {}
    for entry in os.listdir(ckpt_root):
        match = STEP_DIR.match(entry)
        if match and os.path.isdir(os.path.join(ckpt_root, entry)):
            steps[entry] = int(match.group(1))
    newest_first = sorted(steps, key=steps.get, reverse=True)
    latest_path = os.path.join(ckpt_root, LATEST_FILE)
    if not os.path.isfile(latest_path):
        if newest_first:
            print(
                f"[checkpoint] WARNING: {latest_path} is missing; trying the step directories newest first", flush=True
            )
        return newest_first
    with open(latest_path) as f:
        latest = f.read().strip()
    match = STEP_DIR.match(latest)
    if not match:
        print(
            f"[checkpoint] WARNING: {latest_path} holds {latest[:80]!r}, not a step directory name; "
            "trying the step directories newest first",
            flush=True,
        )
        return newest_first
    return [latest] + [name for name in newest_first if steps[name] < int(match.group(1))]


def check_step_dir(step_dir, required=()):
    """None if step_dir looks complete (its marker lists `required` files among others and every
    listed file has its size), else why not (cheap: sizes, not checksums)."""
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
    for relpath in required:
        if relpath not in files:
            return f"{relpath} was never written"
    for relpath, size in files.items():
        path = os.path.join(step_dir, relpath)
        if not os.path.isfile(path):
            return f"{relpath} is missing"
        if os.path.getsize(path) != size:
            return f"{relpath} has {os.path.getsize(path)} bytes, {size} were written (truncated?)"
    return None


def latest_complete(ckpt_root):
    """The newest complete step directory of ckpt_root (the one `latest` names unless it is
    damaged: candidates' order), or None."""
    for name in candidates(ckpt_root):
        if check_step_dir(os.path.join(ckpt_root, name)) is None:
            return os.path.join(ckpt_root, name)
    return None


def _prune(ckpt_root, step, keep_last):
    """Keep the newest keep_last complete step dirs up to `step`; delete older ones (and older
    damaged ones) and interrupted saves (*.tmp; none is in flight now)."""
    older = []
    for entry in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, entry)
        if entry.endswith(".tmp") and STEP_DIR.match(entry[:-4]) and os.path.isdir(path):
            shutil.rmtree(path)
        elif STEP_DIR.match(entry) and int(entry[5:]) < step:
            older.append((int(entry[5:]), entry))
    keep = max(keep_last, 1) - 1  # the one just written counts
    for _, entry in sorted(older, reverse=True):
        path = os.path.join(ckpt_root, entry)
        if keep > 0 and check_step_dir(path) is None:
            keep -= 1
        else:
            shutil.rmtree(path)


def write_atomic(path, text):
    """Readers see the old file or the new one, never half of one (rename is atomic on POSIX)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# --- RNG states (rng/rank_N.pt) ------------------------------------------------------------
def _rng_coordinates():
    """What megatron's RNG tracker seeds depend on (tensor_parallel/random.py)."""
    from megatron.core import parallel_state as mpu

    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "ep_rank": mpu.get_expert_model_parallel_rank(),
    }


def rng_state():
    """This rank's python, numpy, torch (+CUDA) generators and megatron's model-parallel tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
        "coordinates": _rng_coordinates(),
    }


def set_rng_state(state):
    """Restore a rng_state(): the global generators always, megatron's tracker only if it was
    saved at this rank's TP/EP coordinates. Returns whether the tracker was restored."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    if state["coordinates"] != _rng_coordinates():
        return False
    get_cuda_rng_tracker().set_states(state["tracker"])
    return True
