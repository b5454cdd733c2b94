"""Model-based rewards (common/train/reward_model.py): an HF Qwen2ForSequenceClassification scored by
the Megatron model at TP=1, TP=2 and CP=2 equals transformers (fp32), and train_grpo.py
--reward-model trains with it (at --cp 2).

    .venv/bin/python -m pytest -q tests/test_reward_model.py
"""

import json

import pytest

from tests.conftest import read_metrics, run_script, run_torchrun


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A random-weight reward model of the embedded model's shape, with its tokenizer (chat template)."""
    import torch
    import transformers

    from common.run.embedded import write_embedded_model

    root = tmp_path_factory.mktemp("rm")
    src = write_embedded_model(str(root / "src"))
    config = transformers.AutoConfig.from_pretrained(src)
    config.architectures, config.num_labels = ["Qwen2ForSequenceClassification"], 1
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(config).float().save_pretrained(root / "rm")
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(root / "rm")
    return root / "rm"


@pytest.mark.parametrize("ranks", [1, 2])
def test_scores_equal_transformers(rm_dir, tmp_path, ranks):
    """One rank; two ranks at TP=2, then CP=2 (each text cut over the CP ranks, the score read
    where its last token is: on rank 0 for some texts, rank 1 for others) in the same launch."""
    out = tmp_path / "scores.json"
    if ranks == 1:
        run_script("tests/reward_model_worker.py", rm_dir, out)
    else:
        run_torchrun("tests/reward_model_worker.py", 2, rm_dir, out, "--layouts", "tp2", "cp2")
    result = json.loads(out.read_text())
    assert result["templated"]  # the reward model's own chat template made its text
    if ranks == 2:
        assert sorted(set(result["last_token_ranks"]["cp2"])) == [0, 1]
    for layout, scores in result["scores"].items():
        assert len(set(scores)) == 3, layout  # three different texts, three different scores
        for ours, theirs in zip(scores, result["transformers"], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-5), layout


def test_refusals(rm_dir, tmp_path):
    from common.model.unsupported import UnsupportedModelError
    from common.train.reward_model import reward_model_spec

    config = json.loads((rm_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for change, says in (
        ({"num_labels": 2, "id2label": {"0": "a", "1": "b"}}, "num_labels must be 1"),
        ({"architectures": ["GPT2ForSequenceClassification"]}, "not a reward model the bridge supports"),
    ):
        (bad / "config.json").write_text(json.dumps(dict(config, **change)))
        with pytest.raises(UnsupportedModelError, match=says):
            reward_model_spec(str(bad))


def test_train_grpo_with_a_reward_model(rm_dir, tmp_path):
    """reward = 0.5 x rule + 2 x score, at --cp 2 (the reward model sharded like the policy, its
    texts cut over the CP ranks): the scores' statistics and seconds are logged, and the logged
    reward is that combination (rule rewards are 0 or 1 on the embedded task)."""
    run_torchrun(
        "train_grpo.py",
        2,
        "--cp",
        2,
        "--prompts-per-step",
        4,
        "--samples-per-prompt",
        4,
        "--micro-batch-size",
        4,
        "--mini-batch-size",
        16,
        "--max-new-tokens",
        4,
        "--steps",
        2,
        "--out",
        tmp_path,
        "--reward-model",
        rm_dir,
        "--reward-model-weight",
        2,
        "--rule-reward-weight",
        0.5,
    )
    for m in read_metrics(tmp_path):
        assert m["reward_model_s"] > 0 and m["rm_score_std"] > 0
        rule_part = m["reward_mean"] - 2 * m["rm_score_mean"]
        assert 0 <= rule_part <= 0.5 + 1e-5


def test_train_ppo_with_a_reward_model(rm_dir, tmp_path):
    """The reward model alone (--rule-reward-weight 0): the logged reward is its mean score."""
    run_script(
        "train_ppo.py",
        "--prompts-per-step",
        4,
        "--samples-per-prompt",
        4,
        "--micro-batch-size",
        4,
        "--mini-batch-size",
        16,
        "--max-new-tokens",
        4,
        "--steps",
        2,
        "--out",
        tmp_path,
        "--reward-model",
        rm_dir,
        "--rule-reward-weight",
        0,
    )
    for m in read_metrics(tmp_path):
        assert m["reward_model_s"] > 0
        assert m["reward_mean"] == pytest.approx(m["rm_score_mean"], abs=1e-5)
