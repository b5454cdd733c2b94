"""torchrun, with last words when a rank dies: which one, how, the likely cause, the last checkpoint.

    python launch/torchrun.py [torchrun's flags] SCRIPT.py [the script's flags]

launch/local.sh and launch/slurm.sh start the ranks through this file. It is torchrun itself
(torch.distributed.run's main, in this process: the same flags, environment and signal handling);
only when a rank ends abnormally does it add, as its last lines:

    [launch] rank 1 (local rank 1 on node-a, pid 4242) was killed by signal 9 (SIGKILL): most likely the
    host ran out of memory (check `dmesg` / the job's memory limit); the last complete checkpoint is
    runs/grpo-embedded/checkpoints/step_000040 (continue with --resume auto)

instead of only torchrun's "Root Cause" block (which it still prints first), and exits with the
dead rank's code (128 + the signal's number for a signal, as a shell reports it). The checkpoint
is the newest complete step directory under the script's --out (its default when not given):
saves are written as step_N.tmp and renamed once complete, so a rank dying mid-save leaves the
previous one usable.
"""

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what an exit code or signal of a rank most likely means (the scripts' own codes: common/run/cli.py)
EXIT_CODES = {
    1: "an error (its traceback is above)",
    2: "a usage error (its one-line message is above)",
    3: "the run diverged: non-finite numbers (the message above says where)",
    4: "a checkpoint could not be written (the message above says why)",
}
SIGNALS = {
    signal.SIGKILL: "most likely the host ran out of memory (check `dmesg` / the job's memory limit)",
    signal.SIGTERM: "stopped from outside (a scheduler's preemption or time limit, or a kill)",
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGSEGV: "a crash in native code (CUDA, NCCL, a driver or an extension)",
    signal.SIGBUS: "a crash in native code, or shared memory (/dev/shm) ran out",
    signal.SIGABRT: "aborted by native code (CUDA, NCCL or a C++ check; its message is above)",
}


def describe(rank, failure, host, cause=True):
    """One failed rank, in words (failure: torchelastic's ProcessFailure), with the likely cause;
    and its exit code for the shell."""
    who = f"rank {rank} (local rank {failure.local_rank} on {host}, pid {failure.pid})"
    if failure.exitcode < 0:
        number = -failure.exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        what = f"{who} was killed by signal {number} ({name})"
        return what + (f": {SIGNALS.get(number, 'stopped by a signal')}" if cause else ""), 128 + number
    what = f"{who} exited with code {failure.exitcode}"
    return what + (f": {EXIT_CODES.get(failure.exitcode, 'see its output above')}" if cause else ""), failure.exitcode


def root_cause(failures):
    """(rank, failure) that most likely started it. After a failure torchrun stops the other ranks
    with SIGTERM, and ranks whose peer died fail in their collectives, so: a rank killed by another
    signal first (it came from outside: the OOM killer, a crash), then one that exited with an
    error, a SIGTERM last; within each, torchrun's order (the earliest error file)."""
    order = list(failures)

    def rank_key(rank):
        code = failures[rank].exitcode
        kind = 0 if code < 0 and -code != signal.SIGTERM else 1 if code > 0 else 2
        return kind, failures[rank].timestamp, order.index(rank)

    rank = min(failures, key=rank_key)
    return rank, failures[rank]


def run_out_dir(script, script_args):
    """The run's --out: from its flags, else the script's default (its build_parser()), else None."""
    for i, arg in enumerate(script_args):
        if arg == "--out" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--out="):
            return arg[len("--out=") :]
    try:
        import importlib.util

        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # its own imports (common/)
        spec = importlib.util.spec_from_file_location("_launched_script", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # the scripts import heavy things inside main() only
        known, _ = module.build_parser().parse_known_args(script_args)
        if known.out is not None:
            return known.out
        from common.run.flags_run import default_out

        return default_out(module.OUT_PREFIX, known.model, known.embedded_model)
    except (Exception, SystemExit):  # a script of another shape, flags it refuses: no checkpoint named
        return None


def last_checkpoint(out_dir):
    """What the last words say of the checkpoints under out_dir."""
    if out_dir is None:
        return "no --out found to look for checkpoints"
    sys.path.insert(0, ROOT)
    from common.train.checkpoint_dirs import candidates, check_step_dir

    root = os.path.join(out_dir, "checkpoints")
    for name in candidates(root):
        if check_step_dir(os.path.join(root, name)) is None:
            return f"the last complete checkpoint is {os.path.join(root, name)} (continue with --resume auto)"
    return f"there is no complete checkpoint in {root}: a new run starts from the beginning"


def last_words(failures, script, script_args, host):
    """The lines printed after torchrun's own report, and the exit code."""
    rank, failure = root_cause(failures)
    words, code = describe(rank, failure, host)
    others = [describe(r, f, host, cause=False)[0] for r, f in sorted(failures.items()) if r != rank]
    lines = [f"[launch] {words}; {last_checkpoint(run_out_dir(script, script_args))}"]
    lines += [f"[launch]   then {other}" for other in others]
    return "\n".join(lines), code


def main(argv):
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    try:
        torchrun(argv)
    except ChildFailedError as e:
        args = parse_args(argv)
        print(e, file=sys.stderr, flush=True)  # torchrun's own report (its "Root Cause" block)
        words, code = last_words(e.failures, args.training_script, args.training_script_args, socket.gethostname())
        print(words, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
