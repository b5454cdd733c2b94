"""Benchmark sequence packing against dynamic padding: trainer tokens/s on long-tailed lengths.

    python bench/packing.py                                  # 1 GPU, Qwen2-1.5B shape
    python bench/packing.py --shape qwen2-7b --layers 8      # 7B layers (truncated to fit one GPU)
    python bench/packing.py --shape tiny --samples 16 --max-len 256 --reps 1   # CPU smoke run
    torchrun --nproc_per_node 2 bench/packing.py --shape qwen2-7b --layers 8 --cp 2 --max-len 16384 \
        --micro-batch-tokens 32768                           # context parallelism: both ways cut over 2 GPUs

The work: one GRPO-like training step of the trainer (forward + backward of a token-mean
loss of the vocabulary-parallel logprobs over every micro-batch, megatron DDP, the optimizer
step) on --samples samples whose lengths are drawn like reasoning responses: a prompt of
64-256 tokens and a response whose length is log-normal (median --max-len / 8, many short)
with 10% cut off at the budget (--max-len). The same samples, both ways:
  padded  today's best padding: length-sorted micro-batches, each cut after its longest row,
          as many rows as fit in --micro-batch-tokens padded tokens (batch.micro_batches)
  packed  the samples back to back in rows of up to --micro-batch-tokens tokens
          (batch.packed_micro_batches; varlen flash attention on a GPU)
With --cp N (torchrun, N processes) every pass is cut over the N ranks (2N chunks per row, per
sample when packed; each sample padded to 2N) and --micro-batch-tokens counts the whole pass.
Timed in interleaved pairs (padded, packed, packed, padded, ...; --reps pairs after one
warm-up pair; harness.run_pairs), CUDA synchronised. Reported: real tokens (prompt +
response) per second of each, the medians, and the median of the per-pair ratios packed /
padded with its min and max (harness.paired_ratios), and flop_ratio: the model FLOPs of the
padded passes over the packed ones (common/model/flops.py, attention within each sequence), the
most that removing the padding gains at equal FLOP/s. Random weights: the speed depends on
the shapes only.
"""

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402


