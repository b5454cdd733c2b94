"""--out, the output directory of a training run: rules that make sure no run loses a user's file.

  - --out may not be, be inside, or contain --model, --mcore-ckpt, --data, --critic-model
    or --load-rollouts;
  - a non-empty --out is refused unless --resume (continue it) or --start-over (it is moved
    aside to <out>.old-<time>, nothing is deleted); what a run writes before its first step
    completes (RUN_START_FILES) does not count as a run;
  - --resume needs a checkpoint in --out/checkpoints (it never silently starts over);
    --resume auto (for requeued jobs) resumes when there is one, else acts as --start-over;
    a requeued Slurm job (SLURM_RESTART_COUNT > 0) started with --start-over resumes the run
    its first attempt began (as --resume auto) instead of moving it aside;
  - one run at a time in an --out: rank 0 holds an exclusive lock on --out/.run.lock for the
    run's life (flock: it goes with the process, so a crashed or killed run leaves none).
common/run/preflight.py applies them with the other checks of a run.
"""

import errno
import fcntl
import json
import os
import socket
import time

from common.run.dist import launcher_rank
from common.train.guard import UsageError

LOCK_FILE = ".run.lock"  # (the holder's pid, host and start time inside, for the refusal's message)


# What a run writes into --out before its first step completes (a failed or killed start leaves
# them): a re-run over such a directory loses nothing. The embedded model, the run record, an
# empty metrics.jsonl, the lock, step 0's validation (eval/), wandb's files, an interrupted
# first save (checkpoints/ without a checkpoint).
RUN_START_FILES = {
    "embedded_model",
    "config.json",
    "metrics.jsonl",
    LOCK_FILE,
    "eval",
    "samples.jsonl",
    "wandb",
    "wandb_run_id",
    "checkpoints",
}


_held_locks = {}  # --out (absolute) -> the fd of its lock file, held by this process


def requeued_start_over(args):
    """A requeued Slurm job runs its command again: its --start-over meant the first attempt.
    The later ones continue the run it began (--resume auto: from its checkpoint, else anew)."""
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if args.start_over and attempt > 0:
        args.start_over, args.resume = False, "auto"
        if launcher_rank() == 0:
            print(
                f"--start-over: this is attempt {attempt + 1} of a requeued Slurm job: continuing the run its "
                "first attempt started (as --resume auto)",
                flush=True,
            )


def lock_out(out):
    """Rank 0: hold an exclusive lock on out/.run.lock for this process's life (created with out),
    or UsageError naming the run that holds it. The lock is flock(2): the kernel releases it
    when the process ends, however it ends, so a dead run never blocks the next."""
    path = os.path.abspath(out)
    if path in _held_locks:  # (parse_args again in the same process: tests)
        return
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UsageError(
            f"--out {out} cannot be written ({e.strerror}: {e.filename}): choose a directory you can write to"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(fd, closefd=True) as f:
            holder = f.read().strip() or "its pid unknown"
        raise UsageError(
            f"--out {out} is in use by another run ({holder}{_gone(holder)}); wait for it or choose another --out"
        )
    except OSError as e:  # a filesystem without locks (ENOLCK, ENOSYS, EOPNOTSUPP): run unguarded
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        print(f"warning: --out {out} cannot be locked ({e.strerror}): nothing stops a second run there", flush=True)
        return
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n".encode())
    _held_locks[path] = fd


def _gone(holder):
    """A note when the run named in a held lock file is gone from this host: a process it started
    (a rollout engine's worker, say) holds the lock still."""
    words = holder.split()
    if len(words) < 5 or words[0] != "pid" or words[4] != socket.gethostname() + ",":
        return ""
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return f"; that pid has ended, a process it started still holds {LOCK_FILE}: `fuser -v` on it names it"
    except (ValueError, PermissionError):
        pass
    return ""


def check_out(args, critic_model):
    """--out's rules (this module's docstring); rank 0 locks it. Raises UsageError."""
    out = os.path.abspath(args.out)
    eval_only = getattr(args, "eval_only", False)  # train_grpo.py --eval-only writes <out>/eval_only/ only
    for flag, path in (
        ("--model", args.model),
        ("--mcore-ckpt", args.mcore_ckpt),
        ("--data", args.data),
        ("--eval-data", args.eval_data),
        ("--critic-model", critic_model),
        ("--load-rollouts", args.load_rollouts),
        ("--reward-model", getattr(args, "reward_model", None)),
    ):
        if path is None or (eval_only and flag == "--mcore-ckpt"):  # (a checkpoint of the run in --out)
            continue
        path = os.path.abspath(path)
        if path == out or path.startswith(out + os.sep) or out.startswith(path + os.sep):
            raise UsageError(
                f"--out {args.out} overlaps {flag} {path}: a run writes into --out; choose a "
                "directory outside your inputs"
            )
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {args.out} exists and is not a directory")
    if launcher_rank() == 0:  # before anything in --out is looked at: another run may be changing it
        lock_out(args.out)
    ckpt_root = os.path.join(out, "checkpoints")
    if args.resume == "auto":  # a requeued job: continue if the first attempt saved, else begin
        args.resume, args.start_over = ("yes", False) if has_checkpoint(ckpt_root) else (None, True)
    if args.resume:
        if not has_checkpoint(ckpt_root):
            raise UsageError(
                f"--resume: there is no checkpoint in {ckpt_root} (none was saved yet), so there "
                "is nothing to continue; nothing was changed. Run without --resume and with "
                "--start-over to begin again"
            )
    elif has_run(out) and not args.start_over and not eval_only:
        held = sorted(set(os.listdir(out)) - {LOCK_FILE})
        raise UsageError(
            f"--out {args.out} already holds a run ({', '.join(held[:4])}); nothing "
            "was changed. Pass --resume to continue it, --start-over to begin a new run there (the old "
            "one is moved to <out>.old-<time>), or choose another --out"
        )


def has_checkpoint(ckpt_root):
    return os.path.isdir(ckpt_root) and any(
        name == "latest" or name.startswith("step_") and not name.endswith(".tmp") for name in os.listdir(ckpt_root)
    )


def has_run(out):
    """Whether --out holds anything a new run would overwrite: anything but what a run writes
    before its first step completes (RUN_START_FILES, with an empty metrics.jsonl, a config.json
    that is a run record, no checkpoint)."""
    try:
        names = os.listdir(out)
    except (FileNotFoundError, NotADirectoryError):  # (also: rank 0 just moved it aside, --start-over)
        return False
    for name in names:
        path = os.path.join(out, name)
        if (
            name not in RUN_START_FILES
            or (name == "metrics.jsonl" and os.path.getsize(path) > 0)
            or (name == "config.json" and not is_run_record(path))
            or (name == "checkpoints" and has_checkpoint(path))
        ):
            return True
    return False


def is_run_record(path):
    """config.json as a training run writes it (common/run/log.py), not, say, a model's."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and ("args" in record or "out" in record) and "architectures" not in record


def move_aside(out):
    """--start-over, rank 0: the run in out moves to <out>.old-<time> (nothing is deleted) and the
    new, empty out is locked for this run. Returns where the old one went."""
    aside = base = f"{os.path.abspath(out)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(2, 1000):  # two starts over within a second
        if not os.path.exists(aside):
            break
        aside = f"{base}-{n}"
    os.rename(out, aside)  # (with the lock file, still held: the new --out gets its own)
    _held_locks.pop(os.path.abspath(out), None)
    lock_out(out)
    return aside
