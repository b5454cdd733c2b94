"""--resume with other flags, data or model than the checkpoint's, and Slurm's requeue of a
--start-over job, on the CPU (embedded tiny model).

    .venv/bin/python -m pytest -q tests/test_resume_safety.py

- a schedule flag given anew at --resume (--lr, --steps; PPO's --critic-lr) applies from the
  resumed step, says so in one line, and config.json records it;
- --resume with another --model says which model the checkpoint was written for (before
  start-up), with other data it says the data changed: one line, exit 2, nothing touched;
- a requeued Slurm job (SLURM_RESTART_COUNT=1) whose command has --start-over (and the
  `--resume auto` launch/slurm.sh adds) continues its run instead of being refused.
"""

import json
import os
import shutil

import pytest

import train_grpo  # noqa: E402  (the repo root is on sys.path via conftest)
from tests.conftest import read_metrics, run_script
from tests.test_run_safety import SMALL  # the same small run


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run of the embedded model (lr 3e-3, its default), checkpoint at step 2."""
    root = tmp_path_factory.mktemp("two_steps")
    run_script("train_grpo.py", *SMALL, "--steps", 2, "--out", root / "run")
    return root / "run"


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_new_lr_and_steps_apply_from_the_resumed_step(two_steps, tmp_path):
    out = copy_of(two_steps, tmp_path)
    proc = run_script("train_grpo.py", *SMALL, "--steps", 3, "--lr", "5e-3", "--out", out, "--resume")
    assert "--lr 0.005 (checkpoint: 0.003): the new value applies from step 3" in proc.stdout, proc.stdout[-2000:]
    assert "--steps 3 (checkpoint: 2): the new value applies from step 3" in proc.stdout
    assert [m["lr"] for m in read_metrics(out)] == [0.003, 0.003, 0.005]  # constant schedule: its peak
    assert json.loads((out / "config.json").read_text())["args"]["lr"] == 0.005  # the record: what applies


def test_ppo_critic_lr_given_anew_applies(tmp_path):
    out = tmp_path / "ppo"
    run_script("train_ppo.py", *SMALL, "--steps", 1, "--out", out)
    proc = run_script("train_ppo.py", *SMALL, "--steps", 2, "--critic-lr", "1e-3", "--out", out, "--resume")
    assert "--critic-lr 0.001 (checkpoint: 0.003): the new value applies from step 2" in proc.stdout
    assert [m["critic_lr"] for m in read_metrics(out)] == [0.003, 0.001]


def test_resume_with_another_model_names_the_checkpoints_model(two_steps, tmp_path, capsys, monkeypatch):
    from common.run.embedded import write_embedded_model

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    wide = write_embedded_model(str(tmp_path / "wide"), hidden_size=128)
    with pytest.raises(SystemExit) as exit_info:
        train_grpo.parse_args([*SMALL, "--model", wide, "--out", str(two_steps), "--resume"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"was written for the embedded tiny model, not --model {wide}" in err, err
    assert "hidden_size 64 vs 128" in err and "--start-over" in err and "damaged" not in err, err


def test_resume_with_other_data_says_the_data_changed(two_steps, tmp_path):
    out = copy_of(two_steps, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(10)))
    before = sorted(os.listdir(out))
    proc = run_script("train_grpo.py", *SMALL, "--data", data, "--out", out, "--resume", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "the checkpoint's place in the data is for " in err[-1] and "this run has 10 prompts" in err[-1], err[-1]
    assert "--start-over" in err[-1] and "Traceback" not in proc.stderr
    assert sorted(os.listdir(out)) == before and len(read_metrics(out)) == 2


def test_requeued_start_over_job_continues_its_run(two_steps, tmp_path):
    """launch/slurm.sh's requeue: the same command (here with 3 steps) plus --resume auto, with
    SLURM_RESTART_COUNT=1; the first attempt saved step 2."""
    out = copy_of(two_steps, tmp_path)
    proc = run_script(
        "train_grpo.py",
        *SMALL,
        "--steps",
        3,
        "--out",
        out,
        "--start-over",
        "--resume",
        "auto",
        env={"SLURM_RESTART_COUNT": "1"},
    )
    assert "attempt 2 of a requeued Slurm job" in proc.stdout and "resumed from step 2" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing moved aside
