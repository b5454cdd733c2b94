"""Shared pytest fixtures and the torchrun launcher used by the multi-rank tests."""

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two pytest workers on the two cores: one thread each
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The longest files first (tests/schedule.py: `make test`'s two workers finish together)."""
    from tests.schedule import load_table, longest_first

    items[:] = longest_first(items, load_table())


def run_torchrun(script, nproc, *args, timeout=600):
    """Run `torchrun --nproc_per_node nproc script args...` on gloo (CPU) from the repo root
    (through tests/zygote.py: torchrun's environment, no start-up imports).

    Returns the CompletedProcess; fails the test with the output tail when it exits non-zero.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        script,
        *map(str, args),
    ]
    proc = launch(cmd, script, args, nproc=nproc, env=script_env(TOKENIZERS_PARALLELISM="false"), timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def script_env(**more):
    """The environment a test runs a script in: one CPU thread, warnings off, wandb off; plus `more`."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled", **more)


def run_script(script, *args, timeout=900, env=None, check=True):
    """Run `python script args...` from the repo root in script_env (env: more variables; through
    tests/zygote.py); with check, fails the test with the output tail when it exits non-zero.
    Returns the CompletedProcess."""
    cmd = [sys.executable, script, *map(str, args)]
    proc = launch(cmd, script, args, env=script_env(**(env or {})), timeout=timeout)
    assert proc.returncode == 0 or not check, (proc.stdout + proc.stderr)[-5000:]
    return proc


# Variables that torch, transformers, the hub or python itself read when tests/zygote.py
# imports them (or at start-up): a launch whose environment differs from the zygote's in one
# of them runs as a real process. TESTS_REAL_PROCESSES=1 runs every launch so.
IMPORT_TIME_ENV = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL",
    "GLOO",
    "MKL",
    "KMP",
    "MPL",
    "XDG_",
    "HOME",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "LD_",
)


def import_time_env(env):
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class Forked:
    """A launch made by tests/zygote.py, as much of subprocess.Popen as the tests use: poll,
    wait, kill, returncode. pid is its launcher's, the leader of its process group."""

    def __init__(self, pid, rc_path, args):
        self.pid, self.rc_path, self.args, self.returncode = pid, rc_path, args, None

    def poll(self):
        if self.returncode is None:
            try:  # asked first: a launcher gone by now wrote its code before it went, unless it was killed
                os.kill(self.pid, 0)
                gone = False
            except ProcessLookupError:
                gone = True
            if os.path.exists(self.rc_path):
                with open(self.rc_path) as f:
                    self.returncode = int(f.read())
            elif gone:
                self.returncode = -9
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """This pytest process's tests/zygote.py, started at its first launch."""

    proc = env = has_gpu = None
    lock = threading.Lock()  # launches from several threads of one test (one request and reply at a time)

    @classmethod
    def start(cls, script, args, *, nproc, torchrun, env, out, err):
        """A Forked for this launch, or None where it must be a real process."""
        with cls.lock:
            return cls._start(script, args, nproc=nproc, torchrun=torchrun, env=env, out=out, err=err)

    @classmethod
    def _start(cls, script, args, *, nproc, torchrun, env, out, err):
        if os.environ.get("TESTS_REAL_PROCESSES") == "1" or cls.gpu():
            return None
        # A new zygote when there is none, or when this worker's own environment has changed since
        # it started in a variable read at import: tests that run code in-process add some (torch
        # writes TORCHINDUCTOR_CACHE_DIR at its first compile, common/run/console.py sets
        # HF_HUB_DISABLE_PROGRESS_BARS on ranks other than 0), and every later launch would
        # otherwise differ from the zygote and run as a real process. Launches already forked
        # are their own sessions: the old zygote's exit leaves them running.
        base = script_env()
        if cls.proc is None or cls.proc.poll() is not None or import_time_env(base) != import_time_env(cls.env):
            if cls.proc is None:
                atexit.register(cls.stop)
            cls.stop()
            cls.env = base
            cls.proc = subprocess.Popen(
                [sys.executable, "tests/zygote.py"],
                cwd=ROOT,
                env=cls.env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        if import_time_env(env) != import_time_env(cls.env):  # this launch's own variables
            return None
        request = dict(
            script=script,
            args=[str(a) for a in args],
            env=env,
            cwd=ROOT,
            nproc=nproc,
            torchrun=torchrun,
            out=out,
            err=err,
            rc=out + ".rc",
        )
        try:
            cls.proc.stdin.write(json.dumps(request) + "\n")
            cls.proc.stdin.flush()
            reply = cls.proc.stdout.readline()
        except OSError:
            reply = ""
        if not reply:  # the zygote died (its imports failed?): real processes from here
            cls.proc.kill()
            os.environ["TESTS_REAL_PROCESSES"] = "1"
            return None
        return Forked(json.loads(reply)["pid"], request["rc"], [script, *map(str, args)])

    @classmethod
    def gpu(cls):
        """Whether this machine has a GPU: there every launch is a real process, as the GPU suite
        has always run them (CUDA in a fork of a process that asked the driver anything is not
        safe, and the launches there are few)."""
        if cls.has_gpu is None:
            import torch

            cls.has_gpu = torch.cuda.is_available()
        return cls.has_gpu

    @classmethod
    def stop(cls):
        """At this pytest process's exit, or before a new zygote starts: the zygote reads the end of
        its input and exits."""
        if cls.proc is not None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(10)
            except subprocess.TimeoutExpired:
                cls.proc.kill()


def start(cmd, script, args, *, env, stdout, stderr, nproc=1, torchrun=False):
    """cmd (`python script args` or torchrun's) started now, through the zygote where it can:
    its output appended to the files at paths stdout and stderr (the same path: merged)."""
    forked = Zygote.start(script, args, nproc=nproc, torchrun=torchrun, env=env, out=stdout, err=stderr)
    if forked is not None:
        return forked
    out = open(stdout, "a")
    err = out if stderr == stdout else open(stderr, "a")
    try:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=out, stderr=err)
    finally:
        out.close()
        err.close()


