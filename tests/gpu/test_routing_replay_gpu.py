"""GPU: MoE routing replay (--routing-replay rollout, R3) through train_grpo.py on the vLLM engine.

    python -m pytest -q -s tests/gpu/test_routing_replay_gpu.py     (GPU machine, stack of shared/device)

Each launch takes ~2.5 min on an H200 (vLLM start with CUDA graphs ~60 s, the first step, the final
save): run_all.sh runs the one-GPU cases in one entry and the EP=2 cases in another (~10 min each).

Random Qwen3-MoE- and DeepSeek-V3-shaped models (tests/gpu/test_moe_gpu.py, test_deepseek_gpu.py: bf16,
their weight scales) with the embedded byte-level tokenizer; one GRPO step each, every sample's engine
logprobs requested (--rollout-logprobs all), with --routing-replay none and rollout, on one GPU and, with
two, at EP=2 (one vLLM engine per GPU). Read from metrics.jsonl: logprob_mismatch (mean |engine - trainer|
over the sampled tokens) and, under replay, route_mismatch(_update): the share of (token, MoE layer)
pairs whose trainer top-k differs from the experts vLLM chose, at the same weights. Checked: vLLM returns
routes that replay (the run trains), the trainer's routers disagree with vLLM's somewhere (else replay
would be moot), and with replay the mismatch is no larger than without. Results: $OUT/routing_replay.json.
"""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.gpu.script_runs import kept, run_script, save_results  # noqa: E402 (after the path)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ARGS = [
    "--steps", "1", "--prompts-per-step", "32", "--samples-per-prompt", "4", "--max-new-tokens", "64",
    "--rollout-logprobs", "all", "--save-every", "0",
]  # fmt: skip
RESULTS = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from common.run.embedded import build_tokenizer
    from tests.gpu import test_deepseek_gpu as ds
    from tests.gpu import test_moe_gpu as moe

    made = {}
    for name, arch, fields, std in (
        ("qwen3moe", "Qwen3MoeForCausalLM", moe.MODEL, moe.INNER_STD),
        ("deepseek", "DeepseekV3ForCausalLM", ds.MODEL, ds.INNER_STD),
    ):
        out = tmp_path_factory.mktemp(name)
        moe.INNER_STD = std  # write_model's weight scale
        moe.write_model(str(out), arch, fields)
        build_tokenizer().save_pretrained(out)
        made[name] = str(out)
    return made


def train(model, out, ranks, *extra):
    rows, _ = run_script("train_grpo.py", out, "--model", model, *ARGS, *extra, ranks=ranks, timeout=420)
    keep = ("logprob_mismatch", "route_mismatch", "route_mismatch_update", "rollout_s", "step_s")
    return kept([r for r in rows if "logprob_mismatch" in r], keep)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name", ["qwen3moe", "deepseek"])
def test_rollout_routes_replay(models, tmp_path, name, ep):
    if ep > torch.cuda.device_count():
        pytest.skip(f"EP={ep} needs {ep} GPUs")
    layout = ["--ep", str(ep)] if ep > 1 else []
    runs = {
        mode: train(models[name], tmp_path / mode, ep, *layout, "--routing-replay", mode)
        for mode in ("none", "rollout")
    }
    RESULTS[f"{name}_ep{ep}"] = runs
    print("RESULT", name, f"ep{ep}", json.dumps(runs), flush=True)
    save_results("routing_replay.json", RESULTS)
    first = runs["rollout"][0]
    disagree = first.get("route_mismatch", first.get("route_mismatch_update"))
    assert disagree is not None and 0 < disagree < 0.5, first
    assert first["logprob_mismatch"] <= runs["none"][0]["logprob_mismatch"] * 1.05, runs
