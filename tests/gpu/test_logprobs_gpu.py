"""GPU: vocab_parallel_logprobs with its torch.compile'd kernels against a float64 reference.

    python -m pytest -q -s tests/gpu/test_logprobs_gpu.py
Skipped without CUDA. The CPU tests (tests/test_rl.py) check the same functions in eager mode
and their inductor-CPU compilation; this checks what a GPU run executes: Triton kernels on bf16
logits of the real size (Qwen2's 151936-entry vocabulary, 4096 tokens), with vocabulary padding.

  1. logprobs, entropy and the gradient of (logprobs * w + entropy * w2).sum(), compiled, are
     as close to float64 torch.log_softmax on the same bf16 values as eager mode is
     (x1.5 + 1e-6 of eager's max error), and the gradient is 0 on the padding columns;
  2. a second, shorter micro-batch runs too (a recompile with a symbolic length: no error);
  3. peak memory above the logits themselves is smaller compiled than eager, and the two
     timings are printed (bench/train.py --profile reports them for the bench shapes).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch

from common.rl import fused
from common.rl.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
V_LOCAL, VOCAB = 151936 + 64, 151936  # 64 padding columns


def reference(logits, targets, w, w2):
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x[..., :VOCAB], dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w).sum() + (ent * w2).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def run(mode, logits, targets, w, w2):
    fused.COMPILE = mode == "compiled"
    x = logits.detach().clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    lp, ent = vocab_parallel_logprobs(x, targets, VOCAB, compute_entropy=True)
    ((lp * w).sum() + (ent * w2).sum()).backward()
    torch.cuda.synchronize()
    return lp, ent, x.grad, time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base


def test_compiled_matches_float64_reference():
    torch.manual_seed(0)
    results = {}
    for tokens in (4096, 1000):  # a second length: the dynamic-shape kernels are reused
        logits = (3 * torch.randn(1, tokens, V_LOCAL, device="cuda")).bfloat16()
        targets = torch.randint(0, VOCAB, (1, tokens), device="cuda")
        w, w2 = torch.randn(1, tokens, device="cuda"), torch.randn(1, tokens, device="cuda")
        ref_lp, ref_ent, ref_grad = reference(logits, targets, w, w2)
        for mode in ("eager", "compiled", "compiled"):  # the second compiled run is the timed one
            lp, ent, grad, seconds, extra = run(mode, logits, targets, w, w2)
            results[mode] = dict(
                lp=(lp.double() - ref_lp).abs().max().item(),
                ent=(ent.double() - ref_ent).abs().max().item(),
                grad=(grad.double() - ref_grad).abs().max().item(),
                pad=grad[..., VOCAB:].abs().max().item(),
                seconds=seconds,
                extra_gb=extra / 1e9,
            )
        print(tokens, results)
        for key in ("lp", "ent", "grad"):
            assert results["compiled"][key] <= 1.5 * results["eager"][key] + 1e-6, (key, results)
        assert results["compiled"]["pad"] == 0.0
        assert results["compiled"]["extra_gb"] < results["eager"]["extra_gb"], results
