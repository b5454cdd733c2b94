"""End-to-end tests of train_grpo.py on the CPU (embedded tiny model, synthetic task).

    .venv/bin/python -m pytest -q tests/test_train_grpo.py

- the embedded default learns: mean reward of the last 10 steps >= first 10 + 0.5; its closing
  line's export command works;
- --resume: 3 steps, then resume to 6 == 6 steps in one go (metrics of steps 4-6 equal);
- layouts: rollouts saved from a 1-process run, replayed (--load-rollouts) under torchrun
  with DP=2, TP=2 (+SP) and PP=2, give the same losses, grad norms, entropy and KL;
- resume at another layout: 2 steps in one process, resumed at TP=2 and at PP=2 under torchrun,
  give steps 3-4 of the uninterrupted run;
- --micro-batch-tokens under DP=2 (a different number of micro-batches on each rank) gives
  the losses and grad norms of fixed-size micro-batches in one process;
- flags reach the math (distinctive --temperature, --clip-low/--clip-high, --kl-coef, the
  default --kl-estimator, --overlong-buffer): the first step's kl, clip_frac and policy_loss
  over two PPO epochs, recomputed with transformers from the saved rollout, the initial weights
  and the weights after one update (a second run's checkpoint, merged to HF), and the saved
  rewards (task reward + DAPO's overlong penalty, by hand);
- --rollout-correction: each mode, replayed on a saved rollout, reaches the loss (TIS halves it, a band that masks
  every token leaves none, DeepSeek's mask leaves the positive advantages' term, by hand); --check-on-policy stops
  a run whose engine and trainer logprobs disagree (exit 5, the step written) and passes a lenient bound;
- every flag of --help has a help string;
- everyday mistakes: a small run runs (derived batch sizes), a model with few positions ends
  responses there, config.json records what ran, this step's learning rate is logged and
  printed, README commands after `make demo` are not refused, empty responses and a missing
  chat template are warned of, flags that would be ignored are refused.
- curves.png of a run: the time panel holds seconds only;
- --reward FILE.py:NAME: the rewards are the function's, unusable ones are refused (exit 2);
- --verbose: vLLM's log level before its import, megatron-core's INFO lines;
- --eval-only: the numbers of the run's validation at the same weights.
"""

import os
import re
import shutil
import sys

import pytest

from tests.conftest import ROOT, assert_every_flag_documented, read_metrics, run_script, run_scripts, run_torchrun

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


def run(*args, timeout=900, check=True):
    return run_script("train_grpo.py", *args, timeout=timeout, check=check)


metrics = read_metrics


def test_help_documents_every_flag():
    sys.path.insert(0, ROOT)
    from train_grpo import build_parser

    assert_every_flag_documented(build_parser())
    proc = run("--help")
    assert "--prompts-per-step" in proc.stdout and "--load-rollouts" in proc.stdout


def test_embedded_default_learns(tmp_path):
    """The README's claim, on fewer steps than `make demo` runs (see README for the full run)."""
    proc = run("--steps", 60, "--out", tmp_path)  # measured: reward 0.007 -> 0.81, greedy accuracy 0.0 -> 0.8
    rewards = [m["reward_mean"] for m in metrics(tmp_path)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last >= first + 0.5
    assert os.path.isfile(tmp_path / "curves.png")
    assert open(tmp_path / "checkpoints" / "latest").read().strip() == "step_000060"
    # validation on the embedded task's 10 prompts (greedy): before any update, every 10 steps, the last
    evals = {m["step"]: m["eval_accuracy"] for m in metrics(tmp_path) if "eval_accuracy" in m}
    assert sorted(evals) == list(range(0, 60, 10)) + [59]
    assert sorted(os.listdir(tmp_path / "eval")) == [f"step_{s:06d}.jsonl" for s in sorted(evals)]
    print(f"eval accuracy {evals}")
    assert evals[59] >= evals[0] + 0.5
    # the closing line names the last checkpoint and a merge command that exports it
    step_dir = tmp_path / "checkpoints" / "step_000060"
    command = f"python merge_to_hf.py --ckpt {step_dir} --out {tmp_path / 'hf-step_000060'}"
    assert proc.stdout.strip().splitlines()[-1] == f"last checkpoint: {step_dir}; export it: {command}"
    assert len(re.findall(r"^start-up \d+ s", proc.stdout, re.M)) == 1  # where the start-up went (StartupClock)
    run_script(*command.split()[1:])
    assert (tmp_path / "hf-step_000060" / "model.safetensors.index.json").is_file()


def test_resume_is_exact(two_step_run):
    run(*SMALL, "--steps", 6, "--out", two_step_run / "resumed", "--resume")
    straight, resumed = metrics(two_step_run / "straight"), metrics(two_step_run / "resumed")
    assert [m["step"] for m in resumed] == list(range(6))
    for a, b in zip(straight[3:], resumed[3:]):
        for key in TRAIN_KEYS + ["response_len_mean", "reward_std"]:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)


SHORT_ANSWERS = """
def short_answers(response, answer):  # --reward FILE.py:NAME: the shorter the response, the better
    return max(0.0, 1.0 - len(response) / 8)
"""


