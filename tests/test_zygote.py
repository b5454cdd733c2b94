"""The suite's launcher (tests/zygote.py through tests/conftest.py's launch): a forked launch
behaves as `python script` or torchrun does where the tests look: exit codes, output, the
environment of each rank, a failing rank stopping the others, timeouts."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import Zygote, launch, script_env

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    mode = sys.argv[1]
    print(json.dumps(dict(file=__file__, argv=sys.argv, rank=os.environ.get("RANK"),
                          world=os.environ.get("WORLD_SIZE"), extra=os.environ.get("EXTRA"))), flush=True)
    if mode == "raise":
        raise ValueError("on purpose")
    if mode == "exit3":
        sys.exit(3)
    if mode == "rank1_fails":
        if os.environ["RANK"] == "1":
            sys.exit(5)
        time.sleep(60)
    if mode == "sleep":
        with open(os.environ["PIDS"] + os.environ["RANK"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    if mode == "thread":  # a non-daemon thread is joined before exit, as the interpreter does
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
""")


def run(tmp_path, mode, nproc=None, timeout=60, **env):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    torchrun = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc else [sys.executable]
    )
    return launch(
        [*torchrun, str(script), mode], str(script), [mode], env=script_env(**env), timeout=timeout, nproc=nproc or 1
    )


def lines(proc):
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_python_launch(tmp_path):
    proc = run(tmp_path, "ok", EXTRA="x")
    assert proc.returncode == 0 and Zygote.proc is not None and Zygote.proc.poll() is None  # it went through the zygote
    [out] = lines(proc)
    assert out["file"] == str(tmp_path / "script.py") and out["argv"][1:] == ["ok"]
    assert (out["rank"], out["world"], out["extra"]) == (None, None, "x")  # plain python: no torchrun variables
    assert run(tmp_path, "exit3").returncode == 3
    proc = run(tmp_path, "raise")
    assert proc.returncode == 1 and "ValueError: on purpose" in proc.stderr
    proc = run(tmp_path, "thread")
    assert proc.returncode == 0 and "thread done" in proc.stdout


def test_torchrun_launch(tmp_path):
    proc = run(tmp_path, "ok", nproc=2)
    assert proc.returncode == 0
    assert sorted((o["rank"], o["world"]) for o in lines(proc)) == [("0", "2"), ("1", "2")]
    start = time.monotonic()
    proc = run(tmp_path, "rank1_fails", nproc=2)  # rank 0 would sleep 60 s: stopped when rank 1 fails
    assert proc.returncode == 5 and time.monotonic() - start < 30


def test_timeout_kills_the_launch(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run(tmp_path, "sleep", nproc=2, timeout=5, PIDS=str(tmp_path / "pid"))
    assert time.monotonic() - start < 20
    for rank in (0, 1):  # both ranks killed with their launcher: gone, or a zombie nobody reaps, within 5 s
        pid = (tmp_path / f"pid{rank}").read_text()
        deadline = time.monotonic() + 5
        while process_state(pid) not in (None, "Z"):
            assert time.monotonic() < deadline, f"rank {rank} (pid {pid}) still {process_state(pid)}"
            time.sleep(0.05)


def process_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0]
    except FileNotFoundError:
        return None
