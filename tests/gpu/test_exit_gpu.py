"""Every launch mode of train_grpo.py on a GPU exits soon after its last step, with its
output going through a pipe (a process started by megatron's checkpoint machinery
outlived the run and held stdout open, so `python train_grpo.py | tee log` never ended).

    python -m pytest -q -s tests/gpu/test_exit_gpu.py     (GPU machine, stack of shared/device)

The embedded default model with vLLM, 3 steps, a checkpoint at every step (the saves run in
the background; the last one is awaited). Measured: from the last metrics.jsonl line to the
end of the piped output (EOF: every process holding the pipe has exited) <= 10 s, exit 0,
and the last checkpoint complete. Also SIGTERM during the run: the ranks save and exit 0.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ["--steps", "3", "--save-every", "1", "--prompts-per-step", "32", "--samples-per-prompt", "4"]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def launch(mode, out, extra=()):
    if mode == "python":
        cmd = [sys.executable, "train_grpo.py"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            mode[-1],
            "train_grpo.py",
        ]
    # stdout is a pipe, as with `| tee`; EOF comes only when no process holds it any more
    return subprocess.Popen(
        cmd + [*extra, "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )


def modes():
    found = ["python", "torchrun1"]
    return found + (["torchrun2"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("mode", modes())
def test_exits_within_10_s_of_the_last_step(mode, tmp_path):
    proc = launch(mode, tmp_path, STEPS)
    output = proc.stdout.read()  # returns at EOF
    eof = time.time()
    code = proc.wait(timeout=60)
    assert (tmp_path / "metrics.jsonl").is_file(), f"exit {code}, no step finished:\n{output[-4000:]}"
    last_step = os.path.getmtime(tmp_path / "metrics.jsonl")
    print(f"{mode}: exit {code}, EOF {eof - last_step:.1f} s after the last step's metrics line")
    assert code == 0, output[-4000:]
    assert eof - last_step <= 10, output[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (tmp_path / "checkpoints" / "step_000003" / "complete").is_file()


def test_sigterm_saves_and_exits(tmp_path):
    proc = launch("python", tmp_path, ["--steps", "200", "--prompts-per-step", "32", "--samples-per-prompt", "4"])
    lines = []  # drained while we wait: a full pipe (64 KiB of logs) would block the run before its second step
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    path = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= 2):
        assert proc.poll() is None, "".join(lines)[-4000:]
        time.sleep(0.2)
    assert path.exists() and len(path.read_text().splitlines()) >= 2, "".join(lines)[-4000:]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    output = "".join(lines)
    steps = len(path.read_text().splitlines())
    print(f"SIGTERM after {steps} steps: exit {proc.returncode}")
    assert proc.returncode == 0, output[-4000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{steps:06d}"
