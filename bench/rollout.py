"""Benchmark the rollout phase of train_grpo.py against plain vLLM generate, same engine, same run.

    python bench/rollout.py --shape qwen2-1.5b                               # 1 GPU
    python bench/rollout.py --shape qwen2-7b
    torchrun --nproc_per_node 2 bench/rollout.py --shape qwen2-7b --tp 2 --rollout-tp 2
    torchrun --nproc_per_node 2 bench/rollout.py --shape qwen3-30b-a3b-16l --ep 2 --rollout-tp 2   # MoE
    python bench/rollout.py --shape tiny --num-prompts 2 --samples-per-prompt 2 --prompt-len 8 \\
        --max-new-tokens 8 --reps 2                                          # CPU smoke run (HFEngine)

Random bf16 weights of a Qwen2 shape (bench/harness.py): a Megatron GPTModel, and a VLLMEngine
(common/rollout/vllm_engine.py) on the same GPUs that gets its weights from the sync. Prompts: random
token ids, --num-prompts x --prompt-len, --max-new-tokens each, temperature --temperature.
Each rollout replica (world / rollout TP) takes its share of the prompts, as in training.

  baseline   what a standalone vLLM user runs: llm.generate(prompts, SamplingParams(n, T,
             max_tokens, seed, ignore_eos)) with one SamplingParams for the batch, no logprobs,
             on the same LLM object (vLLM allows one engine per process, and the same object
             keeps KV-cache size, CUDA graphs and kernels identical);
  ours       train_grpo.py's rollout: common/rollout/engine.generate_checked (one request per sample
             with its own seed; the weight-sync check's logprobs as --rollout-logprobs says: by
             default one prefill request scoring the replica's first sample after sampling)
             after the step's sleep -> wake weights -> sync -> wake KV cycle;
  ours+cycle the same, including that cycle and the sleep after generation (each of the
             three timed on its own).
tokens/s counts generated tokens (all replicas) over the slowest replica's seconds.

Identical work on both sides: the same prompts, the pair's index as both sides'
seed, and no EOS, which random weights sample by chance (one H200 run: 129,758 tokens vs
131,072): the baseline sets vLLM's ignore_eos, and the engine is built with eos_token_ids=[]
(VLLMEngine then stops at no token and sets ignore_eos too), so every sample has
--max-new-tokens tokens. If the two sides' token counts differ in any pair, no ratio is
reported (null in BENCH_JSON, exit status 1). Each side starts from an empty prefix cache.
Statistics (harness.run_pairs / paired_ratios): one warm-up pair, then --reps timed pairs,
which side goes first alternating. Reported: the per-pair tokens/s ratios ours / baseline and
ours+cycle / baseline, their median with min and max, and each side's median tokens/s.
--ablate: plain llm.generate with one of ours' differences at a time, each variant in its own
paired rounds against the baseline. On a CPU (tests/test_bench.py) ours is HFEngine
(common/rollout/engine.py) and the baseline transformers' generate with min_new_tokens =
max_new_tokens (EOS masked): a smoke run of the code, not a measurement.
Default geometry: a GRPO batch, 32 prompts x 8 samples x 128 -> 512 tokens, T=1 (256
sequences). Target: ours >= 0.95x baseline. Reference points
(standalone vLLM, H200, 256 prompts x 1 x 128 -> 512 tokens, T=1): 44.8k tok/s at 1.5B,
23.3k tok/s at 7B (--num-prompts 256 --samples-per-prompt 1 --rollout-logprobs all).
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import SHAPES, paired_ratios, run_pairs, shared_config_dir, timed  # noqa: E402

from common.rollout.engine import ROLLOUT_LOGPROBS, generate_checked, rollout_logprobs_mode  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b", help="model shape (bench/harness.py)")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--ep", type=int, default=1, help="Megatron expert parallel size (MoE shapes, as in training)")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument(
        "--engine",
        choices=["vllm", "hf"],
        default=None,
        help="ours' engine (default: vllm on a GPU; hf on a CPU, a smoke run against transformers' generate)",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per round, global")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="samples per prompt (n, the GRPO group)")
    p.add_argument(
        "--rollout-logprobs",
        choices=sorted(ROLLOUT_LOGPROBS),
        default="prefill",
        help="ours' logprobs for the weight-sync check, as train_grpo.py's flag (its default at T=1: prefill)",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens generated per sample (EOS is ignored)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of each GPU")
    p.add_argument("--sync-bucket-mb", type=int, default=512, help="export bucket size, MB of full tensors")
    p.add_argument(
        "--reps", type=int, default=5, help="timed pairs (baseline, ours; the order alternating) after one warm-up pair"
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="also time llm.generate with each of ours' differences alone "
        "(per-request seeds; logprobs; one SamplingParams per request), each in paired rounds against "
        "the baseline, to find what costs (vLLM only)",
    )
    return p


def sum_over_ranks(count, rollout_tp, device):
    """Generated tokens of all replicas (ranks of one replica hold the same samples)."""
    t = torch.tensor([count if dist.get_rank() % rollout_tp == 0 else 0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return int(t.item())


def tok_s(side, seconds="seconds"):
    """Tokens/s of one side's round (a dict of run_pairs' results)."""
    return side["tokens"] / side[seconds]


def compare(a_pairs, b_pairs, a_seconds="seconds"):
    """harness.paired_ratios of A's tokens/s over B's, or None where the two sides generated
    different token counts in any pair: then they did not do the same work (no fair ratio)."""
    if any(a["tokens"] != b["tokens"] for a, b in zip(a_pairs, b_pairs)):
        return None
    return paired_ratios([tok_s(a, a_seconds) for a in a_pairs], [tok_s(b) for b in b_pairs])


def ratio_fields(prefix, stats):
    """BENCH_JSON fields of compare's result: prefix (the median), prefix_min, prefix_max,
    prefix_per_pair; all null when compare refused."""
    keys = {prefix: "median", f"{prefix}_min": "min", f"{prefix}_max": "max", f"{prefix}_per_pair": "ratios"}
    return {key: None if stats is None else stats[k] for key, k in keys.items()}


def describe(stats, reps):
    """compare's result as text."""
    if stats is None:
        return "no ratio: the token counts differ"
    return f"{stats['median']:.3f}x (median of {reps} pairs; min {stats['min']:.3f}, max {stats['max']:.3f})"