def lengths(num, max_len, seed):
    """(prompt, response) lengths: prompts uniform in 64..256, responses log-normal (median
    max_len / 8, sigma 1) capped at max_len, and every tenth exactly max_len (cut off)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_max = min(256, max(max_len // 4, 8))
    prompts = torch.randint(min(64, prompt_max // 2), prompt_max + 1, (num,), generator=gen)
    responses = (torch.randn(num, generator=gen) + math.log(max_len / 8)).exp().clamp(1, max_len).long()
    responses[::10] = max_len
    return prompts.tolist(), responses.tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2-1.5b", help="bench/harness.py SHAPES name")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--samples", type=int, default=64, help="samples per step")
    ap.add_argument("--max-len", type=int, default=4096, help="response budget (max new tokens)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="tokens per pass (padded: rows x cut)")
    ap.add_argument("--reps", type=int, default=5, help="timed pairs after one warm-up pair")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and token ids")
    ap.add_argument(
        "--cp", type=int, default=1, help="context parallel size (run under torchrun with this many processes)"
    )
    args = ap.parse_args()

    from harness import SHAPES, paired_ratios, run_pairs, timed

    from common.model.bridge import parse_hf_config
    from common.model.flops import forward_flops_per_token
    from common.model.gpt import build_model
    from common.rl import batch as B
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss
    from common.rollout.engine import Sample
    from common.run.dist import init_distributed
    from common.train import schedule
    from common.train.setup import setup_training

    info = init_distributed(cp=args.cp)
    on_gpu = info.device.type == "cuda"
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    spec = parse_hf_config(config)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    chunks = build_model(spec, cp=args.cp, dtype=dtype, init_weights=True)
    model, optimizer, scheduler = setup_training(chunks, lr=1e-7)

    prompts, responses = lengths(args.samples, args.max_len, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    samples = [
        Sample(
            torch.randint(3, spec.vocab_size, (p,), generator=gen).tolist(),
            torch.randint(3, spec.vocab_size, (r,), generator=gen).tolist(),
            [0.0] * r,
            "stop",
        )
        for p, r in zip(prompts, responses)
    ]
    batch = B.pack_sequences(samples, pad_id=0)
    rows = torch.arange(len(samples))
    batch["row"] = rows  # (context_parallel_slice keeps each row's index)
    real_tokens = sum(prompts) + sum(responses)
    num_tokens = batch["mask"].sum()
    multiple, sample_multiple = B.length_multiples(1, args.cp)
    layouts = {
        "padded": B.micro_batches(batch, rows, 1, length_multiple=multiple, max_tokens=args.micro_batch_tokens),
        "packed": B.micro_batches(
            batch,
            rows,
            1,
            length_multiple=multiple,
            max_tokens=args.micro_batch_tokens,
            pack=True,
            sample_multiple=sample_multiple,
        ),
    }

    def model_flops(mb):  # forward FLOPs of a pass: every computed token, attention within each sequence
        if "cu_seqlens" in mb:  # packed: each sample attends over itself (the row's padded tail: nothing)
            seqs = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
        else:  # padded: every row over the micro-batch's cut length
            seqs = [mb["tokens"].shape[1]] * mb["tokens"].shape[0]
        return sum(n * forward_flops_per_token(spec, n) for n in seqs if n)

    def step(mbs):
        def loss_fn(mb, logits):
            logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size)
            return aggregate_loss(-logprobs, mb["mask"], "token_mean", num_tokens=num_tokens) * len(mbs), {}

        schedule.train_step(model, optimizer, scheduler, mbs, loss_fn, info.device)

    # padded, packed, then packed, padded, ...; the first pair warms up (allocator, compiled kernels)
    padded_s, packed_s = run_pairs(
        lambda _: timed(lambda: step(layouts["padded"]), info.device),
        lambda _: timed(lambda: step(layouts["packed"]), info.device),
        args.reps,
    )
    seconds = {"padded": padded_s, "packed": packed_s}
    stats = paired_ratios(seconds["padded"], seconds["packed"])  # padded seconds / packed seconds: the speed-up
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    result = dict(
        shape=args.shape,
        layers=spec.num_layers,
        samples=args.samples,
        max_len=args.max_len,
        micro_batch_tokens=args.micro_batch_tokens,
        real_tokens=real_tokens,
        device=device,
        cp=args.cp,
        passes={k: len(v) for k, v in layouts.items()},
        computed_tokens={k: sum(mb["tokens"].numel() for mb in v) for k, v in layouts.items()},
        # padded FLOPs / packed FLOPs: what removing the padding can gain if every pass ran at
        # the same FLOP/s (more comes only from fewer, fuller passes)
        flop_ratio=sum(map(model_flops, layouts["padded"])) / sum(map(model_flops, layouts["packed"])),
        tokens_per_s={k: real_tokens / statistics.median(v) for k, v in seconds.items()},
        speedup_median=stats["median"],
        speedup_min=stats["min"],
        speedup_max=stats["max"],
        ratios=[round(r, 4) for r in stats["ratios"]],
    )
    if info.rank != 0:
        return
    print(
        f"{args.shape} x {spec.num_layers} layers, {args.samples} samples ({real_tokens} tokens; responses median "
        f"{int(statistics.median(responses))}, max {max(responses)}), passes of <= {args.micro_batch_tokens} tokens, "
        f"{device}"
    )
    for name in layouts:
        print(
            f"  {name:7s} {result['passes'][name]:3d} passes, {result['computed_tokens'][name]:7d} tokens computed, "
            f"{result['tokens_per_s'][name]:10.0f} tokens/s (median step {statistics.median(seconds[name]):.3f} s)"
        )
    print(
        f"  packed / padded speed: median {result['speedup_median']:.2f}x of {len(stats['ratios'])} pairs "
        f"(min {result['speedup_min']:.2f}, max {result['speedup_max']:.2f}); model FLOPs padded / packed "
        f"{result['flop_ratio']:.3f}"
    )
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
