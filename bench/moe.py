"""Benchmark MoE experts: grouped GEMMs (common/model/moe_experts.py's GroupedExperts) vs megatron's per-expert loop.

    python bench/moe.py                          # 1 GPU: Qwen3-30B-A3B-shaped layers
    python bench/moe.py --shape tiny --reps 2    # CPU smoke run (no grouped path on a CPU: ratio ~1)

A GPTModel of --layers Qwen3-30B-A3B decoder layers (hidden 2048, 32 heads / 4 KV groups of
128, 128 experts of 768, top-8, renormalised; the published config, fewer layers and a small
vocabulary so that the experts dominate), random bf16 weights, built by common/model/gpt.py at
EP=1 on one GPU. Each repetition times one forward + backward of --tokens tokens (one
sequence) twice, with the experts grouped and with SequentialMLP's loop over experts, the
order alternating between repetitions (CUDA synchronised; harness.run_pairs). The comparison
is per pair: ratio = loop seconds / grouped seconds of the same repetition, and the median of
the ratios with their min and max (harness.paired_ratios).

Output: a table and one `BENCH_JSON {...}` line (medians over --reps after one warm-up pair).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

# Qwen3-30B-A3B's config.json (transformer fields), layers and vocabulary set by the flags
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="model shape")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (every one MoE)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size (small: the experts dominate)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per forward + backward (one sequence)")
    ap.add_argument("--reps", type=int, default=5, help="timed pairs after one warm-up pair")
    args = ap.parse_args()

    from harness import paired_ratios, run_pairs, timed

    from common.model.bridge import parse_hf_config
    from common.model.gpt import build_model
    from common.model.moe_experts import GroupedExperts
    from common.run.dist import init_distributed

    info = init_distributed()
    on_gpu = info.device.type == "cuda"
    spec = parse_hf_config(
        dict(
            SHAPES[args.shape],
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=args.vocab,
            num_hidden_layers=args.layers,
        )
    )
    dtype = torch.bfloat16 if on_gpu else torch.float32
    chunks = build_model(spec, dtype=dtype, init_weights=True)
    model = chunks[0]
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    generator = torch.Generator(device=info.device).manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, args.tokens), device=info.device, generator=generator)
    positions = torch.arange(args.tokens, device=info.device)[None]

    def step(grouped):
        for m in experts:
            m.grouped = grouped
        for p in model.parameters():
            p.grad = None
        model(tokens, positions, None).float().logsumexp(-1).mean().backward()

    # loop, grouped, then grouped, loop, ...; the first pair warms up (allocator, kernels)
    loop_s, grouped_s = run_pairs(
        lambda _: timed(lambda: step(False), info.device), lambda _: timed(lambda: step(True), info.device), args.reps
    )
    stats = paired_ratios(loop_s, grouped_s)  # loop seconds / grouped seconds: the speed-up
    ratios = stats["ratios"]
    result = {
        "loop_s": stats["a_median"],
        "grouped_s": stats["b_median"],
        "speedup_median_of_pairs": stats["median"],
        "speedup_min": stats["min"],
        "speedup_max": stats["max"],
    }
    settings = dict(
        shape=args.shape,
        layers=args.layers,
        tokens=args.tokens,
        reps=args.reps,
        dtype=str(dtype),
        device=torch.cuda.get_device_name() if on_gpu else "cpu",
        grouped_path=on_gpu,
    )  # on a CPU both sides run the loop
    print(f"{args.shape} x {args.layers} layers, {args.tokens} tokens, fwd+bwd, {settings['device']}")
    print(f"  per-expert loop  {result['loop_s'] * 1e3:9.1f} ms (median)")
    print(f"  grouped GEMMs    {result['grouped_s'] * 1e3:9.1f} ms (median)")
    print(
        f"  loop / grouped   {result['speedup_median_of_pairs']:9.2f}x (median of {len(ratios)} per-pair ratios: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + ")"
    )
    print(
        "BENCH_JSON "
        + json.dumps(
            dict(settings, ratios=[round(r, 4) for r in ratios], **{k: float(f"{v:.6g}") for k, v in result.items()})
        )
    )


if __name__ == "__main__":
    main()
