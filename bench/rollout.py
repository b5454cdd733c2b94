"""Benchmark the rollout phase of train_grpo.py against plain vLLM generate, same engine, same run.

    python bench/rollout.py --shape qwen2-1.5b                               # 1 GPU
    python bench/rollout.py --shape qwen2-7b
    torchrun --nproc_per_node 2 bench/rollout.py --shape qwen2-7b --tp 2 --rollout-tp 2

Random bf16 weights of a Qwen2 shape (bench/harness.py): a Megatron GPTModel, and a VLLMEngine
(common/rollout_vllm.py) on the same GPUs that gets its weights from the sync. Prompts: random
token ids, --num-prompts x --prompt-len, --max-new-tokens each, temperature --temperature.
Each rollout replica (world / rollout TP) takes its share of the prompts, as in training.

  baseline   what a standalone vLLM user runs: llm.generate(prompts, SamplingParams(n, T,
             max_tokens, seed)) with one SamplingParams for the batch, no logprobs, on the
             same LLM object (vLLM allows one engine per process, and the same object keeps
             KV-cache size, CUDA graphs and kernels identical);
  ours       train_grpo.py's rollout: engine.generate (one request per sample with its own
             seed; the sampled token's logprob for --logprob-samples samples per prompt, as
             --rollout-logprobs one-per-prompt does) after the step's sleep -> wake weights ->
             sync -> wake KV cycle;
  ours+cycle the same, including that cycle and the sleep after generation.
tokens/s counts generated tokens (all replicas) over the slowest replica's seconds. The two
alternate for --reps rounds after a warm-up; the best round of each is reported.
Default geometry: a GRPO batch, 32 prompts x 8 samples x 128 -> 512 tokens, T=1 (256
sequences). Target (issue 7): ours >= 0.95x baseline. Reference points from the issue
(standalone vLLM, H200, 256 prompts x 1 x 128 -> 512 tokens, T=1): 44.8k tok/s at 1.5B,
23.3k tok/s at 7B (--num-prompts 256 --samples-per-prompt 1 --logprob-samples 1).
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import SHAPES, max_over_ranks, shared_config_dir  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b", help="model shape (bench/harness.py)")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per round, global")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="samples per prompt (n, the GRPO group)")
    p.add_argument("--logprob-samples", type=int, default=1, help="samples per prompt that ask vLLM for logprobs "
                   "(train_grpo.py's default --rollout-logprobs one-per-prompt: 1; all: --samples-per-prompt)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of each GPU")
    p.add_argument("--sync-bucket-mb", type=int, default=512, help="export bucket size, MB of full tensors")
    p.add_argument("--reps", type=int, default=2, help="timed rounds of each (after one warm-up round)")
    p.add_argument("--ablate", action="store_true", help="also time llm.generate with each of ours' differences alone "
                   "(per-request seeds; logprobs; one SamplingParams per request) to find what costs")
    return p


def sum_over_ranks(count, rollout_tp):
    """Generated tokens of all replicas (ranks of one replica hold the same samples)."""
    t = torch.tensor([count if dist.get_rank() % rollout_tp == 0 else 0], dtype=torch.float64, device="cuda")
    dist.all_reduce(t)
    return t.item()


def main():
    args = build_parser().parse_args()
    from vllm import SamplingParams

    from common.dist import init_distributed, print0
    from common.model import build_model, export_hf_weights, load_hf_spec
    from common.rollout_vllm import VLLMEngine, rollout_replica

    info = init_distributed(tp=args.tp)
    assert info.device.type == "cuda", "bench/rollout.py needs a GPU and vLLM"
    hf_dir = shared_config_dir(args.shape, "bench_rollout_", info.master_process)
    spec = load_hf_spec(hf_dir)
    model = build_model(spec, tp=args.tp, dtype=torch.bfloat16, init_weights=True)
    engine = VLLMEngine(hf_dir, rollout_tp=args.rollout_tp, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.prompt_len + args.max_new_tokens + 16)
    replica, num_replicas = rollout_replica(info.rank, args.rollout_tp)
    if args.num_prompts % num_replicas:
        raise ValueError(f"--num-prompts {args.num_prompts} must be a multiple of the {num_replicas} rollout replicas")
    generator = torch.Generator().manual_seed(0)  # the same prompts on every rank
    prompts = torch.randint(10, spec.vocab_size, (args.num_prompts, args.prompt_len), generator=generator).tolist()
    mine = prompts[replica::num_replicas]
    n, max_tokens = args.samples_per_prompt, args.max_new_tokens

    def cycle():
        """The engine part of a training step before generation (train_grpo.py step 1)."""
        engine.sleep()
        engine.wake_weights()
        engine.update_weights(export_hf_weights(model, spec, dtype=torch.bfloat16, bucket_mb=args.sync_bucket_mb))
        engine.wake_kv_cache()

    def baseline(round_):
        params = SamplingParams(n=n, temperature=args.temperature, max_tokens=max_tokens, seed=round_, detokenize=False)
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in mine], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def ours(round_):
        samples = engine.generate(mine, n=n, temperature=args.temperature, top_p=1.0, max_tokens=max_tokens, seed=round_,
                                  logprob_samples=args.logprob_samples)
        return sum(len(s.response_ids) for s in samples)

    cycle()  # the first weights
    results = {"baseline": [], "ours": [], "ours_cycle": [], "cycle": []}
    for round_ in range(args.reps + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        tokens = baseline(round_)
        base_s = max_over_ranks(time.perf_counter() - t0, info.device)
        base_tokens = sum_over_ranks(tokens, args.rollout_tp)

        dist.barrier()
        t0 = time.perf_counter()
        cycle()
        torch.cuda.synchronize()
        cycle_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        tokens = ours(round_)
        gen_s = time.perf_counter() - t1
        engine.sleep()
        torch.cuda.synchronize()
        total_s = max_over_ranks(time.perf_counter() - t0, info.device)
        gen_s, cycle_s = max_over_ranks(gen_s, info.device), max_over_ranks(cycle_s, info.device)
        our_tokens = sum_over_ranks(tokens, args.rollout_tp)
        engine.wake()  # the next baseline round needs valid weights: sleep(level 2) discarded them
        engine.update_weights(export_hf_weights(model, spec, dtype=torch.bfloat16, bucket_mb=args.sync_bucket_mb))
        print0(f"round {round_}{' (warm-up)' if round_ == 0 else ''}: baseline {base_tokens / base_s:9.0f} tok/s "
               f"({base_tokens:.0f} tokens, {base_s:.2f} s)  ours {our_tokens / gen_s:9.0f} tok/s ({our_tokens:.0f} "
               f"tokens, {gen_s:.2f} s)  ours+cycle {our_tokens / total_s:9.0f} tok/s (cycle {cycle_s:.2f} s)")
        if round_:
            results["baseline"].append(base_tokens / base_s)
            results["ours"].append(our_tokens / gen_s)
            results["ours_cycle"].append(our_tokens / total_s)
            results["cycle"].append(cycle_s)
    best = {k: (min(v) if k == "cycle" else max(v)) for k, v in results.items()}

    ablation = {}
    if args.ablate:  # which of ours' differences to the baseline costs throughput
        rows = [{"prompt_token_ids": p} for p in mine for _ in range(n)]
        common = dict(n=1, temperature=args.temperature, max_tokens=max_tokens, detokenize=False)
        variants = {
            "params_per_request": lambda: [SamplingParams(**common) for _ in rows],
            "seed_per_request": lambda: [SamplingParams(**common, seed=i) for i in range(len(rows))],
            "logprobs": lambda: [SamplingParams(**common, logprobs=0, flat_logprobs=True) for _ in rows],
            "seed_and_logprobs": lambda: [SamplingParams(**common, seed=i, logprobs=0, flat_logprobs=True)
                                          for i in range(len(rows))],
            # what --rollout-logprobs one-per-prompt asks for: a logprob on 1 request in n
            "seed_and_logprobs_1_in_n": lambda: [SamplingParams(**common, seed=i, logprobs=0 if i % n == 0 else None,
                                                                flat_logprobs=True) for i in range(len(rows))],
        }
        for name, make in variants.items():
            params = make()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            outputs = engine.llm.generate(rows, params, use_tqdm=False)
            seconds = max_over_ranks(time.perf_counter() - t0, info.device)
            tokens = sum_over_ranks(sum(len(o.outputs[0].token_ids) for o in outputs), args.rollout_tp)
            ablation[name] = round(tokens / seconds)
            print0(f"ablation {name:20s} {tokens / seconds:9.0f} tok/s  {tokens / seconds / best['baseline']:.3f}x baseline")
    if info.master_process:
        settings = dict(shape=args.shape, device=torch.cuda.get_device_name(), world_size=info.world_size,
                        tp=args.tp, rollout_tp=args.rollout_tp, num_prompts=args.num_prompts, n=n,
                        prompt_len=args.prompt_len, max_new_tokens=max_tokens, temperature=args.temperature,
                        logprob_samples=args.logprob_samples,
                        date=time.strftime("%Y-%m-%d"))
        ratio, ratio_cycle = best["ours"] / best["baseline"], best["ours_cycle"] / best["baseline"]
        print(f"\nrollout, {args.shape}, {settings['device']} x {info.world_size}, rollout TP={args.rollout_tp}, "
              f"{args.num_prompts} prompts x {n} x {args.prompt_len} -> {max_tokens} tokens, T={args.temperature}")
        print(f"  baseline (vLLM generate)   {best['baseline']:9.0f} tok/s")
        print(f"  ours (engine.generate)     {best['ours']:9.0f} tok/s   {ratio:.3f}x")
        print(f"  ours + sleep/wake/sync     {best['ours_cycle']:9.0f} tok/s   {ratio_cycle:.3f}x  (cycle {best['cycle']:.3f} s)")
        print("BENCH_JSON " + json.dumps(dict(settings, baseline_tok_s=round(best["baseline"]), ours_tok_s=round(best["ours"]),
                                              ours_cycle_tok_s=round(best["ours_cycle"]), cycle_s=round(best["cycle"], 4),
                                              ratio=round(ratio, 4), ratio_with_cycle=round(ratio_cycle, 4), ablation=ablation)))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine can block interpreter exit


if __name__ == "__main__":
    main()
