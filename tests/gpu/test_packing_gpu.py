"""GPU: packed passes (torch varlen flash attention) against padded ones (SDPA causal), bf16.

    python -m pytest -q -s tests/gpu/test_packing_gpu.py                  # 1 GPU
Skipped without CUDA. The CPU equivalence (fp32, <= 1e-5 at 1 rank, TP=2+SP, PP=2, EP=2)
is tests/test_packing.py; there the packed path is SDPA with a block-diagonal mask.

A 4-layer Qwen2-1.5B-shaped model with random weights scores 24 samples of 40 to 1500
tokens three ways: padded micro-batches in fp32 (the reference), padded in bf16, and packed
in bf16 through varlen_attn (checked to be the kernel that runs). The packed bf16 logprobs
and parameter gradients must be no further from the fp32 reference than the padded bf16
ones (relative error norm, x1.5 + 1e-3). The masked-SDPA fallback (attention.VARLEN off)
is checked the same way, and the packed pass's time against the padded pass's is printed.
Results go to $OUT/packing_gpu.json when OUT is set.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch

SHAPE = dict(architectures=["Qwen2ForCausalLM"], vocab_size=32000, hidden_size=1536, intermediate_size=8960,
             num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def rel(a, b):
    return float((a - b).float().norm() / b.float().norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_packed_bf16_as_accurate_as_padded():
    from common import attention
    from common import batch as B
    from common import rl
    from common.bridge import parse_hf_config
    from common.dist import init_distributed
    from common.model import build_model
    from common.rollout import Sample

    info = init_distributed()
    spec = parse_hf_config(SHAPE)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):  # long-tailed: many short responses, a few long
        p, r = 20 + i % 7 * 10, int(20 * 1.25 ** i) % 1500 + 20
        ids = torch.randint(3, spec.vocab_size, (p + r,), generator=gen).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * r, "stop"))
    batch = B.pack_sequences(samples, pad_id=0)
    batch["row"] = torch.arange(len(samples))
    rows = torch.arange(len(samples))
    padded = B.micro_batches(batch, rows, 4, max_tokens=8192)
    packed = B.micro_batches(batch, rows, 4, max_tokens=8192, pack=True)
    mask = batch["mask"].bool()
    num_tokens = batch["mask"].sum()

    torch.manual_seed(0)
    fp32 = build_model(spec, dtype=torch.float32, init_weights=True)[0]
    state = {k: v.clone() for k, v in fp32.state_dict().items() if torch.is_tensor(v)}  # (not _extra_state)

    def score(model, mbs):
        store = torch.zeros(len(samples) + 1, mask.shape[1], device=info.device)
        for p in model.parameters():
            p.grad = None

        def loss_fn(mb, logits):
            logprobs, _ = rl.vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            B.scatter_tokens(store, mb, logprobs.detach().float())
            return rl.aggregate_loss(-logprobs.float(), mb["mask"], "token_mean", num_tokens=num_tokens) * len(mbs), {}

        torch.cuda.synchronize()
        start = time.perf_counter()
        B.run_micro_batches([model], mbs, loss_fn, forward_only=False, device=info.device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return store[:-1].cpu(), grads, seconds

    ref_lp, ref_grad, _ = score(fp32, padded)
    del fp32
    bf16 = build_model(spec, dtype=torch.bfloat16, init_weights=True)[0]
    bf16.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
                         strict=False)

    calls = []
    original = attention.varlen_usable
    attention.varlen_usable = lambda q: calls.append(original(q)) or calls[-1]
    try:
        score(bf16, packed)  # warm-up (compiled RoPE, kernels)
        score(bf16, padded)
        pad_lp, pad_grad, pad_s = score(bf16, padded)
        calls.clear()
        pack_lp, pack_grad, pack_s = score(bf16, packed)
        assert calls and all(calls), "the packed pass did not run on varlen_attn"
        attention.VARLEN = False
        mask_lp, mask_grad, mask_s = score(bf16, packed)
    finally:
        attention.VARLEN = True
        attention.varlen_usable = original
    result = dict(
        padded_logprob_err=rel(pad_lp[mask], ref_lp[mask]), packed_logprob_err=rel(pack_lp[mask], ref_lp[mask]),
        masked_logprob_err=rel(mask_lp[mask], ref_lp[mask]),
        padded_grad_err=rel(pad_grad, ref_grad), packed_grad_err=rel(pack_grad, ref_grad),
        masked_grad_err=rel(mask_grad, ref_grad),
        padded_s=pad_s, packed_s=pack_s, masked_packed_s=mask_s,
        padded_tokens=sum(mb["tokens"].numel() for mb in padded), packed_tokens=sum(mb["tokens"].numel() for mb in packed),
        real_tokens=int(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)),
        device=torch.cuda.get_device_name())
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "packing_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    for kind in ("packed", "masked"):
        assert result[f"{kind}_logprob_err"] <= 1.5 * result["padded_logprob_err"] + 1e-3, kind
        assert result[f"{kind}_grad_err"] <= 1.5 * result["padded_grad_err"] + 1e-3, kind
