"""The recipe features on a GPU with the colocated vLLM engine: validation
on the rollout engine, DAPO's dynamic sampling and overlong shaping, a reward model offloaded
beside the policy, samples and throughput metrics, in both scripts.

    python -m pytest -q -s tests/gpu/test_recipes_gpu.py     (GPU machine, stack of shared/device)

The embedded default model (its task and held-out set), a random-weight reward model of its
shape. Checked: exit 0; eval metrics at step 0 and every --eval-every steps with their
eval/step_N.jsonl; the reward is 0.5 x rule + 1 x score with the scores varying; sampling
rounds logged; train_mfu, gen_tokens_per_s and the trainer/engine logprob mismatch present
and sane. The PPO run packs its trainer passes (--pack: varlen attention, actor and critic)
and runs its forward-only ones (old logprobs, values) at 4x the update's token budget
(--logprob-micro-batch-tokens).
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import run_script  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
COMMON = [
    "--steps",
    "4",
    "--prompts-per-step",
    "32",
    "--samples-per-prompt",
    "4",
    "--eval-every",
    "2",
    "--eval-samples",
    "2",
    "--eval-temperature",
    "1.0",
    "--log-samples-every",
    "2",
    "--rule-reward-weight",
    "0.5",
    "--reward-model-weight",
    "1",
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    import transformers

    from common.run.embedded import write_embedded_model

    root = tmp_path_factory.mktemp("rm")
    src = write_embedded_model(str(root / "src"))
    config = transformers.AutoConfig.from_pretrained(src)
    config.architectures, config.num_labels = ["Qwen2ForSequenceClassification"], 1
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).float().save_pretrained(root / "rm")
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(root / "rm")
    return str(root / "rm")


def train(script, out, *extra):
    return run_script(script, out, *COMMON, *extra, timeout=400)


def check_common(rows, out, output, min_extra=-1e-4):
    """min_extra: the lowest reward - reward-model score (rule reward weight 0.5 over [0, 1],
    minus DAPO's overlong penalty of at most 1 where it is on)."""
    evals = sorted(r["step"] for r in rows if "eval_accuracy" in r)
    assert evals == [0, 2, 3], evals  # step 0, every --eval-every 2, the last of --steps 4
    assert sorted(os.listdir(out / "eval")) == [f"step_{s:06d}.jsonl" for s in (0, 2, 3)]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["rm_score_std"] > 0 and r["reward_model_s"] > 0
        assert min_extra <= r["reward_mean"] - r["rm_score_mean"] <= 0.5 + 1e-4
        assert r["gen_tokens_per_s"] > 0 and 0 < r["train_mfu"] < 1
    assert "response" in output or (out / "samples.jsonl").exists()
    print(
        f"{out.name}: eval {[(r['step'], r['eval_accuracy']) for r in rows if 'eval_accuracy' in r]}, "
        f"mfu {[round(r['train_mfu'], 4) for r in steps]}"
    )


def test_grpo_dapo_reward_model_eval(rm_dir, tmp_path):
    # (--dynamic-sampling is refused with --reward-model: it decides while the engine is awake)
    rows, output = train(
        "train_grpo.py",
        tmp_path,
        "--reward-model",
        rm_dir,
        "--max-new-tokens",
        "16",
        "--overlong-buffer",
        "8",
        "--mask-truncated",
    )
    check_common(rows, tmp_path, output, min_extra=-1.0 - 1e-4)
    steps = [r for r in rows if "reward_mean" in r]
    mismatch = [r["logprob_mismatch"] for r in steps if "logprob_mismatch" in r]
    print(f"logprob_mismatch {mismatch}, truncated_frac {[r['truncated_frac'] for r in steps]}")
    assert mismatch and max(mismatch) < 0.05, mismatch  # the engine samples the trainer's weights


def test_ppo_reward_model_eval(rm_dir, tmp_path):
    rows, output = train(
        "train_ppo.py",
        tmp_path,
        "--reward-model",
        rm_dir,
        "--pack",  # + packed passes,
        "--micro-batch-tokens",
        "1024",
        "--logprob-micro-batch-tokens",
        "4096",
    )  # larger forward-only
    check_common(rows, tmp_path, output)