def main():
    args = build_parser().parse_args()
    try:
        rollout_logprobs_mode(args.rollout_logprobs, args.temperature)
    except ValueError as e:
        raise SystemExit(f"bench/rollout.py: {e}")
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import export_hf_weights
    from common.rollout.engine import rollout_replica
    from common.run.dist import init_distributed, print0

    info = init_distributed(tp=args.tp, ep=args.ep)
    on_gpu = info.device.type == "cuda"
    engine_kind = args.engine or ("vllm" if on_gpu else "hf")
    if args.ablate and engine_kind != "vllm":
        raise SystemExit("--ablate times vLLM SamplingParams variants: it needs --engine vllm")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    rollout_tp = args.rollout_tp if engine_kind == "vllm" else 1  # HFEngine: every rank its own replica
    # vLLM gets every weight from the sync; HFEngine loads weights at start: give it random ones
    hf_dir = shared_config_dir(args.shape, "bench_rollout_", info.master_process, with_weights=engine_kind == "hf")
    spec = load_hf_spec(hf_dir)
    model = build_model(spec, tp=args.tp, ep=args.ep, dtype=dtype, init_weights=True)
    if engine_kind == "vllm":  # eos_token_ids=[]: stop at no token (docstring: identical work)
        from common.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            hf_dir,
            rollout_tp=rollout_tp,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.prompt_len + args.max_new_tokens + 16,
            eos_token_ids=[],
        )
    else:
        from common.rollout.hf_engine import HFEngine

        engine = HFEngine(hf_dir, dtype=dtype, device=info.device, eos_token_ids=[])
    replica, num_replicas = rollout_replica(info.rank, rollout_tp)
    if args.num_prompts % num_replicas:
        raise ValueError(f"--num-prompts {args.num_prompts} must be a multiple of the {num_replicas} rollout replicas")
    generator = torch.Generator().manual_seed(0)  # the same prompts on every rank
    prompts = torch.randint(10, spec.vocab_size, (args.num_prompts, args.prompt_len), generator=generator).tolist()
    mine = prompts[replica::num_replicas]
    n, max_tokens = args.samples_per_prompt, args.max_new_tokens

    def export():
        return export_hf_weights(
            model, spec, dtype=dtype, bucket_mb=args.sync_bucket_mb, expert_blocks=engine.expert_blocks
        )

    def cycle():
        """The engine part of a training step before generation (train_grpo.py step 1)."""
        engine.sleep()
        engine.wake_weights()
        engine.update_weights(export())
        engine.wake_kv_cache()

    def timed_tokens(generate):
        """(seconds, tokens of all replicas) of generate(), which returns this rank's token count."""
        count = []
        seconds = timed(lambda: count.append(generate()), info.device)  # synchronised, the slowest rank's
        return seconds, sum_over_ranks(count[0], rollout_tp, info.device)

    def plain_side(generate):
        """A side of run_pairs that times generate(pair), a plain library call returning this
        rank's token count, from an empty prefix cache (ours' sync empties it too)."""

        def side(pair):
            if engine_kind == "vllm":
                engine.llm.reset_prefix_cache()
            seconds, tokens = timed_tokens(lambda: generate(pair))
            return dict(seconds=seconds, tokens=tokens)

        return side

    def vllm_tokens(requests, params):
        """llm.generate as a standalone vLLM user calls it; this rank's generated tokens."""
        outputs = engine.llm.generate(requests, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    if engine_kind == "vllm":
        from vllm import SamplingParams

        baseline = plain_side(
            lambda pair: vllm_tokens(
                [{"prompt_token_ids": p} for p in mine],
                SamplingParams(
                    n=n,
                    temperature=args.temperature,
                    max_tokens=max_tokens,
                    seed=pair,
                    detokenize=False,
                    ignore_eos=True,
                ),
            )
        )
    else:

        def hf_generate(pair):  # transformers' own loop; min_new_tokens = max_new_tokens masks EOS
            torch.manual_seed(pair)
            ids = torch.tensor(mine, device=info.device)  # (P, prompt_len): one length, no padding
            out = engine.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
            return out[:, ids.shape[1] :].numel()  # (P * n, max_tokens)

        baseline = plain_side(hf_generate)

    def ours(pair):
        """train_grpo.py's engine work of one step: the cycle, generate, sleep."""
        cycle_s = timed(cycle, info.device)
        gen_s, tokens = timed_tokens(
            lambda: sum(
                len(s.response_ids)
                for s in generate_checked(
                    engine,
                    mine,
                    args.rollout_logprobs,
                    n=n,
                    temperature=args.temperature,
                    top_p=1.0,
                    max_tokens=max_tokens,
                    seed=pair,
                )
            )
        )
        sleep_s = timed(engine.sleep, info.device)
        engine.wake()  # untimed: the next side needs the weights, which sleep (level 2) discarded
        engine.update_weights(export())
        return dict(seconds=gen_s, seconds_with_cycle=cycle_s + gen_s + sleep_s, cycle_s=cycle_s, tokens=tokens)

    cycle()  # the first weights
    base_pairs, our_pairs = run_pairs(baseline, ours, args.reps)
    for i, (b, o) in enumerate(zip(base_pairs, our_pairs), 1):
        print0(
            f"pair {i}: baseline {tok_s(b):9.0f} tok/s ({b['tokens']} tokens, {b['seconds']:.2f} s)  ours "
            f"{tok_s(o):9.0f} tok/s ({o['tokens']} tokens, {o['seconds']:.2f} s)  ours+cycle "
            f"{tok_s(o, 'seconds_with_cycle'):9.0f} tok/s (cycle {o['cycle_s']:.2f} s)  ratio {tok_s(o) / tok_s(b):.3f}"
        )
    ratio = compare(our_pairs, base_pairs)  # ours / baseline, per pair
    ratio_cycle = compare(our_pairs, base_pairs, a_seconds="seconds_with_cycle")

    ablation = {}
    if args.ablate:  # which of ours' differences to the baseline costs throughput
        requests = [{"prompt_token_ids": p} for p in mine for _ in range(n)]  # one request per sample, as ours
        common = dict(n=1, temperature=args.temperature, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        variants = {
            "params_per_request": lambda: [SamplingParams(**common) for _ in requests],
            "seed_per_request": lambda: [SamplingParams(**common, seed=i) for i in range(len(requests))],
            "logprobs": lambda: [SamplingParams(**common, logprobs=0, flat_logprobs=True) for _ in requests],
            "seed_and_logprobs": lambda: [
                SamplingParams(**common, seed=i, logprobs=0, flat_logprobs=True) for i in range(len(requests))
            ],
            # what --rollout-logprobs one-per-prompt asks for: a logprob on 1 request in n
            "seed_and_logprobs_1_in_n": lambda: [
                SamplingParams(**common, seed=i, logprobs=0 if i % n == 0 else None, flat_logprobs=True)
                for i in range(len(requests))
            ],
        }
        for name, make in variants.items():
            variant = plain_side(lambda _pair, make=make: vllm_tokens(requests, make()))
            stats = compare(*run_pairs(variant, baseline, args.reps))  # variant / baseline, per pair
            ablation[name] = ratio_fields("ratio", stats)
            print0(f"ablation {name:24s} {describe(stats, args.reps)}")
    refused = ratio is None or any(v["ratio"] is None for v in ablation.values())
    if info.master_process:
        settings = dict(
            shape=args.shape,
            device=torch.cuda.get_device_name() if on_gpu else "cpu",
            world_size=info.world_size,
            tp=args.tp,
            ep=args.ep,
            rollout_tp=rollout_tp,
            engine=engine_kind,
            num_prompts=args.num_prompts,
            n=n,
            prompt_len=args.prompt_len,
            max_new_tokens=max_tokens,
            temperature=args.temperature,
            rollout_logprobs=args.rollout_logprobs,
            reps=args.reps,
            date=time.strftime("%Y-%m-%d"),
        )
        medians = dict(
            baseline_tok_s=statistics.median(tok_s(b) for b in base_pairs),
            ours_tok_s=statistics.median(tok_s(o) for o in our_pairs),
            ours_cycle_tok_s=statistics.median(tok_s(o, "seconds_with_cycle") for o in our_pairs),
            cycle_s=statistics.median(o["cycle_s"] for o in our_pairs),
        )
        tokens = [[b["tokens"], o["tokens"]] for b, o in zip(base_pairs, our_pairs)]  # per pair: baseline, ours
        print(
            f"\nrollout, {args.shape}, {settings['device']} x {info.world_size}, rollout TP={rollout_tp}, "
            f"{engine_kind}, "
            f"{args.num_prompts} prompts x {n} x {args.prompt_len} -> {max_tokens} tokens, T={args.temperature}"
        )
        print(f"  baseline (plain generate)  {medians['baseline_tok_s']:9.0f} tok/s (median)")
        print(
            f"  ours (engine.generate)     {medians['ours_tok_s']:9.0f} tok/s (median)   {describe(ratio, args.reps)}"
        )
        print(
            f"  ours + sleep/wake/sync     {medians['ours_cycle_tok_s']:9.0f} tok/s (median)   "
            f"{describe(ratio_cycle, args.reps)}  (cycle {medians['cycle_s']:.3f} s)"
        )
        if ratio is None:
            print(f"  generated tokens per pair (baseline, ours): {tokens}")
        print(
            "BENCH_JSON "
            + json.dumps(
                dict(
                    settings,
                    **{k: float(f"{v:.6g}") for k, v in medians.items()},
                    tokens_per_pair=tokens,
                    **ratio_fields("ratio", ratio),
                    **ratio_fields("ratio_with_cycle", ratio_cycle),
                    ablation=ablation,
                )
            )
        )
    dist.barrier()
    sys.stdout.flush()
    os._exit(1 if refused else 0)  # os._exit: vLLM's in-process engine can block interpreter exit


if __name__ == "__main__":
    main()
