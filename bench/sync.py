"""Benchmark the per-step weight sync Megatron -> colocated vLLM, and vLLM's sleep/wake.

    python bench/sync.py --shape qwen2-7b                                              # 1 GPU
    torchrun --nproc_per_node 2 bench/sync.py --shape qwen2-7b --tp 2 --rollout-tp 1   # 2 GPUs
    torchrun --nproc_per_node 2 bench/sync.py --shape qwen2-7b --tp 2 --rollout-tp 2
    torchrun --nproc_per_node 2 bench/sync.py --shape qwen3-30b-a3b --ep 2 --rollout-tp 2      # MoE, 2 GPUs
    python bench/sync.py --shape tiny --engine hf --reps 2                             # CPU smoke run

Random bf16 weights of a Qwen2 shape (bench/harness.py) in a Megatron GPTModel at --tp/--pp, and
a VLLMEngine (common/rollout/vllm_engine.py) on the same GPUs started with load_format="dummy". Each
repetition is the engine part of train_grpo.py's step, every phase timed on its own (CUDA
synchronised, max over ranks):
  sleep         engine.sleep(): vLLM sleep(level=2), weights and KV cache freed
  wake weights  engine.wake_weights(): the weight memory re-allocated
  sync          engine.update_weights(export_hf_weights(model, bucket_mb)): the PP broadcast /
                TP all-gather of Megatron's shards in flat buckets, the split back to HF
                tensors, and vLLM's load_weights (its fused layout, its own TP shard)
  wake KV       engine.wake_kv_cache() (+ the prefix cache reset)
and, once per repetition, "export only": the same generator consumed without vLLM, to
separate the Megatron side from vLLM's load_weights.
Baseline, in the same run: a device-to-device copy of the bytes vLLM holds per GPU
(model bytes / rollout TP), i.e. the floor of any sync that writes every weight once. Its
buffers exist only while it runs (the memory goes back before vLLM's next wake).
Repetitions and copies run in interleaved pairs (harness.run_pairs: one warm-up pair, then
--reps pairs, which goes first alternating); sync / copy is the median of the per-pair ratios
with their min and max (harness.paired_ratios).
Targets: 7B sync <= 0.1 s on one GPU, <= 0.2 s at Megatron TP=2 on two;
sleep + wake <= 0.5 s per step at 7B.

Output: a table on rank 0 and one `BENCH_JSON {...}` line (medians over --reps after one
warm-up pair).
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


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b", help="model shape (bench/harness.py)")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="Megatron pipeline parallel size")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="Megatron expert parallel size (MoE shapes; the export gathers each layer's experts over it)",
    )
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument(
        "--engine", choices=["vllm", "hf"], default=None, help="rollout engine (default: vllm on a GPU, hf on a CPU)"
    )
    p.add_argument("--sync-bucket-mb", type=int, default=512, help="export bucket size, MB of full tensors")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of each GPU")
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed pairs (engine cycle, baseline copy; the order alternating) after one warm-up pair",
    )
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start-up)")
    p.add_argument(
        "--gather-all",
        action="store_true",
        help="gather every TP-split tensor "
        "(default: at Megatron TP = vLLM TP each rank writes its own TP pieces; export_hf_weights(local_reads=))",
    )
    return p


def main():
    args = build_parser().parse_args()
    from common.model.bridge import expected_hf_names, expected_hf_shape
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights import export_hf_weights
    from common.run.dist import init_distributed, print0

    info = init_distributed(tp=args.tp, pp=args.pp, ep=args.ep)
    on_gpu = info.device.type == "cuda"
    engine_kind = args.engine or ("vllm" if on_gpu else "hf")
    dtype = torch.bfloat16 if on_gpu else torch.float32

    # a config.json-only model dir: random Megatron init; vLLM gets every weight from the sync
    # (HFEngine loads weights at start: give it random ones)
    hf_dir = shared_config_dir(args.shape, "bench_sync_", info.master_process, with_weights=engine_kind == "hf")
    spec = load_hf_spec(hf_dir)
    model = build_model(spec, tp=args.tp, pp=args.pp, ep=args.ep, dtype=dtype, init_weights=True)
    model_bytes = sum(torch.Size(expected_hf_shape(n, spec)).numel() for n in expected_hf_names(spec)) * dtype.itemsize

    if engine_kind == "vllm":
        from common.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            hf_dir,
            rollout_tp=args.rollout_tp,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=2048,
            enforce_eager=args.enforce_eager,
            eos_token_ids=[],
        )
    else:
        from common.rollout.hf_engine import HFEngine

        engine = HFEngine(hf_dir, dtype=dtype, device=info.device, eos_token_ids=[])

    def export():
        return export_hf_weights(
            model,
            spec,
            dtype=dtype,
            bucket_mb=args.sync_bucket_mb,
            expert_blocks=engine.expert_blocks,
            local_reads=None if args.gather_all else engine.local_reads,
        )

    def export_only():
        for _ in export():
            pass

    def engine_cycle(rep):
        """The engine part of train_grpo.py's step, each phase timed alone; rep seeds the check."""
        row = {}
        row["sleep_s"] = timed(engine.sleep, info.device)
        row["wake_weights_s"] = timed(engine.wake_weights, info.device)
        row["sync_s"] = timed(lambda: engine.update_weights(export()), info.device)
        row["wake_kv_s"] = timed(engine.wake_kv_cache, info.device)
        row["export_only_s"] = timed(export_only, info.device)
        # the engine must be usable after the cycle (one token of one prompt)
        out = engine.generate([[5, 6, 7]], n=1, temperature=0.0, top_p=1.0, max_tokens=1, seed=rep)
        assert len(out) == 1 and len(out[0].response_ids) == 1
        return row

    per_gpu = model_bytes // args.rollout_tp

    def baseline_copy(rep):
        """A device-to-device copy of as many bytes as vLLM holds per GPU, in copies of at most
        2 GiB between two reused buffers (a whole-model pair would not fit beside megatron's and
        vLLM's copies of a 16B model on one H200)."""
        chunk = min(per_gpu, 2**31)
        src = torch.empty(chunk, dtype=torch.uint8, device=info.device)
        dst = torch.empty_like(src)
        sizes = [chunk] * (per_gpu // chunk) + ([per_gpu % chunk] if per_gpu % chunk else [])

        def copy():
            for n in sizes:
                dst[:n].copy_(src[:n])

        seconds = timed(copy, info.device)
        src = dst = None  # freed (the closure above holds the names)
        if on_gpu:
            torch.cuda.empty_cache()  # give the memory back before vLLM wakes again
        return seconds

    # pair 0 warms up (allocator, NCCL communicators, kernels)
    rows, copies = run_pairs(engine_cycle, baseline_copy, args.reps)
    for rep, (row, copy_s) in enumerate(zip(rows, copies), 1):
        print0(f"pair {rep}: " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()) + f"  baseline_copy_s {copy_s:.4f}")
    result = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result["baseline_copy_s"] = statistics.median(copies)
    sync_vs_copy = paired_ratios([r["sync_s"] for r in rows], copies)  # sync seconds / copy seconds, per pair

    settings = dict(
        shape=args.shape,
        device=torch.cuda.get_device_name() if on_gpu else "cpu",
        world_size=info.world_size,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        rollout_tp=args.rollout_tp,
        engine=engine_kind,
        bucket_mb=args.sync_bucket_mb,
        model_gb=model_bytes / 1e9,
        reps=args.reps,
        date=time.strftime("%Y-%m-%d"),
    )
    result["sleep_wake_s"] = result["sleep_s"] + result["wake_weights_s"] + result["wake_kv_s"]
    result["sync_vs_copy"] = sync_vs_copy["median"]
    result["sync_vs_copy_min"], result["sync_vs_copy_max"] = sync_vs_copy["min"], sync_vs_copy["max"]
    result["sync_gb_per_s"] = model_bytes / 1e9 / result["sync_s"]
    if info.master_process:
        print(
            f"\nweight sync, {args.shape} ({model_bytes / 1e9:.2f} GB {str(dtype)[6:]}), {settings['device']} x "
            f"{info.world_size}, Megatron TP={args.tp} PP={args.pp} EP={args.ep}, rollout TP={args.rollout_tp}, "
            f"{engine_kind}"
        )
        print(f"  sync                {result['sync_s']:8.4f} s   ({result['sync_gb_per_s']:.1f} GB/s of HF tensors)")
        print(f"  export only         {result['export_only_s']:8.4f} s")
        print(
            f"  baseline D2D copy   {result['baseline_copy_s']:8.4f} s   ({per_gpu / 1e9:.2f} GB per GPU)  "
            f"sync / copy = {result['sync_vs_copy']:.1f}x (median of {args.reps} pairs; min "
            f"{result['sync_vs_copy_min']:.1f}, max {result['sync_vs_copy_max']:.1f})"
        )
        print(
            f"  sleep + wake        {result['sleep_wake_s']:8.4f} s   (sleep {result['sleep_s']:.4f}, wake weights "
            f"{result['wake_weights_s']:.4f}, wake KV {result['wake_kv_s']:.4f})"
        )
        print(
            "BENCH_JSON "
            + json.dumps(
                dict(
                    settings,
                    **{k: float(f"{v:.6g}") for k, v in result.items()},
                    sync_vs_copy_per_pair=sync_vs_copy["ratios"],
                )
            )
        )
    dist.barrier()
    if engine_kind == "vllm":  # vLLM's in-process engine can block interpreter exit
        sys.stdout.flush()
        os._exit(0)
    from common.run.dist import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