# Distinctive values of the flags that the script passes to the math (none is a default), so that
# a flag dropped or swapped on its way to its function changes the numbers checked below.
PLUMBED = [
    "--temperature",
    "0.7",
    "--clip-low",
    "0.1",
    "--clip-high",
    "0.3",
    "--kl-coef",
    "0.05",
    "--entropy-coef",
    "0",
    "--overlong-buffer",
    "3",
    "--rollout-logprobs",
    "all",
]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """Five independent one-process runs of the tests below, at once (one thread each): their
    output folders by name. "on" and "two" sample the same first rollout (PLUMBED flags); "on"
    makes one update of it and checkpoints after it, "two" two (test_first_update below)."""
    root = tmp_path_factory.mktemp("short_runs")
    (root / "short.py").write_text(SHORT_ANSWERS)
    runs = {
        "reward": [
            *SMALL,
            "--steps",
            1,
            "--reward",
            f"{root}/short.py:short_answers",
            "--save-rollouts",
            root / "saved",
        ],
        "none": [*SMALL, "--steps", 1, "--rollout-logprobs", "none"],
        "mask_truncated": [*SMALL, "--steps", 3, "--mask-truncated"],
        "on": [
            *SMALL,
            *PLUMBED,
            "--mini-batch-size",
            "32",
            "--steps",
            2,
            "--save-every",
            1,
        ],  # (test_eval_only's checkpoints)
        "two": [*SMALL, *PLUMBED, "--mini-batch-size", "32", "--ppo-epochs", 2, "--steps", 2],
    }
    runs["on"] += ["--save-rollouts", root / "on_rollouts"]
    runs["two"] += ["--save-rollouts", root / "two_rollouts"]
    run_scripts(*[("train_grpo.py", *args, "--out", root / name) for name, args in runs.items()])
    return {name: root / name for name in [*runs, "on_rollouts", "two_rollouts"]}


def test_rollout_logprobs_none_logs_no_mismatch(short_runs):
    (row,) = metrics(short_runs["none"])
    assert "logprob_mismatch" not in row and "policy_loss" in row  # not a 0.0 from zero samples


def test_curves_of_a_run(short_runs):
    """The run's curves.png is written; redrawn from its metrics.jsonl, the time panel stacks
    the timed phases only, never gen_tokens_per_s (thousands per second: it once filled the
    panel), which sits in the tokens/s panel; every legend fits the figure."""
    from common.run.plots import plot_curves
    from tests.test_plots import PHASES, assert_legends_fit, panel_axes, time_panel_labels

    run = short_runs["on"]
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG")
    history = metrics(run)
    assert "gen_tokens_per_s" in history[0] and "train_tokens_per_s_per_gpu" in history[0]
    fig = plot_curves(history)
    stacked, lines = time_panel_labels(fig)
    assert set(stacked) <= set(PHASES) and {"rollout_s", "train_s", "ref_s"} <= set(stacked)
    assert lines == ["step_s (total)"]
    assert panel_axes(fig, "seconds per step").get_ylim()[1] < 60  # a tiny model's step: seconds
    tokens = sorted(ln.get_label() for ln in panel_axes(fig, "tokens/s").get_lines())
    assert tokens == ["gen_tokens_per_s", "step_tokens_per_s_per_gpu", "train_tokens_per_s_per_gpu"]
    assert_legends_fit(fig)