def launch(cmd, script, args, *, env, timeout, nproc=1):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) from the repo root,
    through the zygote where it can (torchrun's when cmd is torchrun's)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        open(out, "w").close()
        open(err, "w").close()
        proc = start(
            cmd,
            script,
            args,
            env=env,
            stdout=out,
            stderr=err,
            nproc=nproc,
            torchrun=cmd[1:3] == ["-m", "torch.distributed.run"],
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        with open(out) as f_out, open(err) as f_err:
            return subprocess.CompletedProcess(cmd, proc.returncode, f_out.read(), f_err.read())


class Background:
    """`python script args...` started now, as run_script runs it (script_env), its output going
    to a temporary file; wait() fails the test with the output tail unless it exited 0, and
    returns the output."""

    def __init__(self, script, *args):
        self.tmp = tempfile.TemporaryDirectory()
        self.log = os.path.join(self.tmp.name, "log")
        open(self.log, "w").close()
        self.proc = start(
            [sys.executable, script, *map(str, args)], script, args, env=script_env(), stdout=self.log, stderr=self.log
        )

    def wait(self, timeout=900):
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        with open(self.log) as f:
            output = f.read()
        self.tmp.cleanup()
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
    args = [",".join(str(tmp_path / n) for n in names), mode]
    proc = launch(
        [sys.executable, "tests/batch_worker.py", *args], "tests/batch_worker.py", args, env=script_env(), timeout=600
    )
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


def embedded_grpo_run(model, steps, out):
    """train_grpo.py on --embedded-model `model` for `steps` steps (validation halfway and at the end, no KL
    term, no sample printing): its step records, the rewards printed with the first step's logprob mismatch."""
    run_script(
        "train_grpo.py",
        *("--embedded-model", model, "--steps", steps, "--eval-every", steps // 2),
        *("--kl-coef", 0, "--log-samples-every", 0, "--out", out),
    )
    rows = read_metrics(out)
    print("reward", [round(m["reward_mean"], 3) for m in rows], "mismatch", rows[0]["logprob_mismatch"])
    return rows


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
    uneven stages, common/model/bridge.py:pipeline_layout): llama_3layers (tied embeddings; PP=2:
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
