"""The CPU suite's launcher: imports torch, transformers and megatron-core once, then starts
each script a test runs (`python script` or torchrun's ranks) as a fork of itself.

Each such process otherwise spends ~13 s importing them (more on a loaded 2-core machine) before
doing a few seconds of work: most of the suite's time. tests/conftest.py starts one zygote per
pytest worker and talks to it over stdin/stdout, one JSON line per launch:

    request  {"script", "args", "env", "cwd", "nproc", "torchrun", "out", "err", "rc"}
    reply    {"pid": launcher}

For a request the zygote forks a launcher (its own process group: a test's timeout kills the
whole group), which forks the ranks: with "torchrun", nproc of them with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
OMP_NUM_THREADS=1 unless given), else one plain process. Each rank sets the request's
environment and directory, points fds 1 and 2 at the files "out" and "err" and runs the script
as `__main__`, then exits as the interpreter does (threads joined, atexit, SystemExit's code).
The launcher waits for its ranks; when one fails it stops the others (SIGTERM, then SIGKILL
after 5 s), as torchrun does, and writes the first failure's exit code (else 0) to the file
"rc". A test that needs the real launchers (tests/test_launch.py, the signal tests) starts
them itself.

Only imports that read no per-launch environment are made here: conftest.py falls back to a
real process when a request's environment differs from the zygote's in a variable that
torch, transformers or the hub read at import (tests/conftest.py IMPORT_TIME_ENV), and on a
machine with a GPU (no zygote there).
"""

import atexit
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

warnings.simplefilter("ignore")  # the suite's script_env has PYTHONWARNINGS=ignore, read at start-up
# what the scripts and workers import (common/run/log.py's curves among them), ~13 s on a 2-core machine
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "megatron.core",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.moe.moe_layer",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
for name in PRELOAD:
    importlib.import_module(name)
torch = sys.modules["torch"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(request, env):
    """In a forked rank: the environment, directory and files of `python script args...`, then the script."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count()))
    script = os.path.abspath(request["script"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(script)
    import runpy

    runpy.run_path(script, run_name="__main__")  # __file__ absolute, as python makes it since 3.9


def rank_main(request, env):
    """A forked rank: the script, then the interpreter's exit without unwinding into the
    launcher's frames (it is their fork): non-daemon threads joined, atexit run, the code."""
    code = 0
    try:
        run_rank(request, env)
    except SystemExit as e:  # sys.exit, argparse: python's rules for its code
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what Py_Finalize does first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def launch(request):
    """In the forked launcher: fork the ranks, wait for them; returns the exit code."""
    nproc = request["nproc"] if request["torchrun"] else 1
    env = dict(request["env"])
    if request["torchrun"]:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with more than one process
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            ROLE_RANK="0",
            ROLE_WORLD_SIZE=str(nproc),
            TORCHELASTIC_RUN_ID="none",
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
        )
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank_main(request, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if request["torchrun"] else env)
        ranks[pid] = rank
    code = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = rc if rc > 0 else 1
            for other in ranks:  # stop the rest, as torchrun does
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while ranks and time.monotonic() < deadline:
                done, status = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return code


def main():
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel: their code goes to a file
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)  # the pipes to the test process are the zygote's alone:
            os.dup2(devnull, 0)  # the test sees their end when the zygote ends
            os.dup2(devnull, 1)
            code = 1
            try:
                code = launch(request)
            finally:
                with open(request["rc"] + ".tmp", "w") as f:
                    f.write(str(code))
                os.rename(request["rc"] + ".tmp", request["rc"])
                os._exit(0)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
