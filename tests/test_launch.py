"""Tests of launch/*.sh: syntax, the torchrun command slurm.sh runs (srun/scontrol stubbed), and
which python local.sh runs, and a plain `python script.py` start (common/run/dist.py).

    .venv/bin/python -m pytest -q tests/test_launch.py
"""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["launch/slurm.sh", "launch/local.sh"])
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, script)], check=True)


def stub(path, body):
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_slurm_forwards_args(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun prints one argument per line so quoting is checked too
    stub(bin_dir / "srun", 'printf "SRUN_ARG<%s>\\n" "$@"\n')
    stub(bin_dir / "scontrol", '[ "$1 $2 $3" = "show hostnames gpu-[03-04]" ] && printf "gpu-03\\ngpu-04\\n"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "GPUS_PER", "MASTER_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_NODELIST="gpu-[03-04]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="8",
    )
    (tmp_path / "train_grpo.py").touch()  # the job runs where it was submitted from
    args = ["train_grpo.py", "--model", "/models/Qwen 2", "--tp", "4"]
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/slurm.sh"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    srun_args = [line[len("SRUN_ARG<") : -1] for line in proc.stdout.splitlines() if line.startswith("SRUN_ARG<")]
    torchrun = srun_args[srun_args.index("torchrun") :]
    assert torchrun == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "gpu-03:29500",
        "--rdzv_id",
        "4242",
        *args,
    ]
    assert "--container-image" not in srun_args

    env.update(GPUS_PER_NODE="4", MASTER_PORT="12345", CONTAINER_IMAGE="img.sqsh")
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/slurm.sh"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    srun_args = [line[len("SRUN_ARG<") : -1] for line in proc.stdout.splitlines() if line.startswith("SRUN_ARG<")]
    assert srun_args[srun_args.index("--container-image") + 1] == "img.sqsh"
    torchrun = srun_args[srun_args.index("torchrun") :]
    assert torchrun[torchrun.index("--nproc_per_node") + 1] == "4"
    assert torchrun[torchrun.index("--rdzv_endpoint") + 1] == "gpu-03:12345"

    # the script in the repository: torchrun through launch/torchrun.py beside it (last words)
    script = os.path.join(ROOT, "train_grpo.py")
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/slurm.sh"), script, "--tp", "4"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    srun_args = [line[len("SRUN_ARG<") : -1] for line in proc.stdout.splitlines() if line.startswith("SRUN_ARG<")]
    launcher = srun_args.index("python")
    assert srun_args[launcher : launcher + 3] == ["python", os.path.join(ROOT, "launch", "torchrun.py"), "--nnodes"]
    assert srun_args[-3:] == [script, "--tp", "4"]


def test_local_forwards_args(tmp_path):
    fake_python = tmp_path / "python"
    stub(fake_python, 'printf "ARG<%s>\\n" "$@"\n')
    env = dict(os.environ, PYTHON=str(fake_python))
    env.pop("NPROC", None)
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/local.sh"), "train_grpo.py", "--tp", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == ["ARG<train_grpo.py>", "ARG<--tp>", "ARG<1>"]
    env["NPROC"] = "8"
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/local.sh"), "train_grpo.py", "--tp", "4"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == [  # torchrun, through launch/torchrun.py (its last words)
        f"ARG<{os.path.join(ROOT, 'launch', 'torchrun.py')}>",
        "ARG<--standalone>",
        "ARG<--nproc_per_node>",
        "ARG<8>",
        "ARG<train_grpo.py>",
        "ARG<--tp>",
        "ARG<4>",
    ]


