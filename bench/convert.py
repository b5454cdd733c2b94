"""Benchmark convert_hf_to_mcore.py on a synthetic ~1B-parameter Qwen2-shaped model, on CPU.

    .venv/bin/python bench/convert.py                     # 1.0B params in bf16 (2 GB), a few minutes
    .venv/bin/python bench/convert.py --nproc 2           # the conversion under torchrun, 2 processes
    .venv/bin/python bench/convert.py --layers 2 --vocab 32000 --keep /tmp/bench   # quick smoke run

It writes the model tensor by tensor into several safetensors shards (never the whole model
in memory), then measures in fresh processes, on the same files, in the same run:
  raw read       safetensors: open every file, get_tensor + materialise every tensor (best of 2)
  convert        python convert_hf_to_mcore.py --hf ... --out ... (files fsync'd, as by default)
  convert, no fsync   the same with --no-fsync (output left in the page cache)
  convert -> tmpfs    the same into /dev/shm: the converter's own speed, no disk in the way
  raw write      the same number of bytes written and fsync'd (the disk's floor)
Throughput is HF bytes / seconds of work (imports and start-up excluded; the converter reports
its own time). Peak RSS is each process's high-water mark (ru_maxrss). Goals:
convert >= 0.5x raw read; convert peak RSS < 2 GB + 2x the largest tensor.
Files are deleted at the end unless --keep.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def qwen2_config(args):
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "dtype": "bfloat16",
    }


def write_synthetic_model(hf_dir, args):
    """Child process: Qwen2 layout, random bf16 tensors, ~shard_mb per file, one shard in memory
    at a time. Prints the sizes as JSON."""
    import torch

    from common.model.bridge import expected_hf_names, expected_hf_shape, parse_hf_config
    from merge_to_hf import write_safetensors

    config = qwen2_config(args)
    spec = parse_hf_config(config)
    os.makedirs(hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    names = expected_hf_names(spec)
    shard, shard_bytes, files, weight_map, total, largest = {}, 0, [], {}, 0, 0
    generator = torch.Generator().manual_seed(0)

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        write_safetensors(os.path.join(hf_dir, name), shard)
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard.clear()

    for name in names:
        shape = expected_hf_shape(name, spec)
        tensor = (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > args.shard_mb * 2**20:
            flush()
            shard_bytes = 0
        shard[name] = tensor
        shard_bytes += nbytes
        total += nbytes
        largest = max(largest, nbytes)
    flush()
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    params = sum(torch.Size(expected_hf_shape(n, spec)).numel() for n in names)
    print(json.dumps({"bytes": total, "largest": largest, "files": len(files), "params": params}))


def raw_read(hf_dir):
    """Child process: read every tensor with safetensors, materialised in memory, one at a time."""
    from safetensors import safe_open

    start, nbytes = time.time(), 0
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key).clone()  # get_tensor maps the file; clone reads it
                    nbytes += tensor.numel() * tensor.element_size()
                    del tensor
    print(json.dumps({"seconds": time.time() - start, "bytes": nbytes}))


def raw_write(path, nbytes):
    """Child process: write nbytes in 64 MB blocks and fsync (what the disk can absorb)."""
    block = bytes(64 * 2**20)
    start = time.time()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.write(block[: nbytes % len(block)])
        f.flush()
        os.fsync(f.fileno())
    print(json.dumps({"seconds": time.time() - start, "bytes": nbytes}))
    os.remove(path)


def measure(cmd):
    """Run cmd; (stdout, wall seconds, peak RSS in bytes of its largest process). os.wait4
    gives this child's own rusage (ru_maxrss: the largest of it and its waited-for children,
    so under torchrun the largest worker). Linux carries a parent's RSS high-water mark into
    a forked child across exec, hence this parent process never imports torch."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    with tempfile.TemporaryFile("w+") as log:
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - start
        log.seek(0)
        output = log.read()
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return output, wall, usage.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # model shape (defaults: 1.0B parameters, Qwen2 style with tied embeddings)
    ap.add_argument("--layers", type=int, default=16, help="decoder layers")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size")
    ap.add_argument("--ffn", type=int, default=5504, help="MLP intermediate size")
    ap.add_argument("--heads", type=int, default=16, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (query groups)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    ap.add_argument("--shard-mb", type=int, default=700, help="safetensors shard size of the synthetic model")
    # run
    ap.add_argument("--nproc", type=int, default=1, help="converter processes (torchrun when > 1)")
    ap.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temp dir, deleted)")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)  # internal: a measured child process
    args = ap.parse_args()
    if args.phase:  # a measured child process
        if args.phase[0] == "make":
            if not os.path.isdir(args.phase[1]):
                write_synthetic_model(args.phase[1], args)
            else:  # --keep DIR from an earlier run: the sizes from the headers
                import torch

                from common.run.convert_io import SafetensorsDir

                tensors = SafetensorsDir(args.phase[1]).tensors.values()
                sizes = [torch.Size(t.shape).numel() * t.dtype.itemsize for t in tensors]
                print(
                    json.dumps(
                        {
                            "bytes": sum(sizes),
                            "largest": max(sizes),
                            "files": "existing",
                            "params": sum(torch.Size(t.shape).numel() for t in tensors),
                        }
                    )
                )
        elif args.phase[0] == "read":
            raw_read(args.phase[1])
        else:
            raw_write(args.phase[1], int(args.phase[2]))
        return

    work = args.keep or tempfile.mkdtemp(prefix="bench_convert_")  # $TMPDIR: put it on the disk to measure
    os.makedirs(work, exist_ok=True)
    hf_dir, out = os.path.join(work, "hf"), os.path.join(work, "mcore")
    try:
        model_args = [
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "shard_mb")
        ]
        me = [sys.executable, os.path.abspath(__file__), *model_args, "--phase"]
        t = time.time()
        stdout, _, _ = measure(me + ["make", hf_dir])
        model = json.loads(stdout.strip().splitlines()[-1])
        total, largest = model["bytes"], model["largest"]
        print(
            f"synthetic model: {model['params'] / 1e9:.2f}B params, {total / 1e9:.2f} GB bf16 in "
            f"{model['files']} files, largest tensor {largest / 1e9:.2f} GB ({time.time() - t:.0f} s)"
        )
        launcher = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
            if args.nproc > 1
            else [sys.executable]
        )
        rows = []
        reads = [measure(me + ["read", hf_dir]) for _ in range(2)]  # the faster of two (page cache warm)
        stdout, wall, rss = min(reads, key=lambda r: json.loads(r[0].strip().splitlines()[-1])["seconds"])
        rows.append(("raw read (safetensors)", json.loads(stdout.strip().splitlines()[-1])["seconds"], wall, rss))
        runs = [("convert (fsync)", out, []), ("convert, no fsync", out, ["--no-fsync"])]
        shm = "/dev/shm"  # RAM: what the converter does when the disk is not the bottleneck
        if os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * total:
            runs.append(("convert -> tmpfs", os.path.join(shm, f"bench_convert_{os.getpid()}"), []))
        for label, out_dir, extra in runs:
            shutil.rmtree(out_dir, ignore_errors=True)
            stdout, wall, rss = measure(
                launcher
                + [
                    "convert_hf_to_mcore.py",
                    "--hf",
                    hf_dir,
                    "--out",
                    out_dir,
                    "--dtype",
                    "bf16",
                    "--no-tokenizer",
                    *extra,
                ]
            )
            shutil.rmtree(out_dir, ignore_errors=True)
            seconds = float(re.search(r"wrote \S+ GB in (\S+) s", stdout).group(1))
            rows.append((label + (f", {args.nproc} procs" if args.nproc > 1 else ""), seconds, wall, rss))
        stdout, wall, rss = measure(me + ["write", os.path.join(work, "raw_write.bin"), str(total)])
        rows.append(("raw write + fsync", json.loads(stdout.strip().splitlines()[-1])["seconds"], wall, None))

        read_gbps = total / 1e9 / rows[0][1]
        print(f"\n{'':28s} {'GB/s':>6s} {'x raw read':>10s} {'work s':>7s} {'wall s':>7s} {'peak RSS':>9s}")
        for label, seconds, wall, rss in rows:
            gbps = total / 1e9 / seconds
            rss_text = f"{rss / 1e9:.2f} GB" if rss else "-"
            print(f"{label:28s} {gbps:6.2f} {gbps / read_gbps:10.2f} {seconds:7.1f} {wall:7.1f} {rss_text:>9s}")
        budget = 2e9 + 2 * largest
        peak = max(row[3] for row in rows[1:-1])
        print(
            f"\nconverter peak RSS {peak / 1e9:.2f} GB (one process) vs the budget 2 GB + 2 x largest tensor "
            f"= {budget / 1e9:.2f} GB -> {'OK' if peak < budget else 'OVER'}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
