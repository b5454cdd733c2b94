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
Context parallelism's flash path (each CP rank's chunks against their key prefixes) against
its masked path, per rank, in test_context_parallel_prefixes_flash.
Results go to $OUT/packing_gpu.json and $OUT/cp_prefixes_gpu.json when OUT is set.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch

SHAPE = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def rel(a, b):
    return float((a - b).float().norm() / b.float().norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_packed_bf16_as_accurate_as_padded():
    from common.model import attention
    from common.model.bridge import parse_hf_config
    from common.model.gpt import build_model
    from common.rl import batch as B
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss
    from common.rollout.engine import Sample
    from common.run.dist import init_distributed
    from common.train import schedule

    info = init_distributed()
    spec = parse_hf_config(SHAPE)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):  # long-tailed: many short responses, a few long
        p, r = 20 + i % 7 * 10, int(20 * 1.25**i) % 1500 + 20
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
            logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            B.scatter_tokens(store, mb, logprobs.detach().float())
            return aggregate_loss(-logprobs.float(), mb["mask"], "token_mean", num_tokens=num_tokens) * len(mbs), {}

        torch.cuda.synchronize()
        start = time.perf_counter()
        schedule.run_micro_batches([model], mbs, loss_fn, forward_only=False, device=info.device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return store[:-1].cpu(), grads, seconds

    ref_lp, ref_grad, _ = score(fp32, padded)
    del fp32
    bf16 = build_model(spec, dtype=torch.bfloat16, init_weights=True)[0]
    bf16.load_state_dict(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, strict=False
    )

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
        padded_logprob_err=rel(pad_lp[mask], ref_lp[mask]),
        packed_logprob_err=rel(pack_lp[mask], ref_lp[mask]),
        masked_logprob_err=rel(mask_lp[mask], ref_lp[mask]),
        padded_grad_err=rel(pad_grad, ref_grad),
        packed_grad_err=rel(pack_grad, ref_grad),
        masked_grad_err=rel(mask_grad, ref_grad),
        padded_s=pad_s,
        packed_s=pack_s,
        masked_packed_s=mask_s,
        padded_tokens=sum(mb["tokens"].numel() for mb in padded),
        packed_tokens=sum(mb["tokens"].numel() for mb in packed),
        real_tokens=int(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)),
        device=torch.cuda.get_device_name(),
    )
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "packing_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    for kind in ("packed", "masked"):
        assert result[f"{kind}_logprob_err"] <= 1.5 * result["padded_logprob_err"] + 1e-3, kind
        assert result[f"{kind}_grad_err"] <= 1.5 * result["padded_grad_err"] + 1e-3, kind


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_context_parallel_prefixes_flash():
    """Context parallelism's GPU path (common/model/attention.py:context_parallel_prefix_attention
    through SDPAttention._varlen: each CP rank's two chunks against their key prefixes, varlen
    flash attention with bottom-right causal alignment) against the masked path every device
    can run (SDPA with the (s, cp*s) global-position mask), per CP rank, no process group
    needed: the rank's queries and the gathered keys/values are built here. bf16 outputs and
    q/k/v gradients no further from the fp32 masked result than the bf16 masked ones (x1.5 +
    1e-3), at cp 2 and 4 with 7B's GQA (28 heads on 4 groups of 128), for padded rows and for
    packed rows of 5 samples (context_parallel_packed_prefixes). Then the time of one rank's
    forward + backward both ways at 2 x 16384 tokens (cp 2: one 32k sequence)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from common.model.attention import SDPAttention
    from common.model.attention_cp import context_parallel_prefix_attention, split_prefix_attention
    from common.run.dist import init_distributed

    init_distributed()
    heads, groups, d = 28, 4, 128
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    module = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")

    def positions(h, cp, r):
        return torch.cat([torch.arange(r * h, (r + 1) * h), torch.arange((2 * cp - 1 - r) * h, (2 * cp - r) * h)])

    def masked(q, k, v, cp, rank):  # SDPAttention._context_parallel's mask path, after the gather
        h = q.shape[0] // 2
        k_pos = torch.cat([positions(h, cp, r) for r in range(cp)]).cuda()
        allowed = k_pos[None, :] <= positions(h, cp, rank).cuda()[:, None]
        q_, k_, v_ = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        k_, v_ = (x.repeat_interleave(heads // groups, 1) for x in (k_, v_))
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, scale=module.softmax_scale).permute(
            2, 0, 1, 3
        )

    def flash(q, k, v, cp, rank):
        return context_parallel_prefix_attention(q, k, v, cp, rank, module._varlen)

    def split(q, k, v, cp, rank):  # cuDNN: earlier keys unmasked + own chunk causal, merged by log-sum-exp
        return split_prefix_attention(q, k, v, cp, rank, module.softmax_scale, "cudnn")

    def run(fn, inputs, weights, dtype, cp, rank):
        xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*xs, cp, rank)
        (out.float() * weights).sum().backward()
        return [out.float()] + [x.grad.float() for x in xs]

    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name()}
    for cp in (2, 4):
        h = 512
        s = 2 * h
        for rank in range(cp):
            inputs = [
                torch.randn(s, 1, heads, d, generator=g, device="cuda"),
                torch.randn(cp * s, 1, groups, d, generator=g, device="cuda"),
                torch.randn(cp * s, 1, groups, d, generator=g, device="cuda"),
            ]
            weights = torch.randn(s, 1, heads, d, generator=g, device="cuda")
            reference = run(masked, inputs, weights, torch.float32, cp, rank)
            errors = {
                name: [rel(a, b) for a, b in zip(run(fn, inputs, weights, torch.bfloat16, cp, rank), reference)]
                for name, fn in (("masked", masked), ("flash", flash), ("split", split))
            }
            result[f"cp{cp}_rank{rank}"] = errors
            for kind in ("flash", "split"):
                for err, masked_err in zip(errors[kind], errors["masked"]):  # out, dq, dk, dv
                    assert err <= 1.5 * masked_err + 1e-3, (kind, cp, rank, errors)
    # packed rows under CP: each sample's two chunks per rank against their prefixes (flash) vs the mask
    from common.model.attention_cp import context_parallel_packed_prefixes
    from common.rl.batch import thd_context_parallel_layout

    for cp in (2, 4):
        cu = torch.tensor([0, 1024, 256, 512, 2048, 256]).cumsum(0).int().cuda()  # multiples of 2cp
        total = int(cu[-1])
        k_sample, k_pos = (
            torch.cat(p) for p in zip(*(thd_context_parallel_layout(cu, cp, r, total // cp) for r in range(cp)))
        )

        def packed_masked(q, k, v, cp, rank):
            q_sample, q_pos = thd_context_parallel_layout(cu, cp, rank, total // cp)
            allowed = (q_sample[:, None] == k_sample[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            q_, k_, v_ = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
            k_, v_ = (x.repeat_interleave(heads // groups, 1) for x in (k_, v_))
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, scale=module.softmax_scale)
            return out.squeeze(0).permute(1, 0, 2)

        def packed_flash(q, k, v, cp, rank):
            index, cu_q, cu_k = context_parallel_packed_prefixes(cu, cp, rank, total)
            chunk = 2048 // (2 * cp)
            return module._varlen(
                q, k.index_select(0, index), v.index_select(0, index), cu_q, cu_k, chunk, (2 * cp - rank) * chunk
            )

        for rank in range(cp):
            inputs = [
                torch.randn(total // cp, heads, d, generator=g, device="cuda"),
                torch.randn(total, groups, d, generator=g, device="cuda"),
                torch.randn(total, groups, d, generator=g, device="cuda"),
            ]
            weights = torch.randn(total // cp, heads, d, generator=g, device="cuda")
            reference = run(packed_masked, inputs, weights, torch.float32, cp, rank)
            errors = {
                name: [rel(a, b) for a, b in zip(run(fn, inputs, weights, torch.bfloat16, cp, rank), reference)]
                for name, fn in (("masked", packed_masked), ("flash", packed_flash))
            }
            result[f"packed_cp{cp}_rank{rank}"] = errors
            for flash_err, masked_err in zip(errors["flash"], errors["masked"]):
                assert flash_err <= 1.5 * masked_err + 1e-3, (cp, rank, errors)
    # speed: one rank of cp 2 on a 32k-token sequence, forward + backward, paired, median of 3
    cp, h = 2, 8192
    s = 2 * h
    inputs = [
        torch.randn(s, 1, heads, d, device="cuda", dtype=torch.bfloat16),
        torch.randn(cp * s, 1, groups, d, device="cuda", dtype=torch.bfloat16),
        torch.randn(cp * s, 1, groups, d, device="cuda", dtype=torch.bfloat16),
    ]
    weights = torch.randn(s, 1, heads, d, device="cuda")

    def seconds(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(fn, inputs, weights, torch.bfloat16, cp, 0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    seconds(masked), seconds(flash), seconds(split)  # warm-up
    runs = [(seconds(masked), seconds(flash), seconds(split)) for _ in range(3)]
    result["speed_32k_cp2_rank0"] = dict(
        masked_s=[r[0] for r in runs],
        flash_s=[r[1] for r in runs],
        split_s=[r[2] for r in runs],
        masked_over_flash=sorted(m / f for m, f, _ in runs)[1],
        flash_over_split=sorted(f / c for _, f, c in runs)[1],
    )
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cp_prefixes_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
