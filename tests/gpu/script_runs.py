"""What the GPU tests that launch a training script share: the launch (plain python, or torchrun on
`ranks` GPUs), its exit 0, the metrics.jsonl it wrote, and a results file under $OUT.

    rows, output = run_script("train_grpo.py", out, "--model", model, *flags, ranks=2, timeout=500)
    save_results("lora.json", results)
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script, out, *flags, ranks=None, timeout=400):
    """(rows of <out>/metrics.jsonl, stdout + stderr) of `script flags --out out`, run from the repository
    root with wandb off; ranks: under torchrun --standalone with that many processes (None: plain python).
    A non-zero exit fails the test with the output's tail."""
    launch = [sys.executable]
    if ranks is not None:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    output = launch_checked([*launch, script, *map(str, flags), "--out", str(out)], timeout)
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return rows, output


def launch_checked(cmd, timeout, cwd=ROOT):
    """stdout + stderr of cmd (wandb off, Python's fault handler on), run from the repository root; a non-zero
    exit fails the test with the output's tail. Past `timeout` seconds every process the launch started gets
    SIGABRT first, so that the failure shows where each rank's threads were (a hang), then the test fails."""
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):  # the ranks (and their helpers) before torchrun itself
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        try:  # the stacks written, the launcher (torchrun) sees its ranks end
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))}: no exit within {timeout} s; the stacks at SIGABRT:\n{output[-12000:]}")
    assert proc.returncode == 0, output[-4000:]
    return output


def descendants(pid):
    """Every process below pid (from /proc), deepest first."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        except (ValueError, OSError, IndexError):
            continue
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found[::-1]


def kept(rows, keys):
    """Each row's values of `keys` (those it has)."""
    return [{k: r[k] for k in keys if k in r} for r in rows]


def save_results(name, results):
    """$OUT/name as JSON (run_all.sh collects $OUT), when $OUT is set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(results, f, indent=1)
