"""Benchmark what a checkpoint save costs the training loop, and the offload phase's first steps.

    python bench/save.py --shape 1.5b                     # GPU (vLLM): a Qwen2-1.5B-shaped random model
    python bench/save.py --shape 1.5b --steps 4 --save-every 2   # saves that do not meet each other
    python bench/save.py --shape embedded --steps 4       # CPU smoke run, the embedded tiny model
    python bench/save.py --shape 1.5b --direct            # the save alone, ours vs megatron's, one process

--direct (no engine, no training script; random weights, Adam state after one step): in one
process, saves alternate between megatron's way and ours, per optimizer layout on disk:
  megatron  any-layout state gathered by megatron (get_parameter_state_dp_zero), GPU tensors
            staged by megatron (tensor.to("cpu", non_blocking=True) per tensor)
  ours      common/train/setup.model_space_optimizer_state (DP=1) and the pinned HostStaging
            reserved once by CheckpointWriter(models=...) (its seconds printed apart)
and prints each save's blocking seconds (of which staging), the ratio ours/megatron of each
pair of saves and their median, and the whole save (written + published). megatron's first
save pins its staging memory (torch's host cache), later ones reuse it: read the pairs.

Runs train_grpo.py (a subprocess, output through a pipe) with a checkpoint at every step, once
per optimizer layout on disk: --save-any-layout (the default: resumable at any TP/PP/DP) and
--no-save-any-layout (each DP rank's shard as it is). Per step it reads from metrics.jsonl
  save_s          what the loop waited for (the previous save's writing if still going on,
                  checks, planning, copies to host memory)
  save_wait_sec   of save_s, the wait for the previous save (a save every step meets it)
  save_total_sec  the whole save, published at a later step (written in the background)
  offload_s       the offload phase (pinned host buffers are made at start-up: step 1 should
                  cost what step 3 does)
and the seconds from the last metrics line to the end of the piped output (every process
gone). Prints a table and one BENCH_JSON line of absolute numbers: the two settings run one
after the other, not interleaved, so compare them only roughly. A save whose writing outlasts
the next step is published by the next save's wait and logs no save_total_sec, so that list
may be shorter than the blocking one.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape",
        choices=["embedded", "0.5b", "1.5b", "7b"],
        default="1.5b",
        help="model: the embedded tiny model, or a random Qwen2-shaped one (tests/gpu/make_random_model.py)",
    )
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument(
        "--save-every",
        type=int,
        default=1,
        help="a checkpoint every N steps (1: after each, so a save meets the previous one's writing; "
        "2 or more at 1.5B: the save's own blocking)",
    )
    ap.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary dir)")
    ap.add_argument("--direct", action="store_true", help="time the save alone in this process, ours vs megatron's")
    return ap.parse_args(argv)


def run(model_dir, out, steps, any_layout, save_every=1):
    cmd = [
        sys.executable,
        "train_grpo.py",
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--out",
        out,
        "--prompts-per-step",
        "8",
        "--samples-per-prompt",
        "4",
        "--micro-batch-size",
        "4",
        "--mini-batch-size",
        "32",
        "--save-any-layout" if any_layout else "--no-save-any-layout",
    ]
    if model_dir:
        cmd += ["--model", model_dir, "--max-new-tokens", "64"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    output = proc.stdout.read()
    eof = time.time()
    if proc.wait() != 0:
        raise SystemExit(f"train_grpo.py failed:\n{output[-4000:]}")
    metrics_path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)]
    return rows, eof - os.path.getmtime(metrics_path)


def direct(shape, steps, work):
    """--direct: see the module docstring. One process (torchrun-free: a world of one)."""
    import statistics

    import torch

    from common.model.gpt import build_model, parse_hf_config
    from common.run.dist import init_distributed
    from common.run.embedded import DEFAULT_CONFIG
    from common.train import save as train_save
    from common.train.setup import setup_training

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"), os.environ.setdefault("MASTER_PORT", "29517")
    info = init_distributed(tp=1, pp=1, seed=0)
    if shape == "embedded":
        config = dict(DEFAULT_CONFIG)
    else:
        from tests.gpu.make_random_model import SHAPES

        config = dict(DEFAULT_CONFIG, max_position_embeddings=4096, rope_theta=1e6, **SHAPES[shape])
    spec = parse_hf_config(dict(config, architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    model, optimizer, _ = setup_training(build_model(spec, dtype=dtype, init_weights=True), lr=1e-6)
    for param in (p for chunk in model for p in chunk.parameters()):  # one step: Adam state, fp32 main params
        param.main_grad.normal_()
    optimizer.step()
    t = time.perf_counter()
    ours = train_save.CheckpointWriter(models=[(model, optimizer)])
    reserve_s = time.perf_counter() - t
    theirs = train_save.CheckpointWriter()  # nothing reserved: megatron's staging
    own_state = train_save.model_space_optimizer_state
    result = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
        "params": sum(p.numel() for chunk in model for p in chunk.parameters()),
        "reserve_s": reserve_s,
        "reserved_gb": ours.staging.buffer.numel() / 1e9,
    }
    print(
        f"{result['params'] / 1e9:.2f}B params on {result['device']}; pinned staging reserved at start-up: "
        f"{result['reserved_gb']:.1f} GB in {reserve_s:.2f} s",
        flush=True,
    )
    for sharding in ("fully_reshardable", "dp_reshardable"):
        runs = {"megatron": [], "ours": []}
        for i in range(steps):
            for name in ("megatron", "ours") if i % 2 == 0 else ("ours", "megatron"):  # interleaved
                writer = ours if name == "ours" else theirs
                # megatron's way: its gather for the any-layout state (a bench-only switch)
                train_save.model_space_optimizer_state = own_state if name == "ours" else lambda *a: None
                root = os.path.join(work, f"{sharding}_{name}")
                t = time.perf_counter()
                writer.save(root, i + 1, model, optimizer, None, keep_last=1, optimizer_sharding=sharding)
                blocking = time.perf_counter() - t
                stage = writer.pending.stage_s
                writer.wait()
                runs[name].append(dict(blocking_s=blocking, stage_s=stage, total_s=writer.last["total_s"]))
        train_save.model_space_optimizer_state = own_state
        # pair i: the i-th save of each way (taken back to back, the order alternating)
        ratios = [o["blocking_s"] / m["blocking_s"] for o, m in zip(runs["ours"], runs["megatron"])]
        result[sharding] = dict(
            runs, blocking_ratios_ours_vs_megatron=ratios, blocking_ratio_ours_vs_megatron=statistics.median(ratios)
        )
        for name, rows in runs.items():
            seconds = {key: ", ".join(f"{r[key]:.2f}" for r in rows) for key in rows[0]}
            print(
                f"{sharding:17s} {name:8s} blocking {seconds['blocking_s']} s (staging {seconds['stage_s']}) "
                f"| whole save {seconds['total_s']} s",
                flush=True,
            )
        print(
            f"{sharding:17s} blocking ours / megatron per pair: {', '.join(f'{r:.3f}' for r in ratios)}; median "
            f"{result[sharding]['blocking_ratio_ours_vs_megatron']:.3f}",
            flush=True,
        )
    ours.wait(), theirs.wait()
    print("BENCH_JSON " + json.dumps(result))


def main():
    args = parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_save_")
    if args.direct:
        return direct(args.shape, args.steps, work)
    model_dir = None
    if args.shape != "embedded":
        from common.run.embedded import write_embedded_model
        from tests.gpu.make_random_model import SHAPES

        model_dir = os.path.join(work, f"qwen2-{args.shape}")
        t = time.time()
        write_embedded_model(model_dir, seed=0, max_position_embeddings=4096, rope_theta=1e6, **SHAPES[args.shape])
        print(f"random model {model_dir} ({time.time() - t:.0f} s)", flush=True)
    result = {"shape": args.shape, "steps": args.steps, "save_every": args.save_every}
    for any_layout in (True, False):
        name = "any_layout" if any_layout else "dp_shards"
        rows, exit_s = run(model_dir, os.path.join(work, name), args.steps, any_layout, args.save_every)
        # its checkpoints (2 x 18.4 GB at 1.5B) would leave the next run too little disk (a 64 GiB one filled up)
        shutil.rmtree(os.path.join(work, name, "checkpoints"), ignore_errors=True)
        saved = [r for r in rows if "save_s" in r]  # the steps that saved
        blocking = [r["save_s"] for r in saved]
        waiting = [r.get("save_wait_sec", 0.0) for r in saved]  # of blocking: the previous save still writing
        total = [r["save_total_sec"] for r in rows if "save_total_sec" in r]
        offload = [r.get("offload_s", 0.0) for r in rows]
        result[name] = dict(
            save_blocking_s=blocking,
            save_wait_s=waiting,
            save_total_s=total,
            offload_s=offload,
            exit_after_last_step_s=exit_s,
        )
        print(
            f"{name:11s} blocking {', '.join(f'{b:.2f}' for b in blocking)} s (of which waiting for the previous "
            f"save {', '.join(f'{w:.2f}' for w in waiting)} s) | whole save (published later) "
            f"{', '.join(f'{t:.2f}' for t in total)} s | offload {', '.join(f'{o:.2f}' for o in offload)} s | "
            f"exit {exit_s:.1f} s after the last step",
            flush=True,
        )
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
