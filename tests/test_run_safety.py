"""Run safety of the training scripts on the CPU: a run does what was asked or
stops with one line saying what to fix, and never loses a file.

    .venv/bin/python -m pytest -q tests/test_run_safety.py

- argument and input mistakes: exit 2 and one stderr line, before anything is built
  (parse_args in this process: no model, no process group);
- a flag the user gave is never replaced by the embedded model's defaults;
- --out: never overlaps the inputs, a non-empty one is refused without --resume or
  --start-over (which moves it aside), --resume refuses when there is nothing to resume;
- a NaN (lr 1e30) stops the run with exit 3 naming the step, and no checkpoint is written;
  +-Inf in logprobs, losses or gradients is stopped like NaN;
- an interrupted save (step_N.tmp) is no checkpoint for --resume / --resume auto;
- SIGTERM mid-run (one process) and SIGUSR1 through torchrun (two ranks): the step finishes,
  a checkpoint is saved, exit 0; --resume then gives the metrics of an uninterrupted run;
- merge_to_hf.py refuses a checkpoint with NaN weights and names the tensors.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import train_grpo  # noqa: E402  (the repo root is on sys.path via conftest)
import train_ppo  # noqa: E402
from tests.conftest import ROOT, Background, read_metrics, run_script, script_env

SMALL = [
    "--prompts-per-step",
    "8",
    "--samples-per-prompt",
    "4",
    "--micro-batch-size",
    "4",
    "--mini-batch-size",
    "16",
    "--max-new-tokens",
    "4",
]
TRAIN_KEYS = ["policy_loss", "grad_norm", "entropy", "kl", "clip_frac", "reward_mean", "logprob_mismatch", "lr"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A complete tiny model dir and broken copies of it, a too-small model's checkpoint stub,
    a dataset."""
    from common.run.embedded import DEFAULT_CONFIG, write_embedded_model

    root = tmp_path_factory.mktemp("inputs")
    good = write_embedded_model(str(root / "model"))
    for name, drop in (
        ("no_tokenizer", ("tokenizer.json", "tokenizer_config.json")),
        ("no_weights", ("model.safetensors",)),
        ("no_config", ("config.json",)),
    ):
        shutil.copytree(good, root / name)
        for f in drop:
            os.remove(root / name / f)
    other = root / "other_ckpt"  # what preflight reads of a checkpoint: metadata.json + hf/config.json
    (other / "hf").mkdir(parents=True)
    (other / "metadata.json").write_text("{}")
    config = json.load(open(os.path.join(good, "config.json")))
    json.dump(dict(config, hidden_size=2 * DEFAULT_CONFIG["hidden_size"]), open(other / "hf" / "config.json", "w"))
    with open(root / "data.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "What is 1+1? " * 40, "answer": "2"}) + "\n")
    return root


def parse_error(capsys, parse, argv, monkeypatch=None, world=None):
    if monkeypatch is not None and world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1, err  # one line, no usage block, no traceback
    return err


def test_argument_mistakes_are_one_line_exit_2(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = ["--out", str(tmp_path / "run")]
    cases = [  # (argv, world size, what the line must say)
        (["--temperature", "0"], 1, "--temperature must be > 0"),
        (["--steps", "0"], 1, "--steps must be >= 1"),
        (["--max-new-tokens", "0"], 1, "--max-new-tokens must be >= 1"),
        (["--samples-per-prompt", "1"], 1, "advantages of a group of one are all zero"),
        (["--micro-batch-size", "0"], 1, "--micro-batch-size must be >= 1"),
        (["--prompts-per-step", "0"], 1, "--prompts-per-step must be >= 1"),
        (["--max-new-tokens", "256"], 1, "model's 256 positions"),
        (
            ["--prompts-per-step", "3", "--samples-per-prompt", "4", "--mini-batch-size", "8"],
            1,
            "multiple of --mini-batch-size 8",
        ),
        (["--tp", "2"], 3, "world size 3 is not divisible by --tp 2"),
        (
            ["--mini-batch-size", "32", "--micro-batch-size", "32"],
            2,
            "16 samples of a mini-batch, not a multiple of --micro-batch-size 32",
        ),
        (
            ["--mini-batch-size", "32", "--micro-batch-size", "4", "--logprob-micro-batch-size", "12"],
            2,
            "16 samples of a mini-batch, not a multiple of --logprob-micro-batch-size 12",
        ),
        (["--logprob-micro-batch-size", "0"], 1, "--logprob-micro-batch-size must be >= 1"),
        (["--logprob-micro-batch-tokens", "-1"], 1, "--logprob-micro-batch-tokens must be a finite number >= 0"),
        (
            ["--pp", "3"],
            3,
            "num_hidden_layers=2 cannot be split over --pp 3: fewer layers than (virtual) pipeline stages (3)",
        ),
        (["--pp", "2", "--first-stage-layers", "2"], 2, "cannot be split over --pp 2 with --first-stage-layers 2"),
        (
            ["--last-stage-layers", "1"],
            1,
            "--first-stage-layers/--last-stage-layers size pipeline stages: they need --pp > 1",
        ),
        (["--first-stage-layers", "0"], 1, "--first-stage-layers must be >= 1, not 0"),
        (
            [
                "--prompts-per-step",
                "3",
                "--samples-per-prompt",
                "4",
                "--mini-batch-size",
                "12",
                "--micro-batch-size",
                "2",
            ],
            2,
            "multiple of the 2 rollout replicas",
        ),
        (["--model", str(inputs / "model")], 1, "--max-new-tokens 1024 leaves no room"),
        (["--model", str(inputs / "missing")], 1, "no such file or directory"),
        (["--model", str(inputs / "no_tokenizer")], 1, "has no tokenizer"),
        (["--model", str(inputs / "no_weights")], 1, "has no *.safetensors weights"),
        (["--model", str(inputs / "no_config")], 1, "has no config.json"),
        (["--model", str(inputs / "model"), "--mcore-ckpt", str(inputs / "other_ckpt")], 1, "hidden_size 128 vs 64"),
        (["--data", str(inputs / "missing.jsonl")], 1, "no such file"),
        (["--load-rollouts", str(inputs)], 1, "has 0 saved steps"),
        (["--resume", "--start-over"], 1, "pass one"),
        (["--eval-samples", "4"], 1, "--eval-temperature 0 is greedy decoding"),
        (
            ["--eval-data", str(inputs / "missing.jsonl")],
            1,
            "--eval-data " + str(inputs / "missing.jsonl") + ": no such file",
        ),
        (
            ["--overlong-buffer", "8", "--max-new-tokens", "8"],
            1,
            "--overlong-buffer 8 must be below --max-new-tokens 8",
        ),
        (["--dynamic-sampling", "--load-rollouts", str(inputs)], 1, "--dynamic-sampling samples more prompts"),
        (["--model", "Qwen2-7B"], 1, "did you mean Qwen/Qwen2-7B?"),
        (["--resume"], 1, "there is no checkpoint"),
        (["--temperature", "0.7", "--rollout-logprobs", "prefill"], 1, "which vLLM computes at temperature 1"),
        (
            ["--tis-cap", "2", "--rollout-logprobs", "prefill"],
            1,
            "--rollout-correction tis (or --tis-cap) needs the rollout logprobs of every sample",
        ),
        (["--moe-dispatcher", "allgather"], 1, "--moe-dispatcher allgather: Qwen2ForCausalLM has no experts"),
        (["--rollout-correction", "tis", "--correction-delta", "1"], 1, "--correction-delta has no meaning with"),
        (["--check-on-policy", "--rollout-logprobs", "none"], 1, "--check-on-policy compares the engine's logprobs"),
        (["--eval-only", "--start-over"], 1, "writes into <out>/eval_only/ only: drop --start-over"),
        (["--eval-only", "--lora-rank", "4"], 1, "merge the LoRA checkpoint first"),
        (["--eval-only", "--data", str(inputs / "prompts.jsonl")], 1, "pass --eval-data"),
        (["--eval-only", "--resume"], 1, "there is no checkpoint"),
    ]
    for argv, world, says in cases:
        err = parse_error(capsys, train_grpo.parse_args, argv + out, monkeypatch, world)
        assert says in err and ": error: " in err, (argv, err)
    monkeypatch.setenv("WORLD_SIZE", "1")
    # PPO shares the checks; its critic is checked too
    assert "has no config.json" in parse_error(
        capsys, train_ppo.parse_args, ["--critic-model", str(inputs / "no_config")] + out
    )
    assert "--temperature must be > 0" in parse_error(capsys, train_ppo.parse_args, ["--temperature", "0"] + out)


def test_out_never_overlaps_inputs_or_an_earlier_run(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    model = str(inputs / "model")
    for out in (model, os.path.join(model, "run"), str(inputs)):  # equal, inside, containing
        assert "overlaps --model" in parse_error(
            capsys, train_grpo.parse_args, ["--model", model, "--out", out, "--max-new-tokens", "4"]
        )
    assert "overlaps --data" in parse_error(
        capsys, train_grpo.parse_args, ["--data", str(inputs / "data.jsonl"), "--out", str(inputs)]
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "notes.txt").write_text("precious")
    assert "already holds a run" in parse_error(capsys, train_grpo.parse_args, ["--out", str(run)])
    assert (run / "notes.txt").read_text() == "precious"
    # a directory holding only what a run writes before its first step is not "a run"
    fresh = tmp_path / "fresh"
    (fresh / "embedded_model").mkdir(parents=True)
    (fresh / "metrics.jsonl").write_text("")
    train_grpo.parse_args(["--out", str(fresh)])
    # --start-over: the old run is moved aside, nothing deleted
    train_grpo.parse_args(["--out", str(run), "--start-over"])
    assert os.listdir(run) == [".run.lock"]  # a new --out, locked for the new run
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert (aside / "notes.txt").read_text() == "precious" and (aside / "metrics.jsonl").read_text() == '{"step": 0}\n'
    # --resume auto (a requeued job): no checkpoint -> a fresh start, with the old files moved aside
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    args = train_grpo.parse_args(["--out", str(run), "--resume", "auto"])
    assert args.resume is None and args.start_over and os.listdir(run) == [".run.lock"]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]) == 2


def test_an_interrupted_save_is_not_a_checkpoint(tmp_path, capsys, monkeypatch):
    """checkpoints/step_N.tmp is a save that did not finish (killed, disk full): --resume finds
    nothing to continue (exit 2, nothing changed) and --resume auto starts over."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002.tmp").mkdir(parents=True)
    (run / "checkpoints" / "step_000002.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    err = parse_error(capsys, train_grpo.parse_args, ["--out", str(run), "--resume"])
    assert "there is no checkpoint" in err, err
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000002.tmp"]
    args = train_grpo.parse_args(["--out", str(run), "--resume", "auto"])
    assert args.resume is None and args.start_over, "--resume auto took an interrupted save for a checkpoint"
    # the same directory once the save is published is one (--start-over above made a new --out)
    run.mkdir(exist_ok=True)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    assert train_grpo.parse_args(["--out", str(run), "--resume", "auto"]).resume == "yes"


def test_flags_the_user_gave_are_kept(tmp_path, monkeypatch):
    """Without --model the embedded defaults apply only to flags not given, even when the
    given value equals the generic default."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = ["--out", str(tmp_path / "a")]
    given = train_grpo.parse_args(["--steps", "200", "--entropy-coef", "0", "--lr", "1e-6"] + out)
    assert (given.steps, given.entropy_coef, given.lr) == (200, 0.0, 1e-6)
    default = train_grpo.parse_args(out)
    assert (default.steps, default.entropy_coef, default.lr) == (100, 0.02, 3e-3)
    ppo = train_ppo.parse_args(["--micro-batch-size", "8", "--critic-lr", "1e-5"] + out)
    assert (ppo.micro_batch_size, ppo.critic_lr, ppo.lr) == (8, 1e-5, 3e-3)


def test_help_says_each_default_once():
    text = train_grpo.build_parser().format_help()
    assert "(default: None)" not in text and "default: the embedded tiny model (default" not in text
    assert "(default: 1234)" in text  # --seed: defaults are still shown


def test_mistakes_found_after_start_up_are_one_line(inputs, tmp_path):
    """Every prompt too long: found after the tokenizer is loaded, still one line and exit 2."""
    proc = subprocess.run(
        [
            sys.executable,
            "train_grpo.py",
            "--model",
            str(inputs / "model"),
            "--data",
            str(inputs / "data.jsonl"),
            "--max-prompt-len",
            "16",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "every prompt of" in proc.stderr and "Traceback" not in proc.stderr


def test_nan_stops_the_run_before_the_update(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train_grpo.py", *SMALL, "--lr", "1e30", "--steps", "4", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=script_env(),
    )
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "step 1: " in last and "NaN/Inf" in last and "no optimizer step was applied" in last, last
    assert not (tmp_path / "checkpoints").exists()  # nothing non-finite was saved


FULL_DISK = """import runpy, shutil, sys
real = shutil.disk_usage
def disk_usage(path):  # the checkpoint disk is full from the second save on
    usage = real(path)
    return usage._replace(free=100_000) if "step_000002" in str(path) else usage
shutil.disk_usage = disk_usage
sys.argv = sys.argv[1:]
sys.path.insert(0, ".")  # the repository root (the working directory), as for the script itself
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    """A checkpoint whose files do not fit (here: the disk reports 0.1 MB free from the second
    save on) is not written: the run stops with one message that names the space needed and
    free, exit code 4, and `latest` stays at the first checkpoint. (A real full disk made torch's
    serializer fail with "unexpected pos 704 vs 598", which said nothing of the cause.)"""
    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(FULL_DISK)
    proc = subprocess.run(
        [
            sys.executable,
            str(wrapper),
            "train_grpo.py",
            *SMALL,
            "--steps",
            "4",
            "--save-every",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=script_env(),
    )
    assert proc.returncode == 4, (proc.stdout + proc.stderr)[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train_grpo.py: stopped: writing the training checkpoint") and "step_000002.tmp" in last
    assert "not enough disk space" in last and "0.1 MB is free" in last and "--keep-checkpoints" in last, last
    assert "Traceback" not in proc.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000001"
    assert sorted(os.listdir(checkpoints)) == ["latest", "step_000001", "step_000002.tmp"]


def _popen(cmd, out, **env):
    return subprocess.Popen(
        cmd + ["--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=script_env(**env),
    )


def _signal_after(proc, out, sig, steps_logged, timeout=300):
    """Send sig once metrics.jsonl has steps_logged lines; returns (exit code, output)."""
    deadline = time.time() + timeout
    path = out / "metrics.jsonl"
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= steps_logged):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def test_signal_saves_and_resume_continues_exactly(tmp_path):
    steps = ["--steps", "10"]
    straight_run = Background("train_grpo.py", *SMALL, *steps, "--out", tmp_path / "straight")  # beside the stopped run
    try:
        code, output = _signal_after(
            _popen([sys.executable, "train_grpo.py", *SMALL, *steps], tmp_path / "stopped"),
            tmp_path / "stopped",
            signal.SIGTERM,
            steps_logged=3,
        )
        assert code == 0, output[-3000:]
        assert "SIGTERM received" in output and "--resume" in output
        stopped_at = len(read_metrics(tmp_path / "stopped"))
        assert 3 <= stopped_at < 10, output[-2000:]
        assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:06d}"
    finally:
        straight_run.wait()
    run_script("train_grpo.py", *SMALL, *steps, "--out", tmp_path / "stopped", "--resume")
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "stopped")
    assert [m["step"] for m in resumed] == list(range(10))
    for a, b in zip(straight, resumed):
        for key in TRAIN_KEYS + ["response_len_mean", "reward_std"]:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)


def test_torchrun_forwards_sigusr1_and_every_rank_stops_after_the_same_step(tmp_path):
    """launch/slurm.sh's path: torchrun told to forward SIGUSR1 (PET_SIGNALS_TO_HANDLE)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train_grpo.py",
        *SMALL,
        "--steps",
        "40",
        "--stall-dump-minutes",
        "0.0005",  # 30 ms: a step "stalls", and each rank writes its stacks
    ]
    _, output = _signal_after(
        _popen(cmd, tmp_path, PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"),
        tmp_path,
        signal.SIGUSR1,
        steps_logged=2,
    )
    # (torchrun itself exits 1 after forwarding a signal; the ranks exit 0)
    assert "SIGUSR1 received" in output and "stopped by SIGUSR1" in output, output[-3000:]
    saved = len(read_metrics(tmp_path))
    assert 2 <= saved < 40
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{saved:06d}"
    assert "complete" in os.listdir(tmp_path / "checkpoints" / f"step_{saved:06d}")
    for rank in (0, 1):  # every thread's stack, the main thread's in the training loop
        stacks = (tmp_path / "stacks" / f"rank{rank}.txt").read_text()
        assert "this step has run longer than" in stacks and 'train_grpo.py", line' in stacks, stacks[:2000]


def test_merge_refuses_non_finite_weights(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    import convert_hf_to_mcore
    import merge_to_hf
    from tests.tiny_models import save_tiny_hf_model

    src = tmp_path / "src"
    save_tiny_hf_model("qwen2", str(src))
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert convert_hf_to_mcore.main(["--hf", str(src), "--out", str(tmp_path / "ckpt"), "--dtype", "fp32"]) == 0
    assert merge_to_hf.main(["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    text = capsys.readouterr().out
    assert "NaN/Inf" in text and "model.layers.1.mlp.down_proj.weight" in text, text
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.incomplete").exists()
    assert torch.isnan(tensors["model.layers.1.mlp.down_proj.weight"]).sum() == 1


def test_run_control_decides_when_to_save_and_stop():
    import torch

    from common.train.guard import STOP_SIGNALS, RunControl

    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    cpu = torch.device("cpu")
    try:
        control = RunControl(save_every=3, save_every_minutes=0.001, steps=10)  # the clock: 60 ms
        assert control.step_end(0, cpu) == (False, False)
        assert control.step_end(2, cpu) == (True, False)  # every 3 steps
        time.sleep(0.07)
        assert control.step_end(3, cpu) == (True, False)  # 60 ms since the last save
        assert control.step_end(4, cpu) == (False, False)  # the clock restarted at that save
        assert control.step_end(9, cpu) == (True, False)  # the last step
        os.kill(os.getpid(), signal.SIGUSR1)
        assert control.signal_name == "SIGUSR1"
        assert control.step_end(4, cpu) == (True, True)
        assert "stopped by SIGUSR1 after step 5" in control.stop_message(4)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_a_stalled_step_writes_the_stacks_and_an_unstalled_run_no_file(tmp_path):
    """--stall-dump-minutes: a step longer than the limit appends every thread's stack once (the run goes on);
    the clock restarts at each step's end; close() stops it; a run with no stall writes no file."""
    import torch

    from common.train.guard import STOP_SIGNALS, RunControl

    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    cpu = torch.device("cpu")
    try:
        control = RunControl(stall_minutes=0.001, out=tmp_path / "stalled")  # 60 ms
        stacks = tmp_path / "stalled" / "stacks" / "rank0.txt"
        time.sleep(0.2)  # the step stalls: one dump, not one per 60 ms
        first = stacks.read_text()
        assert first.count("this step has run longer than 0.001 min") == 1, first
        assert "thread MainThread:" in first and "in test_a_stalled_step_writes_the_stacks" in first
        control.step_end(0, cpu)  # restarted: quick steps write nothing
        control.step_end(1, cpu)
        control.close()
        time.sleep(0.1)
        assert stacks.read_text() == first
        quick = RunControl(stall_minutes=0.001, out=tmp_path / "quick")
        quick.step_end(0, cpu)
        quick.close()
        time.sleep(0.1)
        assert not (tmp_path / "quick").exists()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_non_finite_gradient_is_named_and_no_update_happens():
    import torch

    from common.train.guard import NonFiniteError, check_finite, check_finite_update

    layer = torch.nn.Linear(3, 2)
    layer.weight.grad, layer.bias.grad = torch.ones(2, 3), torch.tensor([0.0, float("inf")])
    with pytest.raises(NonFiniteError, match=r"step 5: the gradients are NaN/Inf \(non-finite: bias\)"):
        check_finite_update([layer], [{"policy_loss": torch.tensor(0.5)}], torch.device("cpu"), step=4)
    layer.bias.grad.zero_()
    check_finite_update([layer], [{"policy_loss": torch.tensor(0.5)}], torch.device("cpu"), step=4)  # finite: passes
    with pytest.raises(NonFiniteError, match="step 5: the loss is NaN/Inf; no optimizer step"):
        check_finite_update([layer], [{"policy_loss": torch.tensor(float("nan"))}], torch.device("cpu"), step=4)
    logprobs, mask = torch.tensor([[-1.0, float("nan")]]), torch.tensor([[1.0, 0.0]])
    check_finite("old logprobs", logprobs, mask)  # the NaN is outside the mask
    with pytest.raises(NonFiniteError, match="old logprobs: 1 of 2 values"):
        check_finite("old logprobs", logprobs)


# ---- everyday mistakes that lose work ----------------------------------------------------------
def test_a_second_run_into_the_same_out_is_refused_and_a_dead_ones_lock_is_not(tmp_path):
    """Run A trains in --out; run B into the same --out (even with --start-over, which would move
    A's files aside under it) is refused with one line naming A's pid and host, and A finishes
    untouched. Once A has ended, its lock is gone with it: the same B command starts over."""
    out = tmp_path / "run"
    first = Background("train_grpo.py", *SMALL, "--steps", "40", "--save-every", "100", "--out", out)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.1)
        second = run_script("train_grpo.py", *SMALL, "--steps", "2", "--out", out, "--start-over", check=False)
        err = second.stderr.strip()
        assert second.returncode == 2, (second.stdout + err)[-3000:]
        assert len(err.splitlines()) == 1 and f"--out {out} is in use by another run (pid " in err, err
        assert "wait for it or choose another --out" in err and not list(tmp_path.glob("run.old-*"))
    finally:
        first.wait()
    assert [m["step"] for m in read_metrics(out)] == list(range(40))
    run_script("train_grpo.py", *SMALL, "--steps", "2", "--out", out, "--start-over")
    (aside,) = tmp_path.glob("run.old-*")
    assert len(read_metrics(aside)) == 40 and len(read_metrics(out)) == 2


def test_the_lock_goes_with_its_process(tmp_path, capsys, monkeypatch):
    """flock: a run killed with SIGKILL leaves a lock file that no longer locks anything."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from common.run.out_dir import lock_out; lock_out({str(out)!r}); print(1, flush=True); input()",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        err = parse_error(capsys, train_grpo.parse_args, ["--out", str(out)])
        assert f"is in use by another run (pid {holder.pid} on host " in err, err
    finally:
        holder.kill()
        holder.wait()
    assert train_grpo.parse_args(["--out", str(out)]).out == str(out)  # the dead holder's file is no lock


def test_a_lock_outliving_its_run_says_who_holds_it(tmp_path, capsys, monkeypatch):
    """A process the run started (a rollout engine's worker) inherits the lock and may outlive
    the run: the refusal says the run's pid has ended and how to find the holder."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "run"
    code = (
        "import os, sys, time\n"
        "from common.run.out_dir import lock_out\n"
        f"lock_out({str(out)!r})\n"
        "if os.fork() == 0:\n"
        "    sys.stdin.readline(); os._exit(0)\n"  # the child keeps the lock until told to go
        "print(os.getpid(), flush=True)\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(run.stdout.readline())
        run.wait(timeout=60)  # the run is gone, its child is not
        err = parse_error(capsys, train_grpo.parse_args, ["--out", str(out)])
        assert f"(pid {pid} on host " in err and "that pid has ended" in err and "fuser" in err, err
    finally:
        run.stdin.close()  # the child reads the end of its input and exits
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            train_grpo.parse_args(["--out", str(out)])
            break
        except SystemExit:
            time.sleep(0.2)
    else:
        pytest.fail("the lock was not released when its last holder exited")
    capsys.readouterr()


def _without_file_permission_bypass():
    """A command prefix under which root is refused what file permissions refuse (CAP_DAC_OVERRIDE
    dropped), so that a read-only directory is one for the test too."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


def test_read_only_out_is_one_line_before_start_up(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        proc = subprocess.run(
            [*_without_file_permission_bypass(), sys.executable, "train_grpo.py", "--out", str(read_only / "run")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=script_env(),
        )
    finally:
        read_only.chmod(0o755)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert f"--out {read_only / 'run'} cannot be written (Permission denied" in err, err
    assert "world 1" not in proc.stdout  # refused before start-up


def test_services_asked_for_but_missing_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = ["--out", str(tmp_path / "run")]
    from common.rollout.engines import vllm_available

    if not vllm_available():
        err = parse_error(capsys, train_grpo.parse_args, ["--rollout", "vllm"] + out)
        assert "--rollout vllm: vLLM is not installed" in err and "--rollout cpu" in err, err
    # --wandb online and no key anywhere wandb looks (checked without a network call)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    err = parse_error(capsys, train_ppo.parse_args, ["--wandb", "online"] + out)
    assert "--wandb online: no wandb API key found" in err and "--wandb offline" in err, err
    assert train_grpo.parse_args(["--wandb", "offline"] + out).wandb == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert train_grpo.parse_args(["--wandb", "online"] + out).wandb == "online"


def test_a_failed_start_does_not_block_the_same_command(tmp_path):
    """A run that stops before its first step completes (here: NaN at step 1, after step 0's
    validation wrote eval/) leaves only what a start writes: the same command runs again (and
    stops the same way) instead of being refused as a non-empty --out."""
    cmd = ["train_grpo.py", *SMALL, "--lr", "1e30", "--steps", "2", "--out", tmp_path / "run"]
    first = run_script(*cmd, check=False)
    assert first.returncode == 3, first.stderr[-3000:]
    assert (tmp_path / "run" / "eval").is_dir()  # what made it a "used" --out before
    again = run_script(*cmd, check=False)
    assert again.returncode == 3 and "step 1: " in again.stderr.strip().splitlines()[-1], again.stderr[-3000:]


def test_weights_that_make_the_sampler_overflow_stop_with_exit_3(tmp_path):
    """One update per step at a huge learning rate: the weights stay finite but the CPU engine's
    logits overflow at the next rollout. Its sampler does not crash (multinomial refuses NaN
    probabilities): the run stops in the non-finite guard, exit 3, one line."""
    proc = run_script(
        "train_grpo.py",
        "--lr",
        "1e38",
        "--steps",
        "3",
        "--prompts-per-step",
        "16",
        "--mini-batch-size",
        "128",
        "--out",
        tmp_path,
        check=False,
    )
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train_grpo.py: stopped: step 2: ") and "NaN/Inf" in last, last
    assert "Traceback" not in proc.stderr


def test_sampler_survives_non_finite_logits():
    import torch

    from common.rollout.hf_engine import sample_tokens

    logits = torch.tensor([[0.0, 50.0, 0.0], [float("nan"), 1.0, 2.0], [float("inf"), 0.0, 0.0]])
    for top_p in (1.0, 0.9):
        tokens, logprobs = sample_tokens(logits, 1.0, top_p, torch.Generator().manual_seed(0))
        assert tokens[0] == 1 and logprobs[0] == pytest.approx(0.0, abs=1e-6)  # a finite row samples as before
        assert torch.isnan(logprobs[1:]).all() and ((0 <= tokens) & (tokens < 3)).all()


def test_broken_weights_are_refused_as_convert_refuses_them(inputs, tmp_path, capsys, monkeypatch):
    """What convert_hf_to_mcore.py refuses, the trainers refuse too, before start-up: a truncated,
    damaged or missing shard, a tensor whose shape config.json contradicts."""
    import safetensors.torch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    tensors = safetensors.torch.load_file(str(inputs / "model" / "model.safetensors"))

    def broken(name, change):
        path = tmp_path / name
        shutil.copytree(inputs / "model", path)
        change(path)
        return ["--model", str(path), "--max-new-tokens", "4", "--out", str(tmp_path / f"{name}_run")]

    def truncate(path):
        with open(path / "model.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(path / "model.safetensors") - 100)

    def shard(path):  # two shards and an index, the second shard missing
        names = sorted(tensors)
        parts = {"model-1.safetensors": names[:5], "model-2.safetensors": names[5:]}
        for file, part in parts.items():
            safetensors.torch.save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        index = {"weight_map": {n: file for file, part in parts.items() for n in part}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        os.remove(path / "model.safetensors")
        os.remove(path / "model-2.safetensors")

    def vocab(path):  # config.json says more tokens than the embedding has rows
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 64)))

    def garbage(path):
        (path / "model.safetensors").write_bytes(b"\xff" * 64)

    for name, change, says in (
        ("truncated", truncate, "is truncated: its header describes"),
        ("missing", shard, "model-2.safetensors is missing"),
        ("vocab", vocab, "'model.embed_tokens.weight'"),
        ("garbage", garbage, "is damaged"),
    ):
        err = parse_error(capsys, train_grpo.parse_args, broken(name, change))
        assert f"--model {tmp_path / name}: " in err and says in err, (name, err)


def test_nan_weights_are_named_and_refused_with_exit_2(inputs, tmp_path):
    """NaN weights are found while each rank reads its shard (a full read: no extra pass), and
    every rank stops with one line naming the tensor and its file."""
    import safetensors.torch

    model = tmp_path / "model"
    shutil.copytree(inputs / "model", model)
    tensors = safetensors.torch.load_file(str(model / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    safetensors.torch.save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    proc = run_torchrun_unchecked(
        "train_grpo.py", 2, "--model", model, "--tp", "2", *SMALL, "--steps", "1", "--out", tmp_path / "run"
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert err[-1].startswith("train_grpo.py: error: the weights in "), err[-3:]
    assert f"'model.layers.1.mlp.up_proj.weight' in {model / 'model.safetensors'} holds NaN/Inf" in err[-1], err[-1]
    assert "Traceback" not in proc.stderr


def run_torchrun_unchecked(script, nproc, *args):
    from tests.conftest import launch

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone", script]
    return launch(cmd + [str(a) for a in args], script, args, nproc=nproc, env=script_env(), timeout=600)


def test_inf_stops_like_nan():
    """An overflow gives +-Inf, not NaN: every finite check of the training loop stops it too."""
    import torch

    from common.train.guard import NonFiniteError, check_finite, check_finite_update

    for bad in (float("inf"), float("-inf")):
        with pytest.raises(NonFiniteError, match="old logprobs: 1 of 2 values"):
            check_finite("old logprobs", torch.tensor([[-1.0, bad]]))
        layer = torch.nn.Linear(3, 2)
        layer.weight.grad, layer.bias.grad = torch.ones(2, 3), torch.zeros(2)
        for loss in (torch.tensor(bad), bad):  # a tensor or a python float
            with pytest.raises(NonFiniteError, match="step 5: the loss is NaN/Inf; no optimizer step"):
                check_finite_update([layer], [{"policy_loss": loss}], torch.device("cpu"), step=4)
        layer.weight.grad[1, 2] = bad
        with pytest.raises(NonFiniteError, match=r"the gradients are NaN/Inf \(non-finite: weight\)"):
            check_finite_update([layer], [{"policy_loss": torch.tensor(0.5)}], torch.device("cpu"), step=4)


@pytest.mark.parametrize("with_vllm", [True, False])
def test_a_bug_with_vllm_loaded_ends_the_process(with_vllm):
    """An in-process vLLM engine can block interpreter exit (here: a thread that never ends, as its engine
    can leave): a bug in a rank must still end that rank, traceback printed, exit 1, so that torchrun ends the
    others instead of every rank waiting for it. Without vLLM the interpreter's own exit (the same exit code)."""
    code = (
        "import sys, threading, time, types\n"
        f"if {with_vllm}:\n"
        "    sys.modules['vllm'] = types.ModuleType('vllm')\n"
        "    threading.Thread(target=time.sleep, args=(600,)).start()  # blocks the interpreter's exit\n"
        "from common.run.cli import run_training\n"
        "def main():\n"
        "    raise RuntimeError('a bug in a rank')\n"
        "run_training(main)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=script_env()
    )
    assert proc.returncode == 1 and "RuntimeError: a bug in a rank" in proc.stderr, proc.stderr[-2000:]
