"""common/train/setup.py: setup_training's optimizer (torch's fused AdamW in megatron's wrapper)
steps as Adam written out by hand from the same gradients (worker: tests/batch_worker.py adam).

    .venv/bin/python -m pytest -q tests/test_training.py
"""

import json
import os
import subprocess
import sys

import torch

from tests.conftest import ROOT, run_batch_worker


def test_train_step_is_adamw_by_hand(tmp_path):
    """Two optimizer steps of setup_training's (fused) AdamW equal the formula applied here to
    the same gradients, and the gradient norm it reports (common/train/setup.py's foreach norm,
    not megatron's fallback) equals the one computed here; then again with the gradients
    clipped to a total norm of 0.05 (common/train/setup.py's foreach multiply): both steps clip.
    With bf16 parameters, the distributed optimizer's copies from lists (common/train/setup.py
    ListedCopies) leave nothing for megatron's own copies to change: the same grad views, the
    same parameter bits."""
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model("qwen2", str(tmp_path / "qwen2"))
    proc = subprocess.run(
        [sys.executable, "tests/batch_worker.py", str(tmp_path / "qwen2"), "adam"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    listed = results.pop()  # common/train/setup.py's listed copies against megatron's, a bf16 model
    print(listed)
    assert set(listed["listed"]) == {"ListedCopies"}, listed
    assert listed["shards"] >= listed["params"] and listed["changed"] == listed["params"], listed
    assert listed["megatron_differs"] == 0, listed
    assert [r["clip_grad"] for r in results] == [0.0, 0.05]
    for r in results:
        print(r)
        assert r["fused"]
        assert r["max_err"] < 1e-6  # the step itself is lr = 1e-2 per element
        assert r["optimizer"] == "ForeachNormOptimizer"
        assert r["grad_norm_rel_err"] < 1e-6
        assert r["clipped"] == [r["clip_grad"] > 0] * 2


def test_fused_wgrad_accumulation_equals_megatrons(tmp_path):
    """Weight gradients accumulated inside the GEMM (common/train/setup.py, with
    common/model/cpu_compat.py's stand-in for apex's kernel) equal megatron's own path over three
    micro-batches: every parameter's main_grad, with untied and tied embeddings (the tied
    weight gets the LM head's gradient in the GEMM and the embedding's through DDP's hook), and
    an MoE model's grouped experts (their gradients added per layer, common/model/moe_experts.py). The Qwen2
    models' QKV bias added in the GEMM (common/model/linear.py) against megatron's separate add, too.
    With the distributed optimizer the MoE experts' GEMMs read their weights in place in
    megatron's buffer, and their gradients are added in place there: the same bits again."""
    names = ("qwen2", "qwen2_tied", "qwen3_moe")
    for name, r in zip(names, run_batch_worker(tmp_path, "wgrad", names)):
        print(name, r)
        assert r["float32"]["tied"] == (name == "qwen2_tied")
        assert r["float32"]["layers"] >= 4 * 2 + 1  # qkv, proj, fc1, fc2 per layer (2 layers) + the LM head
        assert r["float32"]["max_rel_err"] < 1e-6, r  # a doubled or a lost gradient would be >= 1
        # bf16: megatron's path rounds each micro-batch's gradient to bf16 first, the fused one does not
        assert r["bfloat16"]["max_rel_err"] < 1e-2, r
        for dtype in ("float32", "bfloat16"):  # common/model/linear.py vs megatron's matmul + add
            assert r[dtype]["bias_in_gemm_layers"] == (4 if name.startswith("qwen2") else 0), r  # QKV of 4 layers
        assert r["float32"]["bias_in_gemm_max_rel_err"] < 1e-6, r
        # bf16: as close to the fp32 gradients as megatron's separate add, or closer
        assert r["bfloat16"]["bias_in_gemm_from_fp32"] <= 1.1 * r["bfloat16"]["bias_add_from_fp32"], r
        if name == "qwen3_moe":  # grouped experts: the same bf16 gradient cast and added, per layer: equal bits
            for dtype in ("float32", "bfloat16"):
                assert r[dtype]["expert_params"] >= 8 * 2 * 2, r  # 8 experts x fc1/fc2 in >= 2 MoE layers
                assert r[dtype]["experts_nonzero"] == r[dtype]["expert_params"], r  # every expert got tokens
                assert r[dtype]["experts_max_abs_diff"] == 0.0, r
            # with the distributed optimizer the GEMMs read the weights in place (megatron's buffer,
            # last expert first) and add the gradients with one add per layer: the same bits
            in_place = r["in_place"]
            assert in_place["layers"] == in_place["moe_layers"] >= 2 and in_place["descending"] == [True], r
            assert in_place["experts_max_abs_diff"] == 0.0, r


def test_qkv_bias_in_gemm_is_megatrons_linear_function():
    """common/model/linear.py's autograd function: megatron's linear function with the bias in an addmm.
    Output, input / weight / bias gradients equal megatron's own (fp32), and the output really
    comes from the new function (its backward node), with and without a TP group's all-reduce
    flag off (TP=1)."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Megatron

    from common.model.linear import _LinearBiasInGemm

    gen = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(shape, generator=gen) for shape in ((6, 3, 8), (12, 8), (12,)))
    grad = torch.randn(6, 3, 12, generator=gen)
    results = []
    for fn in (Megatron, _LinearBiasInGemm):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        out = fn.apply(x, w, b, False, False, False, None, None, None)
        out.backward(grad)
        results.append((out.detach(), x.grad, w.grad, b.grad, type(out.grad_fn).__name__))
    for mine, ref in zip(results[1][:4], results[0][:4]):
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
    assert results[1][4] == "_LinearBiasInGemmBackward", results[1][4]
    torch.testing.assert_close(results[1][0], x0 @ w0.t() + b0, rtol=1e-6, atol=1e-6)  # and the function itself
