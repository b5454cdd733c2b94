"""--off-policy-steps on a GPU with the colocated vLLM engine (docs/async.md): partial rollouts continued as
token-id requests across weight syncs, both scripts, the embedded tiny model.

    python -m pytest -q -s tests/gpu/test_async_gpu.py     (GPU machine, stack of shared/device)

Responses of 16 tokens in chunks of 4 (the random model rarely ends early), K = 1, 4 steps. Checked: exit 0;
step 0 trains fresh samples continued chunk by chunk under one set of weights, so the engine's logprobs of every
continued token agree with the trainer's (logprob_mismatch < 0.05: continuations are token in, token out); later
steps train samples of age 1, some of them written by two policies (partial_frac > 0), none dropped; the
IcePop correction ran (its metrics are logged). Printed: rollout_s per step and the staleness metrics.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import run_script  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

FLAGS = ["--steps", "4", "--prompts-per-step", "8", "--samples-per-prompt", "4", "--mini-batch-size", "32"]
FLAGS += ["--max-new-tokens", "16", "--off-policy-steps", "1", "--partial-chunk-tokens", "4", "--eval-every", "0"]


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_partial_rollouts_on_vllm(script, tmp_path):
    rows, _ = run_script(script, tmp_path, *FLAGS, "--rollout", "vllm", timeout=540)  # a hang fails with stacks
    keys = ["rollout_s", "staleness_share_1", "partial_frac", "dropped_samples", "logprob_mismatch"]
    for r in rows:
        print(script, {k: r.get(k) for k in keys})
    assert rows[0]["staleness_share_0"] == 1.0 and rows[0]["logprob_mismatch"] < 0.05
    assert all(r["staleness_share_1"] == 1.0 and r["dropped_samples"] == 0 for r in rows[1:])
    assert any(r["partial_frac"] > 0 for r in rows[1:])
    assert all("correction_masked_frac" in r for r in rows)
