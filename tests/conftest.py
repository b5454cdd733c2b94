"""Shared pytest fixtures and the torchrun launcher used by the multi-rank tests."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two pytest workers on the two cores: one thread each
    import torch

    torch.set_num_threads(1)


def run_torchrun(script, nproc, *args, timeout=600):
    """Run `torchrun --nproc_per_node nproc script args...` on gloo (CPU) from the repo root.

    Returns the CompletedProcess; fails the test with the output tail when it exits non-zero.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", script, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(TOKENIZERS_PARALLELISM="false"), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def script_env(**more):
    """The environment a test runs a script in: one CPU thread, warnings off, wandb off; plus `more`."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled", **more)


def run_script(script, *args, timeout=900, env=None, check=True):
    """Run `python script args...` from the repo root in script_env (env: more variables); with
    check, fails the test with the output tail when it exits non-zero. Returns the
    CompletedProcess."""
    proc = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, env=script_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 or not check, (proc.stdout + proc.stderr)[-5000:]
    return proc


class Background:
    """`python script args...` started now, as run_script runs it (script_env), its output going
    to a temporary file; wait() fails the test with the output tail unless it exited 0, and
    returns the output."""

    def __init__(self, script, *args):
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, script, *map(str, args)], cwd=ROOT, env=script_env(), text=True,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout=900):
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        assert code == 0, output[-5000:]
        return output


def run_scripts(*commands, timeout=900):
    """Several independent run_script commands, (script, *args) each, at once: two one-thread
    runs take a 2-core machine as long as one. Fails the test if any exits non-zero."""
    started = [Background(*command) for command in commands]
    try:
        return [run.wait(timeout) for run in started]
    finally:
        for run in started:
            if run.proc.poll() is None:
                run.proc.kill()


def run_batch_worker(tmp_path, mode, names):
    """tests/batch_worker.py MODE (wgrad, dispatch) over these tiny models of tests/tiny_models.py,
    saved under tmp_path, all in one process (each launch spends seconds importing torch and
    megatron): its RESULT dicts, one per model, in the order of names."""
    from tests.tiny_models import save_tiny_hf_model

    for name in names:
        save_tiny_hf_model(name, str(tmp_path / name))
    proc = subprocess.run([sys.executable, "tests/batch_worker.py", ",".join(str(tmp_path / n) for n in names), mode],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=script_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["model"] for r in results] == list(names)
    return results


class LayoutLaunches:
    """A test worker (tests/layouts.py) over the layouts {name: (nproc, flags)} after the flags
    `base`, one torchrun launch per process count, made when a test first asks for one of its
    layouts: every layout its own test, without a torchrun start-up each."""

    def __init__(self, script, layouts, base, out_dir):
        self.script, self.layouts, self.base, self.out_dir, self.results = script, layouts, base, out_dir, {}

    def __getitem__(self, name):
        nproc = self.layouts[name][0]
        if name not in self.results:
            group = {n: [str(f) for f in flags] for n, (p, flags) in self.layouts.items() if p == nproc}
            out = self.out_dir / f"{len(self.results)}.json"
            run_torchrun(self.script, nproc, *self.base, "--layouts", json.dumps(group), "--out", out)
            self.results.update(json.loads(out.read_text()))
        return self.results[name]


def assert_every_flag_documented(parser):
    """Every argparse action of a public script has a non-empty help string."""
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"


def read_metrics(out_dir):
    """The step records of a training run's metrics.jsonl."""
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory):
    """Every tiny HF model of tests/tiny_models.py saved once per session (qwen3 sharded)."""
    from tests.tiny_models import ARCH_CONFIGS, save_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_models")
    for name in ARCH_CONFIGS:
        save_tiny_hf_model(name, str(root / name), max_shard_size="20KB" if name == "qwen3" else None)
    return root


@pytest.fixture(scope="session")
def uneven_models_dir(tmp_path_factory):
    """Tiny models whose layers do not divide by the pipeline stages of the tests (megatron's
    uneven stages, common/bridge.py:pipeline_layout): llama_3layers (tied embeddings; PP=2:
    2 + 1 layers) and qwen2_6layers (PP=2 x VPP=2: 4 + 2)."""
    from tests.tiny_models import save_tiny_hf_model

    root = tmp_path_factory.mktemp("uneven_models")
    for name, layers in (("llama", 3), ("qwen2", 6)):
        save_tiny_hf_model(name, str(root / f"{name}_{layers}layers"), layers=layers)
    return root


@pytest.fixture(scope="session")
def tiny_moe_models_dir(tmp_path_factory):
    """The Mixture-of-Experts tiny HF models of tests/tiny_models.py (MOE_CONFIGS), saved once
    per session in the hub's per-expert layout."""
    from tests.tiny_models import MOE_CONFIGS, save_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_moe_models")
    for name in MOE_CONFIGS:
        save_tiny_hf_model(name, str(root / name))
    return root
