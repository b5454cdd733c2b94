"""End-to-end tests of train_ppo.py on the CPU (embedded tiny model, synthetic task).

    .venv/bin/python -m pytest -q tests/test_train_ppo.py

- the embedded default learns: mean reward of the last 10 steps >= first 10 + 0.5; the
  curves, the checkpoint (with the critic in its step directory) and the critic's metrics;
- critic warmup (--critic-warmup-steps 1): the actor is untouched during the warmup step, so
  the next rollout's KL to the frozen reference (a copy of the initial actor) is exactly 0,
  and no policy loss / actor grad norm is logged; after the warmup the KL becomes > 0;
- --resume: 2 steps, then resume to 4 == 4 steps in one go (every training metric of steps
  2-3, the critic's value loss, explained variance and grad norm included). These runs use
  --kl-mode loss; the replays below the default --kl-mode reward;
- replays: the random tiny model never earns a reward on 4-token answers, so the saved
  rollouts get a made-up reward (1 when the first response token is odd) and are replayed
  (--load-rollouts) by 1 process with --gamma 0.5 --lam 1.0. The return_mean of its first two
  steps equals the hand-computed one (actor == reference, so no KL in the token rewards; lam 1:
  the return of each token is gamma^(tokens after it) * the sample's reward, whatever the
  values, which are 0 at the first step and trained at the second);
- layouts: the same replays under torchrun with DP=2, TP=2 (+SP) and PP=2 give the same
  policy and value losses, grad norms of both models, values, returns, entropy and KL
  as 1 process (rel 1e-4);
- --reward FILE.py:NAME: the rewards are the function's; an unusable one is refused;
- --rollout-correction: each mode reaches the actor's loss (TIS halves the gradient, a band that masks every token
  leaves none, DeepSeek's mask keeps the positive advantages); --check-on-policy checks the first actor update,
  after the critic warmup (exit 5);
- every flag of --help has a help string.
"""

import json
import os
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
    "--critic-warmup-steps",
    "1",
]
TRAIN_KEYS = [
    "policy_loss",
    "grad_norm",
    "entropy",
    "kl",
    "clip_frac",
    "reward_mean",
    "logprob_mismatch",
    "lr",
    "value_loss",
    "vf_clip_frac",
    "explained_variance",
    "critic_grad_norm",
    "value_mean",
    "return_mean",
    "critic_lr",
]
ACTOR_KEYS = ["policy_loss", "grad_norm", "entropy", "clip_frac"]  # absent during the critic warmup


def run(*args, timeout=600):
    return run_script("train_ppo.py", *args, timeout=timeout)


metrics = read_metrics


def assert_same(a, b, rel, abs_):
    """Every training metric of two runs' step records agrees (nan == nan: explained variance
    of all-equal returns)."""
    assert [k for k in TRAIN_KEYS if k in a] == [k for k in TRAIN_KEYS if k in b], a["step"]
    for key in TRAIN_KEYS:
        if key in a:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=abs_, nan_ok=True), (a["step"], key, a[key], b[key])


def test_help_documents_every_flag():
    sys.path.insert(0, ROOT)
    from train_ppo import build_parser

    assert_every_flag_documented(build_parser())
    proc = run("--help")
    for flag in [
        "--critic-lr",
        "--critic-model",
        "--critic-warmup-steps",
        "--vf-clip",
        "--gamma",
        "--lam",
        "--kl-mode",
        "--load-rollouts",
    ]:
        assert flag in proc.stdout


