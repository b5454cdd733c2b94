"""LoRA: the merged-weight sync against vLLM's LoRA adapters, a whole step's engine side each (docs/lora.md).

    python bench/lora_sync.py --shape qwen2-1.5b --rank 16            # 1 GPU: both ways, in pairs of processes
    python bench/lora_sync.py --shape qwen2-7b --mode adapters        # one way alone, one process

A LoRA step changes only the adapters. The engine can get them two ways:
  merged    what train_grpo.py does: W + (alpha / r) B A of every targeted linear, on the GPU, and every weight of
            the model loaded into the engine (VLLMEngine.update_weights); the engine then decodes a plain model
  adapters  the adapters alone, written as a PEFT directory (adapter_config.json, adapter_model.safetensors) under
            /dev/shm and handed to an engine started with enable_lora as the same LoRARequest, reloaded in place
            (load_inplace) each step; the engine then decodes the base with the adapters (its LoRA kernels on
            every targeted linear at every token)
Per step: sync seconds (merged: the merge and the load; adapters: writing the directory), rollout seconds of
--prompts x --max-tokens tokens (EOS ignored; new random prompts each step, so no prefix is cached; with
adapters, vLLM reads the directory at the step's first request: inside the rollout's seconds), and their sum.
Random weights of a Qwen2 shape (bench/harness.py), written as the model's safetensors before the engine starts:
both ways load the base from disk. Rank-r adapters on q, k, v, o, gate, up and down of every layer (the scripts'
--lora-targets attention,mlp).

vLLM holds one engine per process, so each way runs in a process of its own: --pairs pairs of the two processes,
the order alternating (merged first in the first pair), each --warmup + --reps steps. Reported per pair: the
median step of each side; then adapters / merged of sync, rollout and step seconds as the median (min, max) of
the per-pair ratios. Output: a table, one `BENCH_JSON {...}` line. Needs a GPU and vLLM.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import SHAPES, paired_ratios, write_config_dir  # noqa: E402

from common.run.lora_export import write_peft_files  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHASES = ("sync_s", "rollout_s", "step_s")


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    shapes = sorted(name for name in SHAPES if name.startswith("qwen2"))
    p.add_argument("--shape", choices=shapes, default="qwen2-1.5b", help="model shape (bench/harness.py)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank r")
    p.add_argument("--alpha", type=float, default=None, help="the adapters' alpha (default 2 r, as --lora-alpha)")
    p.add_argument("--prompts", type=int, default=256, help="requests per rollout")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per response (EOS ignored)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the numbers")
    p.add_argument("--reps", type=int, default=3, help="timed steps per process")
    p.add_argument("--pairs", type=int, default=2, help="pairs of processes (the order alternating)")
    p.add_argument("--mode", choices=["both", "merged", "adapters"], default="both", help="both: the paired driver")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    return p


def adapter_targets(shapes):
    """{HF weight name: (out, in)} of the targeted linears among a model's {name: shape}."""
    return {
        name: tuple(shape)
        for name, shape in shapes.items()
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in TARGETS
    }


def one_side(args):
    """One way (args.mode) in this process: its engine, --warmup + --reps steps -> {phase: [seconds per step]}."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from common.rollout.vllm_engine import VLLMEngine
    from common.run.dist import init_distributed

    init_distributed(tp=1)
    adapters, alpha = args.mode == "adapters", args.alpha or 2.0 * args.rank
    hf_dir = write_config_dir(tempfile.mkdtemp(prefix="bench_lora_"), args.shape)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, std):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * std

    base = {name: randn(*shape, std=0.02) for name, shape in shapes.items()}
    factors = {name: (randn(args.rank, i, std=0.02), randn(o, args.rank, std=0.02)) for name, (o, i) in
               adapter_targets(shapes).items()}  # fmt: skip
    # the base from disk at start, as a LoRA run's engine would load it: an engine with enable_lora names its
    # targeted linears' weights base_layer.weight, which a sync of HF names (update_weights) does not reach
    save_file({name: w.cpu() for name, w in base.items()}, os.path.join(hf_dir, "model.safetensors"))
    lora = dict(enable_lora=True, max_lora_rank=args.rank, max_loras=1) if adapters else {}
    engine = VLLMEngine(
        hf_dir,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        eos_token_ids=[],
        load_format="auto",
        **lora,
    )
    shm = tempfile.mkdtemp(prefix="bench_lora_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    request = LoRARequest("policy", 1, shm, load_inplace=True) if adapters else None
    times = {phase: [] for phase in PHASES}
    try:
        for step in range(args.warmup + args.reps):
            for a, b in factors.values():  # an update: the adapters move
                a.add_(randn(*a.shape, std=1e-3))
                b.add_(randn(*b.shape, std=1e-3))
            torch.cuda.synchronize()
            start = time.perf_counter()
            if adapters:
                write_peft_files(shm, factors, args.rank, alpha, hf_dir)  # as merge_to_hf.py --lora peft
            else:  # the merged weights, made and loaded as the trainer's sync makes and loads them
                scale = alpha / args.rank

                def merged():
                    for name, w in base.items():
                        yield name, (w + scale * (factors[name][1] @ factors[name][0]) if name in factors else w)

                engine.update_weights(merged())
                engine.llm.reset_prefix_cache()
            torch.cuda.synchronize()
            synced = time.perf_counter()
            ids = torch.randint(
                300, 30000, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(step)
            )
            params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=step)
            outputs = engine.llm.generate(
                [{"prompt_token_ids": row} for row in ids.tolist()], params, lora_request=request, use_tqdm=False
            )
            done = time.perf_counter()
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert tokens == args.prompts * args.max_tokens, (tokens, args.prompts * args.max_tokens)
            if step >= args.warmup:
                times["sync_s"].append(synced - start)
                times["rollout_s"].append(done - synced)
                times["step_s"].append(done - start)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return times


def run_side(mode, argv):
    """This script with --mode mode in a process of its own -> its {phase: [seconds]}."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--mode", mode]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SIDE_JSON ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench/lora_sync.py --mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("SIDE_JSON ") :])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/lora_sync.py: needs a GPU and vLLM (it measures vLLM's two ways of taking LoRA weights)")
    if args.mode != "both":
        print("SIDE_JSON " + json.dumps(one_side(args)), flush=True)
        os._exit(0)  # an in-process engine can hang interpreter shutdown
    rest = [a for a, before in zip(argv, [None, *argv]) if not a.startswith("--mode") and before != "--mode"]
    medians = {"merged": {p: [] for p in PHASES}, "adapters": {p: [] for p in PHASES}}
    for pair in range(args.pairs):
        order = ("merged", "adapters") if pair % 2 == 0 else ("adapters", "merged")
        for mode in order:
            side = run_side(mode, rest)
            for phase in PHASES:
                medians[mode][phase].append(statistics.median(side[phase]))
            print(f"pair {pair} {mode}: " + ", ".join(f"{p} {medians[mode][p][-1]:.3f}" for p in PHASES), flush=True)
    result = dict(vars(args), device=torch.cuda.get_device_name(), ratios={}, sides=medians)
    for phase in PHASES:
        stats = paired_ratios(medians["adapters"][phase], medians["merged"][phase])
        result["ratios"][phase] = stats
        print(f"{phase:10s} adapters / merged {stats['median']:.3f}x (min {stats['min']:.3f}, max {stats['max']:.3f}); "
              f"merged {stats['b_median']:.3f} s, adapters {stats['a_median']:.3f} s")  # fmt: skip
    print("BENCH_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
