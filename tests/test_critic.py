"""The PPO critic (common/model/critic.py build_critic / load_critic_weights) against transformers.

    .venv/bin/python -m pytest -q tests/test_critic.py

Two tiny HF models (tests/tiny_models.py: Qwen2 untied with q/k/v bias, Llama with tied
embeddings and llama3 rope) get a value head `score.weight` (1, H) / `score.bias` (1,) added
to their safetensors. Ground truth from transformers: values = h @ w + b with h the last
hidden state after the final norm; loss = sum(values * c) for a fixed random c, and its
gradients with respect to the head and the final norm. tests/critic_worker.py computes the
same with the megatron critic at TP=1 (a plain process), TP=2 + sequence parallelism and
PP=2 (torchrun, gloo):
  - values (B, T) within 1e-4, aligned with the logprobs (position t: the state before target t);
  - head and final-norm gradients within 1e-4 (a reduce-scatter in the sequence-parallel
    gather's backward would make the norm's gradient tp times too large);
  - from a dir without a score head the head is zero: every value is exactly 0.
"""

import json

import pytest
import torch

from tests.conftest import LayoutLaunches, run_script

MODELS = ["qwen2", "llama"]
TOLERANCE = 1e-4
LAYOUTS = {"tp1": (1, []), "tp2_sp": (2, ["--tp", 2, "--sp"]), "pp2": (2, ["--pp", 2])}


@pytest.fixture(scope="module")
def critic_models(tmp_path_factory):
    """<name>: HF dir with a score head; <name>_plain: the same without; and the expected numbers."""
    from safetensors.torch import load_file, save_file

    from tests.critic_worker import inputs
    from tests.tiny_models import save_tiny_hf_model

    root = tmp_path_factory.mktemp("critic_models")
    ids, c = inputs()
    expected = {}
    for i, name in enumerate(MODELS):
        hf = save_tiny_hf_model(name, str(root / f"{name}_plain"))
        save_tiny_hf_model(name, str(root / name))
        g = torch.Generator().manual_seed(100 + i)
        w, b = torch.randn(1, hf.config.hidden_size, generator=g), torch.randn(1, generator=g)
        path = root / name / "model.safetensors"
        tensors = load_file(str(path))
        save_file(dict(tensors, **{"score.weight": w, "score.bias": b}), str(path), metadata={"format": "pt"})

        w_, b_ = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        hidden = hf.model(input_ids=ids).last_hidden_state  # (B, T, H), after the final norm
        values = hidden @ w_[0] + b_  # (B, T)
        (values * c).sum().backward()
        expected[name] = dict(
            values=values.detach(),
            head_weight_grad=w_.grad.view(-1),
            head_bias_grad=b_.grad,
            norm_grad=hf.model.norm.weight.grad.clone(),
        )
    return root, expected


@pytest.fixture(scope="module")
def critic_runs(critic_models, tmp_path_factory):  # the 2-process layouts share a torchrun launch
    return LayoutLaunches(
        "tests/critic_worker.py", LAYOUTS, ["--models-dir", critic_models[0]], tmp_path_factory.mktemp("critic")
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_critic_matches_transformers(layout, critic_models, critic_runs, tmp_path):
    root, expected = critic_models
    nproc, flags = LAYOUTS[layout]
    if nproc == 1:  # one plain process, as `python train_ppo.py`
        out = tmp_path / "result.json"
        run_script("tests/critic_worker.py", "--models-dir", root, "--out", out, timeout=300)
        results = json.loads(out.read_text())
    else:
        results = critic_runs[layout]
    assert sorted(results) == sorted(MODELS)
    for name, ranks in results.items():
        last = [r for r in ranks if r["last_stage"]]
        assert len(last) == (nproc if "--tp" in flags or nproc == 1 else 1)
        for row in last:
            for key in ["values", "head_weight_grad", "head_bias_grad", "norm_grad"]:
                diff = (torch.tensor(row[key]) - expected[name][key]).abs().max().item()
                print(f"{name} {layout} {key}: max |diff| {diff:.2e}")
                assert diff <= TOLERANCE, (name, layout, key, diff)
            assert row["plain_max_abs_value"] == 0.0
        # the comparison can fail: the values are far from zero and from each other
        assert expected[name]["values"].abs().max() > 0.5