def test_user_reward(short_runs):
    """--reward FILE.py:NAME: each sample's reward (saved with --save-rollouts) is what the
    function gives its decoded response, reward_mean their mean, and validation scores with it."""
    import json

    import torch
    from transformers import AutoTokenizer

    from common.rl.rewards import synthetic_reward

    run = short_runs["reward"]
    namespace = {}
    exec(SHORT_ANSWERS, namespace)
    tokenizer = AutoTokenizer.from_pretrained(run / "embedded_model")
    saved = torch.load(run.parent / "saved" / "step_000000.pt", weights_only=False)
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in saved["samples"]]
    expected = [namespace["short_answers"](t, None) for t in texts]
    assert saved["rewards"].tolist() == pytest.approx(expected, abs=1e-7)
    assert len(set(expected)) > 1  # responses of several lengths: a constant would prove little
    assert expected != [synthetic_reward(t, "0", format_credit=0.0) for t in texts]  # not the built-in reward
    (row,) = metrics(run)
    assert row["reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    with open(run / "eval" / "step_000000.jsonl") as f:
        for prompt in map(json.loads, f):
            assert prompt["rewards"] == [namespace["short_answers"](t, None) for t in prompt["responses"]]


def test_unusable_user_reward_refused(tmp_path):
    """One line, exit 2, before anything is built (the file is checked at start-up)."""
    (tmp_path / "r.py").write_text("def f(response):\n    return 1.0\n")
    for spec, message in [
        (f"{tmp_path}/absent.py:f", f"--reward {tmp_path}/absent.py:f: no file {tmp_path}/absent.py"),
        (f"{tmp_path}/r.py:f", f"--reward {tmp_path}/r.py:f: f(response) cannot be called as f(response, answer)"),
    ]:
        proc = run_script("train_grpo.py", "--reward", spec, "--out", tmp_path / "out", check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"train_grpo.py: error: {message}"), line
        assert not (tmp_path / "out" / "embedded_model").exists()


def test_eval_only(short_runs, tmp_path):
    """--eval-only validates weights once, as the training run's validation did at the same
    weights: the embedded model (step 0), a training checkpoint (--mcore-ckpt step_000001: the
    weights step 1 sampled with) and, with --resume, the run's newest checkpoint (step 2, which
    no validation of the run saw); the run's own files are left as they were."""
    import json

    run = short_runs["on"]
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.json")}
    flags = [*SMALL, "--mini-batch-size", "32", "--eval-only"]
    run_scripts(
        ("train_grpo.py", *flags, "--out", tmp_path / "hf"),
        ("train_grpo.py", *flags, "--mcore-ckpt", run / "checkpoints" / "step_000001", "--out", tmp_path / "ckpt"),
        ("train_grpo.py", *flags, "--resume", "--out", run),
    )

    def jsonl(path):
        with open(path) as f:
            return [json.loads(line) for line in f]

    trained = {row["step"]: row for row in metrics(run) if "eval_accuracy" in row}
    assert sorted(trained) == [0, 1]
    for out, step in ((tmp_path / "hf", 0), (tmp_path / "ckpt", 1)):
        assert jsonl(out / "eval_only" / f"step_{step:06d}.jsonl") == jsonl(run / "eval" / f"step_{step:06d}.jsonl")
        (row,) = jsonl(out / "eval_only" / "metrics.jsonl")
        assert row["step"] == step
        for key, value in trained[step].items():
            if key.startswith("eval_") and key != "eval_s":
                assert row[key] == pytest.approx(value, abs=1e-9), (step, key)
    (row,) = jsonl(run / "eval_only" / "metrics.jsonl")
    assert row["step"] == 2 and row["weights"] == str(run / "checkpoints" / "step_000002")
    assert sorted(os.listdir(run / "eval_only")) == ["metrics.jsonl", "step_000002.jsonl"]
    assert {name: (run / name).read_bytes() for name in before} == before


def test_verbose_reaches_vllm_and_megatron(tmp_path):
    """--rollout vllm with a stand-in vllm package that reports, when the script imports it, the
    log level a real vllm would configure itself with, then ends the run: WARNING by default,
    INFO with --verbose; megatron-core's INFO lines (DDP set-up) print with --verbose only."""
    import json
    import subprocess

    from tests.conftest import script_env

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "import json, logging, os\n"
        "print('FAKE_VLLM ' + json.dumps([os.environ.get('VLLM_LOGGING_LEVEL'), "
        "logging.getLogger('megatron.core').level]), flush=True)\n"
        "os._exit(0)\n"
    )
    env = {k: v for k, v in script_env(PYTHONPATH=str(tmp_path)).items() if k not in ("VLLM_LOGGING_LEVEL", "RANK")}
    runs = {
        flags: subprocess.Popen(
            [sys.executable, "train_grpo.py", *SMALL, "--rollout", "vllm", "--kl-coef", "0", *flags]
            + ["--out", tmp_path / f"out{len(flags)}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flags in [(), ("--verbose",)]
    }
    for flags, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        (report,) = [json.loads(line[10:]) for line in out.splitlines() if line.startswith("FAKE_VLLM ")]
        assert report == (["INFO", 20] if flags else ["WARNING", 30]), flags
        assert ("INFO megatron.core.distributed" in err) == bool(flags), err[-3000:]


def test_mask_truncated_keeps_the_sync_check_honest(short_runs):
    """--mask-truncated takes cut-off samples out of the trainer's passes (their old logprobs
    stay 0): the sample scored for logprob_mismatch (--rollout-logprobs prefill, the default)
    is one that ended on EOS, and a step with none logs no mismatch rather than |engine - 0|
    (a GPU run logged 3.1 that way)."""
    rows = metrics(short_runs["mask_truncated"])
    assert any(row["truncated_frac"] == 1.0 for row in rows), rows  # the random model rarely stops in 4 tokens
    for row in rows:
        assert ("logprob_mismatch" in row) == (row["truncated_frac"] < 1.0), row
        assert row.get("logprob_mismatch", 0.0) < 1e-5, row


@pytest.fixture(scope="module")
def saved_rollouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    run(*SMALL, "--steps", 2, "--no-pack", "--out", root / "reference", "--save-rollouts", root / "rollouts")
    return root


# The reference is padded (--no-pack) in one process; the layouts run the default, packed passes
# (tp2_sp says so), so each compares packed at that layout with padded in one process.
@pytest.mark.parametrize(
    "layout", [["--tp", "2", "--sp", "--pack"], ["--pp", "2"], []], ids=["tp2_sp_pack", "pp2", "dp2"]
)
def test_layouts_match_single_process(layout, saved_rollouts, tmp_path):
    run_torchrun(
        "train_grpo.py",
        2,
        *SMALL,
        "--steps",
        2,
        *layout,
        "--out",
        tmp_path,
        "--load-rollouts",
        saved_rollouts / "rollouts",
    )
    reference, replayed = metrics(saved_rollouts / "reference"), metrics(tmp_path)
    assert len(replayed) == 2
    for a, b in zip(reference, replayed):
        for key in TRAIN_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (layout, a["step"], key, a[key], b[key])


def test_logprob_micro_batching_follows_the_update_unless_given():
    from argparse import Namespace

    from common.run.flags import logprob_micro_batching

    def sizes(size=None, tokens=None, update=(4, 0)):
        return logprob_micro_batching(
            Namespace(
                micro_batch_size=update[0],
                micro_batch_tokens=update[1],
                logprob_micro_batch_size=size,
                logprob_micro_batch_tokens=tokens,
            )
        )

    assert sizes() == (4, 0) and sizes(update=(4, 512)) == (4, 512)
    assert sizes(16) == (16, 0) and sizes(16, update=(4, 512)) == (16, 0)  # samples given: no token budget
    assert sizes(tokens=1024, update=(4, 512)) == (4, 1024) and sizes(16, 1024) == (16, 1024)


def test_token_budget_matches_fixed_micro_batches(tmp_path):
    import glob

    import torch

    from common.rl import batch as B

    geometry = [
        "--prompts-per-step",
        "8",
        "--samples-per-prompt",
        "4",
        "--mini-batch-size",
        "16",
        "--max-new-tokens",
        "24",
        "--no-pack",
    ]  # responses of 1 to 24 tokens: lengths vary; padded budgets
    run(
        *geometry,
        "--micro-batch-size",
        "4",
        "--steps",
        2,
        "--out",
        tmp_path / "fixed",
        "--save-rollouts",
        tmp_path / "rollouts",
    )
    # the test means something only if the budget gives the two ranks different counts
    samples = torch.load(sorted(glob.glob(str(tmp_path / "rollouts" / "*.pt")))[0], weights_only=False)["samples"]
    packed = B.pack_sequences(samples, pad_id=0)
    counts = [len(B.micro_batches(packed, torch.arange(dp * 8, dp * 8 + 8), 4, max_tokens=48)) for dp in range(2)]
    assert counts[0] != counts[1], counts
    # the forward-only (old logprob) passes of twice that budget
    run_torchrun(
        "train_grpo.py",
        2,
        *geometry,
        "--micro-batch-tokens",
        "48",
        "--logprob-micro-batch-tokens",
        "96",
        "--steps",
        2,
        "--out",
        tmp_path / "budget",
        "--load-rollouts",
        tmp_path / "rollouts",
    )
    for a, b in zip(metrics(tmp_path / "fixed"), metrics(tmp_path / "budget"), strict=True):
        for key in TRAIN_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """One process: an uninterrupted 6-step run saving its rollouts (saving them changes no
    number: test_resume_is_exact compares with it too) and, at once beside it, the first 3
    steps of test_resume_is_exact's run; then a 2-step run replaying the rollouts (its
    checkpoint is what the layouts below resume; each test resumes a copy)."""
    root = tmp_path_factory.mktemp("resume")
    run_scripts(
        ("train_grpo.py", *SMALL, "--steps", 6, "--out", root / "straight", "--save-rollouts", root / "rollouts"),
        ("train_grpo.py", *SMALL, "--steps", 3, "--out", root / "resumed"),
    )
    run(*SMALL, "--steps", 2, "--out", root / "moved", "--load-rollouts", root / "rollouts")
    return root


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_resume_at_another_layout(layout, two_step_run, tmp_path):
    """Saved by one process after 2 steps, resumed under torchrun at TP=2 / PP=2 (replaying the
    same rollouts): steps 3-4 give the metrics of the uninterrupted one-process run."""
    shutil.copytree(two_step_run / "moved", tmp_path / "moved")
    run_torchrun(
        "train_grpo.py",
        2,
        *SMALL,
        "--steps",
        4,
        *layout,
        "--out",
        tmp_path / "moved",
        "--resume",
        "--load-rollouts",
        two_step_run / "rollouts",
    )
    straight, moved = metrics(two_step_run / "straight"), metrics(tmp_path / "moved")
    assert [m["step"] for m in moved] == [0, 1, 2, 3]
    for a, b in zip(straight[2:4], moved[2:], strict=True):
        for key in TRAIN_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (layout, a["step"], key, a[key], b[key])


def test_on_policy_skips_the_old_logprob_pass_and_passes_agree(short_runs):
    """One epoch, one mini-batch, no TIS: the old logprobs are the update's own forward, so the
    separate pass is skipped (no old_logprob_s) and ppo_kl / clip_frac are exactly 0. With two
    epochs the pass runs, and before the first update it agrees with the update's forward up to
    float rounding (first_update_logprob_err): anything larger means the passes disagree."""
    for m in metrics(short_runs["on"]):
        assert "old_logprob_s" not in m and "first_update_logprob_err" not in m
        assert m["ppo_kl"] == 0.0 and m["clip_frac"] == 0.0
    for m in metrics(short_runs["two"]):
        assert "old_logprob_s" in m
        assert m["first_update_logprob_err"] <= 1e-6, m["first_update_logprob_err"]
        assert m["ppo_kl"] != 0.0  # the second epoch's updates move away from the old policy


def test_readme_commands_after_make_demo(tiny_models_dir, tmp_path, monkeypatch, capsys):
    """`make demo` writes into its own --out (its command taken from the Makefile, run with a
    stand-in python), the default --out is one directory per model: after the demo, `python
    train_grpo.py` starts; a re-run into the same default --out is refused with the line naming
    --resume / --start-over; another model gets its own directory. A small run of the embedded
    model gets batch sizes that fit it instead of a refusal."""
    import json
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path / "demo_args"}\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()  # newer than requirements.txt: make installs nothing
    subprocess.run(["make", "-s", "-C", ROOT, "demo", f"VENV={venv}"], check=True, capture_output=True)
    script, *demo = (tmp_path / "demo_args").read_text().splitlines()
    assert script == "train_grpo.py"

    sys.path.insert(0, ROOT)
    from train_grpo import parse_args

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)

    def has_run(out):  # what a run leaves: its metrics
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")

    has_run(parse_args(demo).out)
    capsys.readouterr()
    assert parse_args([]).out == "runs/grpo-embedded"  # `python train_grpo.py`
    assert "--out runs/grpo-embedded (the default for this model)" in capsys.readouterr().out
    has_run("runs/grpo-embedded")
    with pytest.raises(SystemExit) as refused:  # `python train_grpo.py --steps 5`: the same default --out
        parse_args(["--steps", "5"])
    error = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(error.splitlines()) == 1
    assert "runs/grpo-embedded already holds a run" in error and "--resume" in error and "--start-over" in error
    assert parse_args(["--model", str(tiny_models_dir / "llama")]).out == "runs/grpo-llama"
    small = parse_args(["--prompts-per-step", "2", "--samples-per-prompt", "2", "--out", "small"])
    assert (small.mini_batch_size, small.micro_batch_size) == (4, 4)
    assert "--mini-batch-size 4 (the embedded default 64 does not divide the rollout batch of 4" in (
        capsys.readouterr().out
    )