def test_local_picks_repo_venv_then_python3(tmp_path):
    """Without $PYTHON: the repository's .venv/bin/python when it exists (torchrun through it
    too), else python3 from PATH. A copy of local.sh in a fake repo, so the real .venv is not used."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True)
    script = repo / "launch" / "local.sh"
    script.write_text(open(os.path.join(ROOT, "launch/local.sh")).read())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir / "python3", 'printf "PY3<%s>\\n" "$@"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "NPROC")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    (tmp_path / "train_grpo.py").touch()

    def launch(**extra_env):
        return subprocess.run(
            ["bash", str(script), "train_grpo.py", "--tp", "2"],
            env=dict(env, **extra_env),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()

    assert launch() == ["PY3<train_grpo.py>", "PY3<--tp>", "PY3<2>"]
    (repo / ".venv" / "bin").mkdir(parents=True)
    stub(repo / ".venv" / "bin" / "python", 'printf "VENV<%s>\\n" "$@"\n')
    assert launch() == ["VENV<train_grpo.py>", "VENV<--tp>", "VENV<2>"]
    assert launch(NPROC="2") == [
        f"VENV<{repo / 'launch' / 'torchrun.py'}>",
        "VENV<--standalone>",
        "VENV<--nproc_per_node>",
        "VENV<2>",
        "VENV<train_grpo.py>",
        "VENV<--tp>",
        "VENV<2>",
    ]
    # an explicit PYTHON still wins
    stub(bin_dir / "mypython", 'printf "MINE<%s>\\n" "$@"\n')
    assert launch(PYTHON=str(bin_dir / "mypython"))[0] == "MINE<train_grpo.py>"


def test_slurm_passes_the_time_limit_signal_on_and_requeues(tmp_path):
    """SIGUSR1 to the batch script (Slurm's --signal=B:USR1@300) reaches srun, and the job
    requeues itself once srun has exited; a requeued attempt adds `--resume auto`."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    # srun: records its arguments and a USR1, then exits like ranks that saved and stopped
    stub(
        bin_dir / "srun",
        f'trap \'echo GOT_USR1 >> {log}; exit 0\' USR1\nprintf "ARG<%s>\\n" "$@" >> {log}\n'
        f"echo READY >> {log}\nfor i in $(seq 600); do sleep 0.1; done\n",
    )
    stub(
        bin_dir / "scontrol",
        f'[ "$1" = requeue ] && echo "REQUEUE $2" >> {log}\n[ "$1 $2" = "show hostnames" ] && echo gpu-01\nexit 0\n',
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "GPUS_PER", "MASTER_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_NODELIST="gpu-01",
        SLURM_NNODES="1",
        SLURM_JOB_ID="77",
        SLURM_GPUS_ON_NODE="8",
        SLURM_RESTART_COUNT="1",
    )
    (tmp_path / "train_grpo.py").touch()
    proc = subprocess.Popen(
        ["bash", os.path.join(ROOT, "launch/slurm.sh"), "train_grpo.py", "--out", "runs/x"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 30
    while time.time() < deadline and not (log.exists() and "READY" in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    lines = log.read_text().splitlines()
    assert proc.returncode == 0, out
    assert "GOT_USR1" in lines and "REQUEUE 77" in lines, (lines, out)
    args = [line[4:-1] for line in lines if line.startswith("ARG<")]
    assert args[-5:] == ["train_grpo.py", "--out", "runs/x", "--resume", "auto"]


def test_launch_mistakes_are_one_line_and_exit_2(tmp_path):
    """A missing or misplaced script, a bad NPROC / GPUS_PER_NODE / VENV, slurm.sh outside a Slurm
    job: one line saying what to do instead, exit 2, and nothing started (python, srun)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "srun", "scontrol"):  # anything started leaves a trace
        stub(bin_dir / name, f"echo STARTED >> {tmp_path / 'started'}\n")
    (tmp_path / "train_grpo.py").touch()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER", "VENV", "NPROC"))}
    base.update(PATH=f"{bin_dir}:{base['PATH']}", PYTHON=str(bin_dir / "python"))
    slurm = dict(base, SLURM_JOB_NODELIST="gpu-01", SLURM_NNODES="1", SLURM_JOB_ID="7", SLURM_GPUS_ON_NODE="8")
    cases = [
        ("local.sh", [], base, "no script given"),
        ("local.sh", ["--model", "x"], base, "the first argument is the script to run, not the flag --model"),
        ("local.sh", ["train_grpo_.py"], base, "no such script: train_grpo_.py"),
        ("local.sh", ["train_grpo.py"], dict(base, NPROC="two"), "NPROC must be a number of ranks >= 1, not 'two'"),
        ("local.sh", ["train_grpo.py"], dict(base, PYTHON="/nonexistent/python"), "set PYTHON="),
        ("slurm.sh", [], slurm, "no script given"),
        ("slurm.sh", ["--nodes", "2"], slurm, "sbatch's options go before launch/slurm.sh"),
        ("slurm.sh", ["train_grpo.py"], base, "not inside a Slurm job"),
        ("slurm.sh", ["train_grpo_.py"], slurm, "no such script: train_grpo_.py"),
        ("slurm.sh", ["train_grpo.py"], dict(slurm, GPUS_PER_NODE="eight"), "GPUS_PER_NODE must be a number"),
        ("slurm.sh", ["train_grpo.py"], dict(slurm, VENV=str(tmp_path)), "has no bin/activate"),
    ]
    for script, args, env, says in cases:
        proc = subprocess.run(
            ["bash", os.path.join(ROOT, "launch", script), *args], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (script, args, proc.stderr)
        assert lines[0].startswith(f"launch/{script}: error: ") and proc.stdout == ""
    assert not (tmp_path / "started").exists()


def test_plain_python_binds_no_port_it_picked_earlier():
    """A plain `python script.py` (a world of one) keeps torch.distributed's store in memory: on a
    GPU machine running tests side by side, the port common/run/dist.py had picked was taken by
    another process before the TCP store bound it (EADDRINUSE, no step run). Here the port it
    picks is one already listening."""
    code = (
        "import socket, torch.distributed as dist\n"
        "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
        "from common.run import dist as d\n"
        "d._free_port = lambda: held.getsockname()[1]\n"
        "info = d.init_distributed()\n"
        "print('world', info.world_size, dist.get_world_size())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world 1 1" in proc.stdout


def test_local_stop_saves_the_step_in_progress_and_exits_0(tmp_path):
    """`NPROC=2 bash launch/local.sh train_grpo.py` (real torchrun, gloo) receiving SIGTERM mid-run:
    the signal reaches the ranks, not torchrun (which would kill them after its grace period and
    exit 1): they finish the step in progress, publish its checkpoint, and the launch exits 0."""
    import json
    import signal
    import time

    out = tmp_path / "run"
    small = ["--prompts-per-step", "8", "--samples-per-prompt", "4", "--micro-batch-size", "4"]
    small += ["--mini-batch-size", "16", "--max-new-tokens", "4"]
    env = dict(os.environ, NPROC="2", PYTHONWARNINGS="ignore", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        ["bash", os.path.join(ROOT, "launch/local.sh"), "train_grpo.py", *small, "--steps", "40", "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 2 <= len(steps) < 40 and steps == list(range(len(steps)))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{len(steps):06d}" and (out / "checkpoints" / latest / "complete").is_file()


def test_local_last_words_when_a_rank_is_killed(tmp_path):
    """A rank SIGKILLed mid-run (as the kernel's OOM killer does) under launch/local.sh: the
    launcher's last lines name that rank, the signal and its likely cause, and the last complete
    checkpoint (still loadable: step directories are published only once complete), and it exits
    with 128 + 9. The run: 2 ranks on gloo, the embedded model, a checkpoint every step."""
    import signal
    import time

    import psutil

    from common.train.checkpoint_dirs import check_step_dir

    out = tmp_path / "run"
    env = dict(os.environ, NPROC="2", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        ["bash", os.path.join(ROOT, "launch/local.sh"), "train_grpo.py", "--steps", "200", "--save-every", "1"]
        + ["--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started = time.time()
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "checkpoints" / "latest").exists() and proc.poll() is None:
            time.sleep(0.2)
        assert (out / "checkpoints" / "latest").exists(), proc.communicate(timeout=60)[0][-3000:]
        # the ranks: children of torchrun's agent, which local.sh started; rank 1 by its environment
        ranks = {
            int(p.environ().get("RANK", -1)): p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "RANK" in p.environ()
        }
        ranks[1].send_signal(signal.SIGKILL)
        killed = time.time()
        output, _ = proc.communicate(timeout=120)
        print(f"started -> first checkpoint {killed - started:.0f} s, kill -> exit {time.time() - killed:.0f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = output.strip().splitlines()
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert proc.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert lines[-2].startswith(f"[launch] rank 1 (local rank 1 on {socket.gethostname()}, pid {ranks[1].pid})")
    assert "was killed by signal 9 (SIGKILL): most likely the host ran out of memory (check `dmesg`" in lines[-2]
    assert lines[-2].endswith(
        f"the last complete checkpoint is {out / 'checkpoints' / latest} (continue with --resume auto)"
    )
    # rank 0 then failed in a collective with its peer gone, or was stopped by torchrun (SIGTERM)
    assert lines[-1].startswith("[launch]   then rank 0 (local rank 0")
    assert "Root Cause" in output  # torchrun's own report comes before
    assert check_step_dir(str(out / "checkpoints" / latest)) is None  # complete: every file there, whole


def test_last_words_pick_the_root_cause_and_the_checkpoint(tmp_path, monkeypatch):
    """launch/torchrun.py's words without processes: the rank killed by a signal from outside is
    the cause even when another rank's error came first, then an error before torchrun's SIGTERMs;
    the checkpoint under the script's default --out when none is given (train_ppo.py without
    --model: runs/ppo-embedded), skipping an incomplete newest one; exit codes as a shell reports them."""
    import types

    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import torchrun

    def failure(local_rank, exitcode, timestamp):
        return types.SimpleNamespace(
            local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, timestamp=timestamp
        )

    monkeypatch.chdir(tmp_path)
    script = os.path.join(ROOT, "train_ppo.py")
    words, code = torchrun.last_words({0: failure(0, 1, 5), 3: failure(3, -9, 7)}, script, [], "node-a")
    assert code == 137 and words.splitlines() == [
        "[launch] rank 3 (local rank 3 on node-a, pid 103) was killed by signal 9 (SIGKILL): most likely the host "
        "ran out of memory (check `dmesg` / the job's memory limit); there is no complete checkpoint in "
        "runs/ppo-embedded/checkpoints: a new run starts from the beginning",
        "[launch]   then rank 0 (local rank 0 on node-a, pid 100) exited with code 1",
    ]
    root = tmp_path / "x" / "checkpoints"
    for step in (2, 3):
        (root / f"step_00000{step}").mkdir(parents=True)
        (root / f"step_00000{step}" / "a.distcp").write_text("data")
    (root / "step_000002" / "complete").write_text(json.dumps({"files": {"a.distcp": 4}}))
    (root / "latest").write_text("step_000003")  # its marker missing: not complete
    words, code = torchrun.last_words({1: failure(1, -15, 1), 0: failure(0, 3, 2)}, script, ["--out=x"], "n")
    assert code == 3 and words.splitlines()[0] == (
        "[launch] rank 0 (local rank 0 on n, pid 100) exited with code 3: the run diverged: non-finite numbers "
        "(the message above says where); the last complete checkpoint is x/checkpoints/step_000002 "
        "(continue with --resume auto)"
    )
    assert torchrun.run_out_dir("/nowhere/script.py", ["--lr", "1"]) is None


def test_slurm_says_the_ranks_stopped(tmp_path):
    """srun ending non-zero (a rank killed on some node): slurm.sh exits with its code and points at
    the [launch] lines the failing node printed (or srun's errors for a lost node)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir / "srun", "exit 137\n")
    stub(bin_dir / "scontrol", 'printf "gpu-01\\n"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "GPUS_PER", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="gpu-01", SLURM_NNODES="1", SLURM_JOB_ID="9")
    (tmp_path / "train_grpo.py").write_text("")  # slurm.sh checks that the script exists
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "launch/slurm.sh"), "train_grpo.py"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 137
    assert proc.stderr.strip().splitlines()[-1] == (
        "job 9: the ranks stopped (srun exit code 137); see the [launch] lines above, or srun's errors for a node "
        "that was lost"
    )


def test_the_gpu_tests_launcher_shows_where_a_hung_process_was():
    """tests/gpu/script_runs.py launch_checked: past its timeout every process below the launch gets SIGABRT
    (Python's fault handler on), and the test fails with their stacks: a hang on the GPU machine reads as where."""
    from tests.gpu.script_runs import launch_checked

    child = "import time\\ndef stuck():\\n  time.sleep(60)\\nstuck()"
    hung = f"import subprocess, sys; subprocess.run([sys.executable, '-c', '{child}'])"
    with pytest.raises(pytest.fail.Exception, match=r"(?s)no exit within 2 s.*line 3 in stuck"):
        launch_checked([sys.executable, "-c", hung], timeout=2)
    assert launch_checked([sys.executable, "-c", "print('done')"], timeout=30).strip() == "done"