def test_user_reward(tmp_path):
    """--reward FILE.py:NAME in train_ppo.py: every sample's reward is the function's 0.25 (the
    built-in reward gives 0 or 1), validation's too; an unusable one is refused at start-up
    with one line, exit 2."""
    (tmp_path / "r.py").write_text(
        "def quarter(response, answer):\n    return 0.25\n\ndef one_argument(response):\n    return 1.0\n"
    )
    proc = run_script("train_ppo.py", "--reward", f"{tmp_path}/r.py:one_argument", "--out", tmp_path / "x", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"train_ppo.py: error: --reward {tmp_path}/r.py:one_argument: one_argument(response) cannot be called as "
        "one_argument(response, answer): too many positional arguments"
    ), proc.stderr[-2000:]
    run(*SMALL, "--steps", 1, "--reward", f"{tmp_path}/r.py:quarter", "--out", tmp_path / "out")
    (row,) = metrics(tmp_path / "out")
    assert row["reward_mean"] == 0.25 and row["reward_std"] == 0.0
    with open(tmp_path / "out" / "eval" / "step_000000.jsonl") as f:
        assert all(json.loads(line)["rewards"] == [0.25] for line in f)
    assert row["eval_accuracy"] == 0.0  # correct means a reward >= 1


def test_embedded_default_learns(tmp_path):
    """The README's claim on fewer steps than the default 100 (docs/algorithms.md, PPO)."""
    run("--steps", 60, "--out", tmp_path)
    records = metrics(tmp_path)
    rewards = [m["reward_mean"] for m in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert last >= first + 0.5
    # the critic learns the value of the prompts: a late value estimate near the reward
    assert abs(records[-1]["value_mean"] - records[-1]["reward_mean"]) < 0.2
    assert all(k in records[-1] for k in ["value_loss", "explained_variance", "vf_clip_frac"])
    assert os.path.isfile(tmp_path / "curves.png")
    assert not os.path.exists(tmp_path / "stacks")  # no step ran longer than --stall-dump-minutes (20)
    assert open(tmp_path / "checkpoints" / "latest").read().strip() == "step_000060"
    with open(tmp_path / "checkpoints" / "step_000060" / "complete") as f:
        files = json.load(f)["files"]
    assert "metadata.json" in files and "critic/metadata.json" in files


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """4 steps in one process, critic warmup 1 step, KL as a loss term, rollouts saved; beside
    it (at once, one thread each) the first 2 steps of test_resume_is_exact's run."""
    root = tmp_path_factory.mktemp("ppo")
    run_scripts(
        (
            "train_ppo.py",
            *SMALL,
            "--kl-mode",
            "loss",
            "--steps",
            4,
            "--out",
            root / "reference",
            "--save-rollouts",
            root / "rollouts",
        ),
        ("train_ppo.py", *SMALL, "--kl-mode", "loss", "--steps", 2, "--out", root / "resumed"),
    )
    return root


# The replays' GAE: lam 1 makes a token's return the discounted reward, gamma^(tokens after it) x
# the sample's reward, whatever the critic's values; gamma and lam swapped would not.
GAE = ["--gamma", "0.5", "--lam", "1.0"]


@pytest.fixture(scope="module")
def scored(reference):
    """The saved rollouts with a made-up reward, replayed by 1 process (KL in the reward)."""
    import torch

    for step in range(3):
        saved = torch.load(reference / "rollouts" / f"step_{step:06d}.pt", weights_only=False)
        saved["rewards"] = torch.tensor([float(s.response_ids[0] % 2) for s in saved["samples"]])
        os.makedirs(reference / "scored", exist_ok=True)
        torch.save(saved, reference / "scored" / f"step_{step:06d}.pt")
    run(*SMALL, *GAE, "--steps", 3, "--out", reference / "replay", "--load-rollouts", reference / "scored")
    return reference


def discounted_return_mean(saved, gamma):
    """Mean over response tokens of gamma^(response tokens after it) x the sample's reward."""
    total = sum(
        r.item() * sum(gamma**j for j in range(len(s.response_ids))) for s, r in zip(saved["samples"], saved["rewards"])
    )
    return total / sum(len(s.response_ids) for s in saved["samples"])


def test_replay_returns_by_hand(scored):
    """--gamma 0.5 --lam 1.0 reach GAE: the return of each token is 0.5^(tokens after it) x the
    reward, at the first step (zero-initialised value head) and at the second, where the critic
    has been trained (values != 0, so the GAE of swapped gamma and lam would differ) and the
    actor not yet (critic warmup: the KL to the reference, part of the token rewards, is 0)."""
    import torch

    first, second = metrics(scored / "replay")[:2]
    assert first["value_mean"] == 0.0 and first["explained_variance"] == 0.0
    assert first["value_loss"] > 0.05 and first["critic_grad_norm"] > 0
    assert abs(second["value_mean"]) > 1e-3 and second["kl"] == 0.0  # values matter; rewards only at the end
    for step, record in enumerate((first, second)):
        saved = torch.load(scored / "scored" / f"step_{step:06d}.pt", weights_only=False)
        assert 0.2 < saved["rewards"].mean() < 0.8
        assert discounted_return_mean(saved, 0.5) != pytest.approx(discounted_return_mean(saved, 1.0), rel=1e-2)
        assert record["return_mean"] == pytest.approx(discounted_return_mean(saved, 0.5), rel=1e-5), (
            f"step {step}: return_mean {record['return_mean']}, --gamma 0.5 --lam 1.0 give "
            f"{discounted_return_mean(saved, 0.5)} (gamma 1: {discounted_return_mean(saved, 1.0)})"
        )


def test_critic_warmup_leaves_the_actor_unchanged(reference):
    records = metrics(reference / "reference")
    # step 0 is the warmup: the critic is trained, the actor is not
    assert not any(k in records[0] for k in ACTOR_KEYS)
    assert all(k in records[0] for k in ["value_loss", "critic_grad_norm"])
    # step 1's rollout comes from the actor after step 0: still the initial weights, i.e. the
    # reference's, so the KL of its logprobs to the reference's is exactly 0 (same forward)
    assert records[0]["kl"] == 0.0 and records[1]["kl"] == 0.0
    assert all(k in records[1] for k in ACTOR_KEYS) and records[1]["grad_norm"] > 0
    assert records[2]["kl"] > 1e-6  # the actor's first update (step 1) moved it


def test_resume_is_exact(reference):
    run(*SMALL, "--kl-mode", "loss", "--steps", 4, "--out", reference / "resumed", "--resume")
    straight, resumed = metrics(reference / "reference"), metrics(reference / "resumed")
    assert [m["step"] for m in resumed] == list(range(4))
    for a, b in zip(straight[2:], resumed[2:]):
        assert_same(a, b, rel=1e-6, abs_=1e-7)
        assert a["response_len_mean"] == b["response_len_mean"] and a["reward_std"] == b["reward_std"]


@pytest.mark.parametrize(
    "layout", [["--tp", "2", "--sp"], ["--pp", "2"], [], ["--cp", "2"]], ids=["tp2_sp", "pp2", "dp2", "cp2"]
)
def test_layouts_match_single_process(layout, scored, tmp_path):
    run_torchrun(
        "train_ppo.py", 2, *SMALL, *GAE, "--steps", 3, *layout, "--out", tmp_path, "--load-rollouts", scored / "scored"
    )
    expected, replayed = metrics(scored / "replay"), metrics(tmp_path)
    assert len(replayed) == 3
    for a, b in zip(expected, replayed):
        assert_same(a, b, rel=1e-4, abs_=1e-5)


# --rollout-correction MODE in tiny PPO runs that sample the same first rollout (same seed and weights) with a
# reward of the response's parity (a signal from the first step: advantages of both signs), no reference and
# no entropy bonus: the actor's loss is the policy term alone. Bands that mask every token (engine and trainer
# agree to ~1e-7: every ratio is ~1), TIS capped at 0.5, DeepSeek's mask with a delta every sequence exceeds.
PPO_CORRECTIONS = {
    "none": ["--rollout-logprobs", "all"],
    "tis": ["--correction-high", "0.5"],
    "seq-mask-is": ["--correction-low", "1.5", "--correction-high", "2"],
    "icepop": ["--correction-low", "1.5", "--correction-high", "2"],
    "geo-mask": ["--correction-low", "1.5", "--correction-high", "2"],
    "decoupled": ["--correction-high", "0.5"],
    "seq-offpolicy-mask": ["--correction-delta", "-1"],
}
TINY = ["--prompts-per-step", 4, "--samples-per-prompt", 4, "--micro-batch-size", 4, "--max-new-tokens", 4]
TINY += ["--steps", 1, "--eval-every", 0, "--kl-coef", 0, "--entropy-coef", 0, "--check-on-policy"]


@pytest.fixture(scope="module")
def ppo_corrections(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_corrections")
    (root / "parity.py").write_text("def parity(response, answer):\n    return float(len(response) % 2)\n")
    run_scripts(
        *[
            ("train_ppo.py", *TINY, "--reward", f"{root}/parity.py:parity", "--rollout-correction", mode, *flags)
            + ("--out", root / mode)
            for mode, flags in PPO_CORRECTIONS.items()
        ]
    )
    return {mode: metrics(root / mode)[0] for mode in PPO_CORRECTIONS}


def test_each_rollout_correction_reaches_the_loss(ppo_corrections):
    """Whitened advantages sum to 0 over the tokens, so the uncorrected loss is ~0 (ratio ~1): the gradient shows
    the weights. TIS at 0.5 halves the gradient norm; a band that masks everything leaves no loss, no gradient;
    DeepSeek's mask keeps only the tokens of positive advantage, so the loss, -sum A_t / tokens over them, < 0."""
    base = ppo_corrections["none"]
    assert base["grad_norm"] > 1e-3 and "correction_masked_frac" not in base and base["reward_std"] > 0
    assert base["first_update_logprob_err"] < 1e-6 and base["logprob_mismatch"] < 1e-5
    tis = ppo_corrections["tis"]
    assert tis["correction_weight_mean"] == pytest.approx(0.5) and tis["correction_masked_frac"] == 0.0
    assert tis["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-4)
    assert tis["policy_loss"] == pytest.approx(0.5 * base["policy_loss"], abs=1e-7)
    for mode in ("seq-mask-is", "icepop", "geo-mask", "decoupled"):
        m = ppo_corrections[mode]
        assert m["correction_masked_frac"] == 1.0 and m["correction_masked_seq_frac"] == 1.0, mode
        assert m["grad_norm"] == 0.0 and m["policy_loss"] == 0.0, mode
        assert m["engine_ratio_p5"] == pytest.approx(1.0, abs=1e-5) == m["engine_ratio_p95"]
        assert m["value_loss"] == pytest.approx(base["value_loss"], rel=1e-5)  # the critic's update is untouched
    deepseek = ppo_corrections["seq-offpolicy-mask"]
    assert 0 < deepseek["correction_masked_frac"] < 1 and 0 < deepseek["correction_masked_seq_frac"] < 1
    assert abs(base["policy_loss"]) < 1e-5 and deepseek["policy_loss"] < -1e-3
    assert "correction_weight_mean" not in deepseek and "engine_ratio_p50" in deepseek


def test_on_policy_check_waits_for_the_first_actor_update(scored, tmp_path):
    """--check-on-policy runs at the actor's first update: after the critic warmup (step 1 here). The saved
    rollouts' scored sample (engine logprobs at temperature 1) replayed at --temperature 0.7 disagrees with the
    trainer's: a bound of 0.01 stops the run after step 2, exit 5, its metrics written."""
    flags = ["--steps", 3, "--temperature", 0.7, "--check-on-policy", 0.01, "--load-rollouts", scored / "scored"]
    flags += ["--stall-dump-minutes", 0.0005]  # 30 ms: every step "stalls", its stacks written
    proc = run_script("train_ppo.py", *SMALL, *GAE, *flags, "--out", tmp_path, check=False)
    assert proc.returncode == 5, proc.stderr[-3000:]
    stacks = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert "this step has run longer than 0.0005 min" in stacks and 'train_ppo.py", line' in stacks, stacks[:2000]
    assert "train_ppo.py: stopped: step 2: the first update is not on-policy: logprob_mismatch" in proc.stderr
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1] and "policy_loss" not in records[0]
    assert records[0]["logprob_mismatch"] > 0.01  # the warmup step: not checked