def test_small_run_of_a_model_with_few_positions(tmp_path):
    """--prompts-per-step 2 --samples-per-prompt 2 on a model of 16 positions with
    --max-new-tokens 15: the run is not refused (--micro-batch-size is derived: 4, said once),
    the CPU engine ends each response where prompt + response reach 16 tokens (as vLLM), each
    step logs the learning rate its optimizer step used (warmup: 0, then 1e-6; the optimizer
    holds the next step's), the closing summary prints it as 1.0e-06, and config.json records
    the resolved values (dtype, engine, batch sizes) and the command line."""
    import json

    import torch

    from common.run.embedded import write_embedded_model

    model = write_embedded_model(str(tmp_path / "short"), max_position_embeddings=16)
    proc = run(
        *("--model", model, "--prompts-per-step", 2, "--samples-per-prompt", 2, "--max-new-tokens", 15),
        *("--steps", 2, "--lr", "1e-6", "--lr-warmup-steps", 1, "--eval-every", 0),
        *("--out", tmp_path / "out", "--save-rollouts", tmp_path / "rollouts"),
    )
    assert proc.stdout.count("--micro-batch-size 4: each data-parallel rank gets 4 samples of a mini-batch") == 1
    assert "max_model_len 17 (the longest prompt + --max-new-tokens) capped at the model's" in proc.stdout
    lengths = [
        len(s.prompt_ids) + len(s.response_ids)
        for step in range(2)
        for s in torch.load(tmp_path / "rollouts" / f"step_{step:06d}.pt", weights_only=False)["samples"]
    ]
    assert max(lengths) <= 16 and len(lengths) == 8, lengths
    assert [m["lr"] for m in metrics(tmp_path / "out")] == [0.0, pytest.approx(1e-6)]
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("{") and '"lr"' in line)
    assert re.search(r'"lr": 1\.0e-06[,}]', summary) and json.loads(summary)["lr"] == pytest.approx(1e-6)
    record = json.load(open(tmp_path / "out" / "config.json"))
    resolved = {k: record["args"][k] for k in ("dtype", "rollout", "micro_batch_size", "mini_batch_size", "wandb")}
    assert resolved == dict(dtype="fp32", rollout="cpu", micro_batch_size=4, mini_batch_size=4, wandb="disabled")
    assert record["argv"][1:5] == ["--model", model, "--prompts-per-step", "2"]


def test_empty_responses_and_a_missing_chat_template_are_warned_of(tmp_path):
    """A chat model's directory without its chat template, whose generation_config stops at
    every token: the prompts of --data would go in as plain text (a warning names the chat
    tokens and the fixes) and every response is its first token alone (a warning, once, at the
    first such step, says what to check)."""
    import json

    from common.run.embedded import write_embedded_model

    model = tmp_path / "chat"
    write_embedded_model(str(model))
    os.remove(model / "chat_template.jinja")
    config = json.load(open(model / "tokenizer_config.json"))
    config.pop("chat_template", None)
    json.dump(config, open(model / "tokenizer_config.json", "w"))
    generation = json.load(open(model / "generation_config.json"))
    json.dump(dict(generation, eos_token_id=list(range(259))), open(model / "generation_config.json", "w"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    proc = run(
        *("--model", model, "--data", data, "--prompts-per-step", 2, "--samples-per-prompt", 2),
        *("--max-new-tokens", 4, "--steps", 2, "--out", tmp_path / "out"),
    )
    assert proc.stdout.count("warning: the tokenizer has chat tokens (<|im_start|>) but no chat template") == 1
    assert "--raw-prompts" in proc.stdout
    assert proc.stdout.count("responses are empty") == 1
    assert "warning: step 0: all 4 responses are empty (each stopped at its first token)" in proc.stdout
    assert "generation_config.json" in proc.stdout


def test_flags_that_would_be_ignored_are_refused(tmp_path):
    """A file has no splits, raw prompts take no system prompt, the synthetic task is no chat, a
    dense model has no routes to replay: exit 2 with one line naming the flag, before anything is
    built; so is an --eval-data that cannot be read, named as such (not as --data)."""
    data, odd = tmp_path / "data.jsonl", tmp_path / "odd.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    odd.write_text('{"text": "1+1", "label": "2"}\n')
    for args, says in (
        (["--data", data, "--data-split", "test"], "--data-split test: --data"),
        (["--data", data, "--system-prompt", "Think.", "--raw-prompts"], "--system-prompt goes into the chat"),
        (["--system-prompt", "Think."], "--system-prompt applies to --data's prompts"),
        (["--data", data, "--eval-data", odd], f"--eval-data {odd}: no prompt field found"),
        (["--routing-replay", "rollout"], "--routing-replay rollout: Qwen2ForCausalLM has no MoE routers"),
        (["--true-on-policy"], "--true-on-policy: it needs the vLLM engine"),
        (  # the embedded model's 16-wide heads hang vLLM's start-up at rollout TP 2 (docs/gpu.md)
            ["--dry-run", "--world-size", 2, "--tp", 2, "--rollout-tp", 2, "--rollout", "vllm", "--gpu-memory-gb", 80],
            "--rollout-tp 2: vLLM 0.26 hangs at start-up at rollout TP > 1 on a model of head size 16",
        ),
    ):
        proc = run(*args, "--out", tmp_path / "out", check=False)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (
            args,
            proc.stderr,
        )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def response_logprobs(hf_dir, samples, temperature):
    """log_softmax(logits / temperature) of each response token under the HF model in hf_dir
    (transformers, not the trainer's megatron model), all samples' tokens in one (1, N) row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]  # (L, V): predict each response token
            rows.append(torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(s.prompt_ids) :, None])[:, 0])
    return torch.cat(rows)[None]


@pytest.fixture(scope="module")
def first_update(short_runs, tmp_path_factory):
    """Step 0 of the "two" run (two PPO epochs over one mini-batch) recomputed outside the
    trainer from its saved rollout: the logprobs of its first epoch (the initial weights,
    which the frozen reference keeps too) and of its second (the weights after one update:
    the "on" run's checkpoint after step 0, the same update of the same samples, merged to HF),
    with each token's advantage, all (1, N) over the N response tokens."""
    import torch

    from common.rl.advantages import group_advantages

    merged = tmp_path_factory.mktemp("first_update") / "hf"
    run_script("merge_to_hf.py", "--ckpt", short_runs["on"] / "checkpoints" / "step_000001", "--out", merged)
    saved = torch.load(short_runs["two_rollouts"] / "step_000000.pt", weights_only=False)
    same = torch.load(short_runs["on_rollouts"] / "step_000000.pt", weights_only=False)
    assert same["samples"] == saved["samples"] and torch.equal(same["rewards"], saved["rewards"])
    samples, rewards = saved["samples"], saved["rewards"]
    temperature = FLAGS["--temperature"]
    advantages = group_advantages(rewards, 4)  # --samples-per-prompt 4
    return dict(
        samples=samples,
        rewards=rewards,
        before=response_logprobs(short_runs["two"] / "embedded_model", samples, temperature),
        after=response_logprobs(merged, samples, temperature),
        engine=torch.tensor([[lp for s in samples for lp in s.response_logprobs]]),
        advantages=torch.cat([a.expand(len(s.response_ids)) for a, s in zip(advantages, samples)])[None],
        record=metrics(short_runs["two"])[0],
        hf_dir=short_runs["two"] / "embedded_model",
    )


FLAGS = {k: float(v) for k, v in zip(PLUMBED[::2], PLUMBED[1::2]) if k != "--rollout-logprobs"}


def test_logprob_passes_use_the_temperature(first_update):
    """--temperature reaches the trainer's old and reference logprob passes (as it reaches the
    engine and the update): they agree with the engine's logprobs at 0.7 and with the update's
    first forward."""
    u = first_update
    assert (u["engine"] - u["before"]).abs().max() < 1e-5  # the engine sampled at 0.7 from the initial weights
    record = u["record"]
    assert record["first_update_logprob_err"] <= 1e-6, (
        f"old logprobs differ from the update's forward by {record['first_update_logprob_err']}: "
        "the logprob pass does not use --temperature"
    )
    assert record["logprob_mismatch"] <= 1e-5, f"trainer vs engine logprobs: {record['logprob_mismatch']}"


def test_kl_estimator_default_reaches_the_loss(first_update):
    """GRPO's KL penalty is k3 unless --kl-estimator says otherwise: the logged kl of the two
    epochs (the first at the reference's weights: 0) is k3 of the second's logprobs against the
    reference's."""
    from common.rl.losses import kl_penalty

    u = first_update
    expected = {k: kl_penalty(u["after"], u["before"], k).mean().item() / 2 for k in ("k1", "k2", "k3")}
    assert min(abs(expected["k3"] - expected[k]) for k in ("k1", "k2")) > 1e-3 * expected["k3"]  # they differ
    assert u["record"]["kl"] == pytest.approx(expected["k3"], rel=1e-4), (
        f"logged kl {u['record']['kl']}, k3 gives {expected['k3']} (k1 {expected['k1']}, k2 {expected['k2']})"
    )


def test_clip_range_reaches_the_loss(first_update):
    """--clip-low 0.1 and --clip-high 0.3 bound the ratio below and above 1 in the update's loss:
    clip_frac and policy_loss (+ --kl-coef x k3) of the two epochs recomputed by hand; the
    swapped range gives other numbers."""
    import torch

    from common.rl.losses import kl_penalty, policy_loss

    u = first_update
    num_tokens = u["after"].numel()
    kl = FLAGS["--kl-coef"] * kl_penalty(u["after"], u["before"], "k3").sum() / num_tokens

    def expected(clip_low, clip_high):
        per_token, clipped = policy_loss(u["after"], u["before"], u["advantages"], clip_low, clip_high)
        first_epoch = -u["advantages"].sum() / num_tokens  # ratio 1: nothing clipped, reference = policy
        return dict(
            clip_frac=clipped.sum().item() / (2 * num_tokens),
            policy_loss=(first_epoch + per_token.sum() / num_tokens + kl).item() / 2,
        )

    right, swapped = expected(FLAGS["--clip-low"], FLAGS["--clip-high"]), expected(0.3, 0.1)
    assert abs(right["policy_loss"] - swapped["policy_loss"]) > 1e-3, (right, swapped)  # a swap shows
    record = u["record"]
    assert torch.isfinite(torch.tensor(record["policy_loss"]))
    assert record["clip_frac"] == pytest.approx(right["clip_frac"], abs=0.1 / num_tokens), (
        f"logged clip_frac {record['clip_frac']}: --clip-low 0.1 --clip-high 0.3 give {right['clip_frac']}, "
        f"swapped {swapped['clip_frac']}"
    )
    assert record["policy_loss"] == pytest.approx(right["policy_loss"], rel=1e-4, abs=1e-6), (
        f"logged policy_loss {record['policy_loss']}: expected {right['policy_loss']}, swapped {swapped['policy_loss']}"
    )


def test_overlong_penalty_reaches_the_rewards(first_update):
    """--overlong-buffer 3 before --max-new-tokens 4: a response of L tokens loses nothing up to
    1 token, then (1 - L) / 3 (-1 at 4), added to the task's reward (the saved rewards)."""
    from transformers import AutoTokenizer

    from common.rl.rewards import synthetic_reward

    u = first_update
    tokenizer = AutoTokenizer.from_pretrained(u["hf_dir"])
    lengths = [len(s.response_ids) for s in u["samples"]]
    assert any(1 < length < 4 for length in lengths), lengths  # where a mix-up of 4 and 3 shows (4: -1 either way)
    expected = []
    for s, length in zip(u["samples"], lengths):
        prompt = tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
        assert re.fullmatch(r"\d=", prompt), prompt  # the embedded copy task: '7=' -> '7'
        task = synthetic_reward(tokenizer.decode(s.response_ids, skip_special_tokens=True), prompt[0], format_credit=0)
        expected.append(task + (0.0 if length <= 1 else (1 - length) / 3))
    assert u["rewards"].tolist() == pytest.approx(expected, abs=1e-6), (
        f"saved rewards {u['rewards'].tolist()} of responses of {lengths} tokens; expected {expected}"
    )


# --rollout-correction MODE and its thresholds, each replayed on the "on" run's first rollout (engine logprobs of
# every sample, at the initial weights): bands that mask every token (the engine and the trainer agree to ~1e-7,
# so every ratio is ~1), TIS capped at 0.5 (every weight 0.5), DeepSeek's mask with a delta that every sequence's
# ~0 KL exceeds (it drops exactly the negative-advantage sequences). All with a lenient --check-on-policy.
CORRECTION_RUNS = {
    "tis": ["--correction-high", "0.5"],
    "seq-mask-is": ["--correction-low", "1.5", "--correction-high", "2"],
    "icepop": ["--correction-low", "1.5", "--correction-high", "2"],
    "geo-mask": ["--correction-low", "1.5", "--correction-high", "2"],
    "decoupled": ["--correction-high", "0.5"],
    "seq-offpolicy-mask": ["--correction-delta", "-1"],
}


def replay_of_on(short_runs, *more):
    """The "on" run's flags, one step replayed from its saved first rollout."""
    return [
        *SMALL,
        *PLUMBED,
        "--mini-batch-size",
        "32",
        "--steps",
        1,
        "--load-rollouts",
        short_runs["on_rollouts"],
        *more,
    ]


@pytest.fixture(scope="module")
def corrections(short_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("corrections")
    run_scripts(
        *[
            ("train_grpo.py", *replay_of_on(short_runs, "--rollout-correction", mode, *flags, "--check-on-policy"))
            + ("--out", root / mode)
            for mode, flags in CORRECTION_RUNS.items()
        ]
    )
    return {mode: metrics(root / mode)[0] for mode in CORRECTION_RUNS}


def test_each_rollout_correction_reaches_the_loss(short_runs, corrections):
    """The "on" run's step 0 is the baseline: the same samples, weights and (ratio-1) loss, uncorrected. TIS at 0.5
    halves its policy_loss; a band that masks everything leaves none (and no gradient); DeepSeek's mask leaves the
    policy term of the positive advantages alone, -sum A_i * tokens_i / tokens over them (ratio exactly 1: one
    update, no old-logprob pass), by hand from the saved rewards."""
    import torch

    from common.rl.advantages import group_advantages

    base = metrics(short_runs["on"])[0]
    assert abs(base["policy_loss"]) > 1e-3 and "correction_masked_frac" not in base  # the default: no correction
    tis = corrections["tis"]
    assert tis["correction_weight_mean"] == pytest.approx(0.5) and tis["correction_masked_frac"] == 0.0
    assert tis["policy_loss"] == pytest.approx(0.5 * base["policy_loss"], rel=1e-4)
    assert tis["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-4)
    for mode in ("seq-mask-is", "icepop", "geo-mask", "decoupled"):
        m = corrections[mode]
        assert m["correction_masked_frac"] == 1.0 and m["correction_masked_seq_frac"] == 1.0, mode
        assert m["correction_weight_mean"] == 0.0 and m["grad_norm"] == 0.0, mode
        assert m["policy_loss"] == pytest.approx(0.0, abs=1e-9), mode  # (the KL term: policy = reference, ~1e-12)
    for m in corrections.values():  # engine vs trainer: the same weights, ~1e-7 apart
        assert m["logprob_mismatch"] < 1e-5
        if "engine_ratio_p50" in m:  # (DeepSeek's mask on an on-policy step: no old-logprob pass to compare)
            assert m["engine_ratio_p5"] <= m["engine_ratio_p50"] <= m["engine_ratio_p95"]
            assert m["engine_ratio_p5"] == pytest.approx(1.0, abs=1e-5) == m["engine_ratio_p95"]
    saved = torch.load(short_runs["on_rollouts"] / "step_000000.pt", weights_only=False)
    advantages = group_advantages(saved["rewards"], 4).tolist()
    lengths = [len(s.response_ids) for s in saved["samples"]]
    assert 0 < sum(a < 0 for a in advantages) < len(advantages)
    tokens = sum(lengths)
    deepseek = corrections["seq-offpolicy-mask"]
    assert deepseek["policy_loss"] == pytest.approx(
        -sum(a * n for a, n in zip(advantages, lengths) if a > 0) / tokens, rel=1e-4
    )
    assert deepseek["correction_masked_frac"] == pytest.approx(
        sum(n for a, n in zip(advantages, lengths) if a < 0) / tokens
    )
    assert deepseek["correction_masked_seq_frac"] == pytest.approx(sum(a < 0 for a in advantages) / len(advantages))


def test_on_policy_check_refuses_a_bad_bound(short_runs, corrections, tmp_path):
    """--check-on-policy: the replays above pass the default bound (0.1). Replayed at --temperature 1 the
    engine's logprobs (sampled at 0.7) disagree with the trainer's by ~0.05: a bound of 0.01 stops the run after
    its first step, exit 5, one line naming the number, the step's metrics and last checkpoint written."""
    assert all("policy_loss" in m for m in corrections.values())  # (they exited 0)
    proc = run(
        *replay_of_on(short_runs, "--temperature", "1.0", "--check-on-policy", "0.01", "--save-every", 1),
        "--out",
        tmp_path,
        check=False,
    )
    assert proc.returncode == 5, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert re.match(
        r"train_grpo\.py: stopped: step 1: the first update is not on-policy: logprob_mismatch 0\.0\d+ > "
        r"--check-on-policy 0\.01\. ",
        line,
    ), line
    (row,) = metrics(tmp_path)
    assert row["logprob_mismatch"] > 0.01 and row["ppo_kl"] == 0.0
    assert open(tmp_path / "checkpoints" / "latest").read().strip() == "step_000001"
    proc = run(*replay_of_on(short_runs, "--temperature", "1.0", "--check-on-policy", "0.5"), "--out", tmp_path / "ok")
    assert proc.returncode == 0
