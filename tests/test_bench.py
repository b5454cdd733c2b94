"""The benches on the CPU: the numbers in their BENCH_JSON lines are consistent.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_bench.py

- bench/harness.py's paired statistics by hand: run_pairs alternates which side goes first and
  drops the warm-up pairs; paired_ratios gives the median / min / max of the per-pair ratios
  (not the ratio of the medians) and each side's median;
- bench/harness.py's op counter by hand (each op once, under its pass and the code that made
  it; a function compiled on a GPU or torch's RMSNorm one op per call), and bench/train.py
  --count-ops on the tiny MoE against counts made from its shape;
- bench/train.py, 1 process: tokens = num_seqs * seq_len * steps, tokens/s = tokens / seconds,
  the model FLOPs per step equal a count made by hand below from the tiny shape, MFU = FLOPs /
  s / peak, the baseline (local attention) ran and the ratio is candidate / baseline; the
  median step time lies in [min, max] (and is the mean for 1 or 2 steps);
- torchrun, 2 processes, TP=2 and CP=2 on gloo: one JSON line (rank 0), the same checks at
  another sequence length, MFU null without --peak-tflops on a CPU, and the first step's mean
  logprob and gradient norm equal at both layouts (CP's attention over the other rank's keys);
- a baseline that runs out of memory is reported as OOM and the candidate's numbers stand;
- bench/episode_driver.py: the episodes reach their turns, --tool-workers (default one per episode) reaches the
  driver, the driver's seconds by hand from the run's own;
- bench/agentic.py (CPU smoke): --tool-workers reaches the episode driver, equal tokens on both sides, each side's
  ceiling from its own single-turn seconds (and the ceilings by hand); --sides runs only the sides named;
- every shape of bench/harness.py is read by the bridge and by transformers;
- every flag of --help has a help string (train.py, sync.py, rollout.py, e2e.py, agentic.py);
- bench/sync.py with the CPU engine: the cycle runs, the bytes synced match a hand count, and
  sync / copy is the median of one ratio per timed pair;
- bench/moe.py: one ratio per timed pair, the speed-up is their median (not a ratio of medians);
- bench/rollout.py with the CPU engine: both sides generate exactly prompts x n x max tokens
  in every pair, the ratios are the median / min / max of one per pair; if one side generates
  a token less, no ratio is reported and the exit status is 1;
- bench/e2e.py (whole train_grpo.py steps with drawn response lengths) with the CPU engine, fixed:12
  in one process and a lognormal over two processes (two rollout replicas): every response has
  exactly its drawn length, the token counts are those of the saved samples, tokens/s/GPU and
  the phases' seconds those of metrics.jsonl, the length statistics those of the responses; with --ab,
  B's runs get the flags and each ratio is B's over A's from the runs' own reports.
"""

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import pytest
import torch

from tests.conftest import ROOT, assert_every_flag_documented, run_script, run_torchrun

SCRIPT = os.path.join("bench", "train.py")


def bench_json(output):
    lines = [line for line in output.splitlines() if line.startswith("BENCH_JSON ")]
    assert len(lines) == 1, output[-3000:]  # rank 0 only
    return json.loads(lines[0][len("BENCH_JSON ") :])


def run_code(code, *args, timeout=300):
    """`python -c code args...` from the repo root, as run_script runs a script (the code in a file of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "code.py")
        with open(path, "w") as f:
            f.write(f"import sys\nsys.path.insert(0, {ROOT!r})\n{code}\n")
        return run_script(path, *args, timeout=timeout, check=False)


def run(*args, code=None, timeout=300):
    if code:
        proc = run_code(code, timeout=timeout)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return proc.stdout
    return run_script(SCRIPT, *args, timeout=timeout).stdout


def tiny_step_flops(seq_len, num_seqs, causal):
    """Model FLOPs of one step for the "tiny" shape, counted by hand: hidden 64, ffn 192,
    2 layers, 4 heads of 16 (q: 64 wide), 2 kv heads (k, v: 32 wide each), vocabulary 512."""
    qkv = 64 * 64 + 64 * 32 + 64 * 32  # q, k, v projections
    o = 64 * 64
    mlp = 3 * 64 * 192  # gate, up, down
    lm_head = 512 * 64
    matmul_weights = 2 * (qkv + o + mlp) + lm_head  # = 131072
    attention = 2 * 2 * 2 * seq_len * 64  # QK^T and AV: 2 FLOPs x layers x seq_len x q width, each
    if causal:
        attention //= 2
    forward = 2 * matmul_weights + attention  # per token
    return 4 * forward * num_seqs * seq_len  # logprob pass (1x) + forward/backward (3x)


def check_run(r, *, seq_len, num_seqs, steps, world_size, baseline=True):
    assert (r["seq_len"], r["num_seqs"], r["steps"], r["world_size"]) == (seq_len, num_seqs, steps, world_size)
    assert r["flops_per_step"] == tiny_step_flops(seq_len, num_seqs, causal=True)
    assert r["flops_per_step_full_attn"] == tiny_step_flops(seq_len, num_seqs, causal=False)
    for name in ("candidate", "baseline") if baseline else ("candidate",):
        c = r[name]
        assert c["status"] == "ok", r
        assert c["tokens"] == num_seqs * seq_len * steps
        assert c["tokens_per_s"] > 0
        assert c["tokens_per_s"] == pytest.approx(c["tokens"] / c["seconds"], rel=1e-9)
        assert c["step_s"] == pytest.approx(c["seconds"] / steps, rel=1e-9)
        assert c["step_s_min"] <= c["step_s"] <= c["step_s_max"]
        assert c["step_s_min"] <= c["step_s_median"] <= c["step_s_max"]
        if steps <= 2:  # the median of one or two numbers is their mean
            assert c["step_s_median"] == pytest.approx(c["step_s"], rel=1e-9)
        assert c["peak_mem_gib"] is None  # no GPU
    if baseline:
        assert r["ratio_tokens_per_s"] == pytest.approx(r["candidate"]["tokens_per_s"] / r["baseline"]["tokens_per_s"])
        assert r["ratio_step_s_median"] == pytest.approx(
            r["baseline"]["step_s_median"] / r["candidate"]["step_s_median"]
        )


def test_single_process():
    out = run("--shape", "tiny", "--steps", 2, "--warmup", 1, "--peak-tflops", 0.001)
    r = bench_json(out)
    assert (r["shape"], r["attention"], r["recompute"], r["dtype"], r["device"]) == (
        "tiny",
        "sdpa",
        "none",
        "float32",
        "cpu",
    )
    # HF parameters: tied embedding, per layer q/k/v/o + q/k/v bias + MLP + 2 norms, final norm
    assert r["params"] == 512 * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + (64 + 32 + 32) + 3 * 64 * 192 + 2 * 64) + 64
    check_run(r, seq_len=128, num_seqs=4, steps=2, world_size=1)
    c = r["candidate"]
    # MFU = model FLOP/s / (devices x peak); --peak-tflops 0.001 is 1e9 FLOP/s
    assert c["mfu"] == pytest.approx(r["flops_per_step"] / c["step_s"] / 1e9, rel=1e-9)
    assert c["mfu_full_attn"] == pytest.approx(r["flops_per_step_full_attn"] / c["step_s"] / 1e9, rel=1e-9)
    assert "baseline: local, recompute none" in out and "candidate / baseline: tokens/s x" in out
    # every step's gradient norm, warm-up and timed: the first is the first step's
    assert len(c["first_step"]["grad_norms"]) == 3 and c["first_step"]["grad_norms"][0] == c["first_step"]["grad_norm"]


def test_cuda_graphs_flag_refused_on_cpu():
    """--cuda-graphs (megatron's local CUDA graphs of the layers) says why it cannot run here."""
    proc = run_script(SCRIPT, "--shape", "tiny", "--cuda-graphs", check=False, timeout=300)
    assert proc.returncode != 0 and "--cuda-graphs: needs a GPU" in proc.stderr, proc.stderr[-3000:]


def test_summarize_kernels_by_hand():
    # overlapping intervals count once in the busy time; categories by name, attention first
    # (flash kernels carry "sm90" too)
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import summarize_kernels

    s = summarize_kernels(
        [
            ("sm90_xmma_gemm_bf16", 0, 40),
            ("flash_fwd_sm90_kernel", 30, 20),
            ("vectorized_elementwise_kernel", 100, 10),
            ("triton_red_fused_0", 150, 5),
            ("sm90_xmma_gemm_bf16", 160, 40),
        ],
        wall_us=400,
    )
    assert s["busy_ms"] == pytest.approx((50 + 10 + 5 + 40) / 1e3)
    assert s["idle_frac"] == pytest.approx(1 - 105 / 400)
    assert s["categories"] == pytest.approx(
        {"matmul": 0.08, "attention": 0.02, "elementwise": 0.01, "fused (triton)": 0.005}
    )
    assert s["top"][0] == (pytest.approx(0.08), 2, "sm90_xmma_gemm_bf16")


class _BackwardCallsCompiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        from common.model.moe_experts import swiglu_weighted

        return swiglu_weighted(torch.cat([grad, grad], -1), torch.ones(len(grad)))  # cat, ones, compiled


def _counted_step(x, w, probs):
    from common.model.moe_experts import swiglu_weighted

    h = (_BackwardCallsCompiled.apply(x) * 2).sum(-1, keepdim=True) + x  # (clone), mul, sum, add
    h = torch.nn.functional.rms_norm(h, (8,), w)  # one fused kernel on a GPU (6 ops on a CPU)
    return swiglu_weighted(torch.cat([h, h], -1), probs).sum()  # cat, compiled on a GPU (4 ops here), sum


def test_count_ops_by_hand():
    """harness.count_ops: every op counted once under its pass and the code that made it; a
    function common/rl/fused.py compiles on a GPU and torch's RMSNorm are one op per call each
    way, however many they dispatch on a CPU (two calls in a row are two; one that a custom
    backward calls is one backward op)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import count_ops

    from common.model.moe_experts import swiglu_weighted

    x, w, probs = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True), torch.rand(4)

    def fn():
        _counted_step(x, w, probs).backward()
        with torch.no_grad():
            _counted_step(x, w, probs)
            swiglu_weighted(torch.ones(4, 16), probs)
            swiglu_weighted(torch.ones(4, 16), probs)  # ones: one fill each

    r = count_ops(fn)
    sites = {(where, name): n for n, where, name in r["sites"]}
    mine, swiglu = "tests/test_bench.py:_counted_step", "compiled: common.model.moe_experts.swiglu_weighted"
    norm = "fused on a GPU: torch.nn.functional.rms_norm"
    assert sites["forward", mine] == 5 and sites["no_grad", mine] == 5  # mul, sum, add, cat, sum
    assert sites["no_grad", "tests/test_bench.py:forward"] == 2  # the clone: a custom forward is not recorded
    assert sites["forward", "tests/test_bench.py:fn"] == 1  # backward()'s ones_like
    assert sites["no_grad", "tests/test_bench.py:fn"] == 2  # the two torch.ones
    assert sites["forward", norm] == sites["no_grad", norm] == sites["backward", norm] == 1
    assert sites["forward", swiglu] == 1 and sites["no_grad", swiglu] == 3
    assert sites["backward", swiglu] == 2  # its own backward, and the call in _BackwardCallsCompiled.backward
    assert r["by_pass"]["forward"] == 8 and r["by_pass"]["no_grad"] == 13
    # the backward of the eager ops only, under the frame that made them (mul, add, cat: sum's is a
    # view), and the custom backward's cat and ones under the forward that made its node
    assert all(name in (mine, norm, swiglu) for where, name in sites if where == "backward")
    assert sites["backward", mine] >= 4
    assert r["total"] == sum(n for n, _, _ in r["sites"]) == sum(r["by_pass"].values())


def test_count_ops_flag_tiny_moe():
    """bench/train.py --count-ops: one step of the tiny MoE (2 layers, 8 experts), its ops by site
    in BENCH_JSON. Counts made by hand from the shape: the updated parameters (2 layers x (QKV,
    proj, q/k norms, 2 layer norms, router, 8 experts x fc1/fc2) + embedding, final norm, LM head:
    49 tensors) are copied into the model by one foreach copy per optimizer (dense, experts:
    common/train/setup.py ListedCopies), not one copy each as megatron's distributed optimizer
    does (--ab listed-copies switches back to it); each pass
    runs RMSNorm 2 x 4 + 1 times per micro-batch (one kernel each way on a GPU); each MoE layer's
    router and dispatcher call their compiled functions once per layer and micro-batch: the
    logprob pass takes both sequences in one (--logprob-micro-batch-size 2), the update one each
    (two). The counted step comes after --ab logprob-micro-batch's pairs, which must leave the
    asked sizes behind."""
    r = bench_json(
        run(
            "--shape",
            "tiny-moe",
            "--steps",
            1,
            "--warmup",
            1,
            "--no-baseline",
            "--count-ops",
            "--seq-len",
            64,
            "--num-seqs",
            2,
            "--micro-batch-size",
            1,
            "--logprob-micro-batch-size",
            2,
            "--ab",
            "logprob-micro-batch",
        )
    )
    assert len(r["candidate"]["ab"]["ratios"]) == 1
    counts = r["candidate"]["op_counts"]
    sites = {(where, name): n for n, where, name in counts["sites"]}
    assert sites["no_grad", "common/train/setup.py:_copy_main_params_to_model_params"] == 2
    assert {op: n for n, op in counts["ops"]}["aten._foreach_copy_"] == 2
    assert not [name for _, name in sites if name.endswith("copy_group_params")]
    norm = "fused on a GPU: torch.nn.functional.rms_norm"
    assert sites["no_grad", norm] == 2 * 4 + 1 and sites["forward", norm] == sites["backward", norm] == 2 * (2 * 4 + 1)
    for name in ("model.moe.permuted_rows", "model.moe_router.topk_routing"):
        assert sites["no_grad", "compiled: common." + name] == 2 and sites["forward", "compiled: common." + name] == 4
    assert counts["total"] == sum(counts["by_pass"].values()) == sum(n for n, _, _ in counts["sites"])


def test_run_pairs_alternates_and_drops_warmup():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import run_pairs

    calls = []

    def side(name, value):
        def run(pair):
            calls.append((name, pair))
            return value + pair

        return run

    a, b = run_pairs(side("a", 10), side("b", 20), reps=3, warmup=1)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert (a, b) == ([11, 12, 13], [21, 22, 23])  # pair 0 warmed up


def test_e2e_steady_state_of_engines_of_their_own_by_hand():
    """bench/e2e.py's estimate with --rollout-gpus: two timed steps, the first on banked samples (10 s, no wait),
    the second waiting 15 s for them. The engines made 100k + 200k tokens in 5 + 15 busy seconds: 15k tokens/s, so
    a step's 120k response tokens need 8 s of them, under the trainer's (10 + 10) / 2 s: bound by the trainer at
    150k tokens / 10 s / 2 GPUs; halve the engines' rate and they bound it (16 s a step)."""
    spec = importlib.util.spec_from_file_location("e2e_module", os.path.join(ROOT, "bench", "e2e.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    timed = [
        dict(step_s=10.0, rollout_s=0.0, tokens=150_000, response_tokens=120_000, generated_tokens=100_000),
        dict(step_s=25.0, rollout_s=15.0, tokens=150_000, response_tokens=120_000, generated_tokens=200_000),
    ]
    for r, busy in zip(timed, (5.0, 15.0)):
        r["engine_busy_sec"] = busy
    est = e2e.engines_bound(timed, world=2)
    assert est["engine_tokens_per_s"] == 15_000 and est["engine_s_per_step"] == 8.0
    assert est["trainer_s_per_step"] == 10.0 and est["bound"] == "trainer" and est["tokens_per_s_per_gpu"] == 7_500
    for r in timed:
        r["engine_busy_sec"] *= 2
    est = e2e.engines_bound(timed, world=2)
    assert (
        est["engine_s_per_step"] == 16.0 and est["bound"] == "engines" and est["tokens_per_s_per_gpu"] == 150_000 / 32
    )
    # whole requests (no generated_tokens): a step's own response tokens over the engines' seconds for them
    whole = [dict(step_s=12.0, rollout_s=2.0, tokens=150_000, response_tokens=120_000, engine_busy_sec=12.0)]
    assert e2e.engines_bound(whole, world=2)["engine_s_per_step"] == 12.0
    assert e2e.engines_bound([dict(whole[0], engine_busy_sec=0.0)], world=2) is None
    # --ab: B / A of the estimates beside the measured ratios, where both sides have one
    side = dict(step_s_mean=10.0, tokens_per_s_per_gpu=100.0, phases={}, device="cpu")
    a, b = (
        dict(side, steady_state=dict(tokens_per_s_per_gpu=80.0)),
        dict(side, steady_state=dict(tokens_per_s_per_gpu=60.0)),
    )
    assert e2e.ab_report([a], [b], "--x")["ratios"]["steady_tokens_per_s_per_gpu"]["median"] == 0.75
    assert "steady_tokens_per_s_per_gpu" not in e2e.ab_report([side], [b], "--x")["ratios"]


def test_paired_ratios_by_hand():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import paired_ratios

    # per pair: 2/1, 3/2, 1/1, 4/1, 6/4 = 2, 1.5, 1, 4, 1.5 -> median 1.5, min 1, max 4, while
    # the ratio of the medians would be 3 / 1 = 3: one side's lucky pair does not decide
    s = paired_ratios([2.0, 3.0, 1.0, 4.0, 6.0], [1.0, 2.0, 1.0, 1.0, 4.0])
    assert s["ratios"] == [2.0, 1.5, 1.0, 4.0, 1.5]
    assert (s["median"], s["min"], s["max"]) == (1.5, 1.0, 4.0)
    assert (s["a_median"], s["b_median"]) == (3.0, 1.0)
    # an even number of pairs: the mean of the middle two
    assert paired_ratios([1.0, 2.0, 6.0, 4.0], [1.0, 1.0, 2.0, 1.0])["median"] == 2.5  # of 1, 2, 3, 4
    with pytest.raises(AssertionError):
        paired_ratios([1.0, 2.0], [1.0])


def test_profile_flag_cpu():
    out = run("--shape", "tiny", "--steps", 1, "--warmup", 1, "--no-baseline", "--profile", "--kernels", "eager")
    r = bench_json(out)
    p = r["candidate"]["profile"]
    assert r["kernels"] == "eager" and p["busy_ms"] > 0 and p["wall_ms"] >= p["busy_ms"] and p["top"]
    assert "profile of one step: wall" in out
    # the ops that launched the most time, most first, with input shapes: the tiny model's matmuls among them
    ops = p["op_shapes_top"]
    assert [row[0] for row in ops] == sorted((row[0] for row in ops), reverse=True) and ops[-1][0] > 0
    assert any(op == "aten::mm" and shapes.startswith("[[") for _, _, op, shapes in ops)


def test_torchrun_tp2_and_cp2():
    """TP=2 and CP=2 on the same batch: the bench's numbers, and the first step's mean old
    logprob and gradient norm equal between the two layouts (on a CPU megatron initialises
    the full weights, then shards them: the same model at both; fp32)."""
    common = ("--shape", "tiny", "--steps", 1, "--warmup", 1, "--seq-len", 64)
    runs = {}
    for flag in ("--tp", "--cp"):
        runs[flag] = r = bench_json(run_torchrun(SCRIPT, 2, *common, flag, 2).stdout)
        check_run(r, seq_len=64, num_seqs=4, steps=1, world_size=2, baseline=flag == "--tp")
        assert r["candidate"]["mfu"] is None and r["peak_tflops"] is None  # a CPU and no --peak-tflops
    assert [(r["tp"], r["cp"], r["dp"], r["pp"]) for r in runs.values()] == [(2, 1, 1, 1), (1, 2, 1, 1)]
    assert runs["--cp"]["baseline"] == {"status": "skipped"}  # megatron's local attention has no CP
    tp, cp = (r["candidate"]["first_step"] for r in runs.values())
    assert cp["logprob_mean"] == pytest.approx(tp["logprob_mean"], rel=1e-5)
    assert cp["grad_norm"] == pytest.approx(tp["grad_norm"], rel=1e-4)


def test_allgather_dispatcher_ab_at_ep2():
    """bench/train.py --ab allgather at EP=2: megatron's all-to-all and --moe-dispatcher
    allgather swapped step by step in one process (CPU smoke: the pairs ran, both sides' step
    times are there; the speed itself is a GPU question)."""
    r = bench_json(
        run_torchrun(
            SCRIPT,
            2,
            "--shape",
            "tiny-moe",
            "--ep",
            2,
            "--steps",
            2,
            "--warmup",
            1,
            "--seq-len",
            32,
            "--no-baseline",
            "--ab",
            "allgather",
        ).stdout
    )
    assert r["ep"] == 2 and r["candidate"]["status"] == "ok"
    ab = r["candidate"]["ab"]
    assert len(ab["ratios"]) == 2 and all(x > 0 for x in ab["ratios"]) and ab["median"] > 0, ab


def test_baseline_oom_is_reported():
    # build_model raises the CUDA OOM error for the baseline's local attention
    code = "\n".join(
        [
            "import runpy, sys, torch",
            "import common.model.gpt",
            "real = common.model.gpt.build_model",
            "def build_model(spec, **kw):",
            "    if kw.get('attention') == 'local':",
            "        raise torch.OutOfMemoryError('CUDA out of memory (simulated by the test)')",
            "    return real(spec, **kw)",
            "common.model.gpt.build_model = build_model",
            f"sys.argv = ['{SCRIPT}', '--shape', 'tiny', '--steps', '1', '--warmup', '1']",
            f"runpy.run_path('{SCRIPT}', run_name='__main__')",
        ]
    )
    out = run(code=code)
    r = bench_json(out)
    assert r["baseline"] == {"status": "oom"}
    assert r["candidate"]["status"] == "ok" and r["candidate"]["tokens"] == 4 * 128
    assert r["ratio_tokens_per_s"] is None and r["ratio_peak_mem"] is None and r["ratio_step_s_median"] is None
    assert "(baseline: OOM)" in out


def test_help_documents_every_flag():
    others = ("sync.py", "rollout.py", "e2e.py", "agentic.py", "lora_sync.py", "episode_driver.py")
    for script in (SCRIPT, *(os.path.join("bench", name) for name in others)):
        spec = importlib.util.spec_from_file_location("bench_module", os.path.join(ROOT, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert_every_flag_documented(module.build_parser())
    assert "--peak-tflops" in run("--help")


def test_sync_bench_cpu_smoke():
    """bench/sync.py with the CPU engine (vLLM needs a GPU): the cycle runs, the engine still
    generates after it, and the bytes synced are the tiny shape's, counted by hand."""
    proc = run_script(os.path.join("bench", "sync.py"), "--shape", "tiny", "--reps", "2", timeout=300)
    result = bench_json(proc.stdout)
    # tiny: hidden 64, ffn 192, 2 layers, 4 heads x 16, 2 kv heads, vocab 512, tied, q/k/v bias
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 192 + 2 * 64
    params = 2 * per_layer + 512 * 64 + 64
    assert round(result["model_gb"] * 1e9) == params * 4  # fp32 on a CPU
    assert result["engine"] == "hf" and result["sync_s"] > 0 and result["export_only_s"] > 0
    # one sync / copy ratio per timed pair; the reported ratio is their median, not a ratio of medians
    ratios = result["sync_vs_copy_per_pair"]
    assert len(ratios) == 2
    assert result["sync_vs_copy"] == pytest.approx(statistics.median(ratios), rel=1e-5)
    assert (result["sync_vs_copy_min"], result["sync_vs_copy_max"]) == pytest.approx(
        (min(ratios), max(ratios)), rel=1e-5
    )


def test_moe_bench_cpu_smoke():
    """bench/moe.py on a tiny MoE (no grouped path on a CPU, both sides run the loop): the
    timed pairs and the median of their ratios are what BENCH_JSON reports."""
    proc = run_script(os.path.join("bench", "moe.py"), "--shape", "tiny", "--reps", "3", "--tokens", "64", timeout=300)
    result = bench_json(proc.stdout)
    assert result["grouped_path"] is False and len(result["ratios"]) == 3
    assert result["speedup_median_of_pairs"] == pytest.approx(statistics.median(result["ratios"]), rel=1e-3)
    assert result["speedup_min"] == pytest.approx(min(result["ratios"]), rel=1e-3)
    assert result["speedup_max"] == pytest.approx(max(result["ratios"]), rel=1e-3)
    assert result["loop_s"] > 0 and result["grouped_s"] > 0


ROLLOUT_ARGS = [
    "--shape",
    "tiny",
    "--num-prompts",
    "2",
    "--samples-per-prompt",
    "3",
    "--prompt-len",
    "8",
    "--max-new-tokens",
    "6",
    "--reps",
    "3",
]


def test_rollout_bench_cpu_smoke():
    """bench/rollout.py with the CPU engine (HFEngine vs transformers' generate): both sides
    generate 2 prompts x 3 samples x 6 tokens = 36 tokens in every timed pair (EOS impossible),
    and the ratios are the median / min / max of one ratio per pair."""
    proc = run_script(os.path.join("bench", "rollout.py"), *ROLLOUT_ARGS, timeout=300)
    r = bench_json(proc.stdout)
    assert (r["engine"], r["reps"]) == ("hf", 3)
    assert r["tokens_per_pair"] == [[36, 36]] * 3  # baseline, ours
    for prefix in ("ratio", "ratio_with_cycle"):
        ratios = r[f"{prefix}_per_pair"]
        assert len(ratios) == 3 and all(x > 0 for x in ratios)
        assert r[prefix] == statistics.median(ratios)
        assert (r[f"{prefix}_min"], r[f"{prefix}_max"]) == (min(ratios), max(ratios))
    # the cycle and the sleep are inside ours+cycle's seconds: slower than ours alone, pair by pair
    assert all(c < o for c, o in zip(r["ratio_with_cycle_per_pair"], r["ratio_per_pair"]))
    assert r["baseline_tok_s"] > 0 and r["ours_tok_s"] > r["ours_cycle_tok_s"] > 0


def test_rollout_bench_refuses_unequal_work():
    """One sample of ours one token short in the second timed pair: no ratio, exit status 1."""
    script = os.path.join("bench", "rollout.py")
    code = "\n".join(
        [
            "import runpy, sys",
            "import common.rollout.hf_engine",
            "real = common.rollout.hf_engine.HFEngine.generate",
            "calls = []",
            "def generate(self, *args, **kwargs):",
            "    samples = real(self, *args, **kwargs)",
            "    calls.append(1)",
            "    if len(calls) == 3:  # the warm-up pair, pair 1, then pair 2",
            "        samples[0].response_ids.pop()",
            "    return samples",
            "common.rollout.hf_engine.HFEngine.generate = generate",
            f"sys.argv = {[script] + ROLLOUT_ARGS!r}",
            f"runpy.run_path({script!r}, run_name='__main__')",
        ]
    )
    proc = run_code(code)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-5000:]
    r = bench_json(proc.stdout)
    assert r["tokens_per_pair"] == [[36, 36], [36, 35], [36, 36]]
    assert r["ratio"] is None and r["ratio_min"] is None and r["ratio_per_pair"] is None
    assert r["ratio_with_cycle"] is None
    assert "no ratio: the token counts differ" in proc.stdout


def run_e2e(tmp_path, spec, *, nproc, warmup, steps, prompts, group):
    """bench/e2e.py on the embedded tiny model, 8-character prompts (8 tokens: a byte per token),
    every step's samples saved by train_grpo.py (--save-rollouts after `--`). Returns (BENCH_JSON,
    the timed steps' metrics.jsonl rows, their saved samples, the run dir)."""
    out, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [os.path.join("bench", "e2e.py"), "--nproc", nproc, "--response-lengths", spec]
    cmd += ["--prompt-len", 8, "--warmup", warmup, "--steps", steps, "--out", out, "--"]
    cmd += ["--prompts-per-step", prompts, "--samples-per-prompt", group, "--micro-batch-size", 2]
    cmd += ["--mini-batch-size", prompts * group // 2, "--save-rollouts", saved]  # two optimizer steps
    proc = run_script(*cmd, env=dict(TOKENIZERS_PARALLELISM="false"), timeout=300)
    r = bench_json(proc.stdout)
    with open(out / "e2e.json") as f:
        assert json.load(f) == r
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == list(range(warmup + steps))
    timed = rows[warmup:]
    samples = [torch.load(saved / f"step_{row['step']:06d}.pt", weights_only=False)["samples"] for row in timed]
    return r, timed, samples, out


def check_e2e(r, timed, samples, *, nproc, warmup, steps, prompts, group):
    """The report against the run's own files: token counts from the saved samples, seconds from
    metrics.jsonl, the length statistics from the responses' real lengths."""
    assert (r["device"], r["world_size"], r["warmup_steps"], r["steps"]) == ("cpu", nproc, warmup, steps)
    assert (r["prompts_per_step"], r["samples_per_prompt"], r["samples_per_step"]) == (prompts, group, prompts * group)
    assert r["mini_batch_size"] == prompts * group // 2 and r["lengths_exact"] is True
    assert "train_grpo.py --bench-response-lengths " + r["response_lengths"] in r["command"]
    assert r["command"].startswith(sys.executable + (" train_grpo.py" if nproc == 1 else " -m torch.distributed.run"))
    lengths = [[len(s.response_ids) for s in step] for step in samples]
    assert all(len(s.prompt_ids) == 8 for step in samples for s in step)
    tokens = [prompts * group * 8 + sum(step) for step in lengths]
    assert r["tokens_per_step"] == tokens and [row["tokens"] for row in timed] == tokens
    assert r["response_tokens_per_step"] == [sum(step) for step in lengths]
    assert r["prompt_tokens_per_sample"] == 8
    step_s = [row["step_s"] for row in timed]
    assert r["step_s_per_step"] == step_s and r["step_s_mean"] == pytest.approx(sum(step_s) / steps, rel=1e-12)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(sum(tokens) / sum(step_s) / nproc, rel=1e-12)
    assert r["tokens_per_s_per_gpu_per_step"] == pytest.approx([t / s / nproc for t, s in zip(tokens, step_s)])
    phases = r["phases"]
    for name in ("rollout_s", "reward_s", "old_logprob_s", "ref_s", "train_s", "sync_s"):
        seconds = sum(row[name] for row in timed)
        assert phases[name]["s"] == pytest.approx(seconds / steps, rel=1e-12)
        assert phases[name]["tokens_per_s_per_gpu"] == pytest.approx(sum(tokens) / seconds / nproc, rel=1e-12)
    assert "gen_tokens_per_s" not in phases and "save_s" not in phases  # a rate; no checkpoint in a benchmark
    assert sum(p["s"] for p in phases.values()) == pytest.approx(sum(step_s) / steps, rel=1e-9)  # other_s: the rest
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0, rel=1e-9)
    flat = sorted(n for step in lengths for n in step)
    n = len(flat)
    assert r["lengths"]["count"] == n == steps * prompts * group
    assert (r["lengths"]["min"], r["lengths"]["max"]) == (flat[0], flat[-1])
    assert r["lengths"]["mean"] == pytest.approx(sum(flat) / n, rel=1e-12)
    assert r["lengths"]["p50"] == flat[(n + 1) // 2 - 1] and r["lengths"]["p90"] == flat[-(-9 * n // 10) - 1]
    return lengths


def test_e2e_fixed_lengths(tmp_path):
    """bench/e2e.py, one process, fixed:12 for one timed step after one warm-up step: every response
    exactly 12 tokens (EOS ignored; the embedded model stops on one of its 3 EOS ids at random
    otherwise), 16 x (8 + 12) tokens in the step, tokens/s/GPU and the phases from metrics.jsonl,
    no checkpoint written."""
    shape = dict(nproc=1, warmup=1, steps=1, prompts=4, group=4)
    r, timed, samples, out = run_e2e(tmp_path, "fixed:12", **shape)
    lengths = check_e2e(r, timed, samples, **shape)
    assert lengths == [[12] * 16] and r["tokens_per_step"] == [16 * (8 + 12)]
    assert {s.finish_reason for s in samples[0]} == {"length"}
    assert (r["lengths"]["std"], r["lengths"]["p99"]) == (0.0, 12)
    assert not os.path.exists(out / "checkpoints")


def test_e2e_lognormal_lengths_two_replicas(tmp_path):
    """bench/e2e.py, two processes (two CPU rollout replicas, each half of the prompts), a lognormal
    spec, two timed steps: sample j of prompt i has exactly the length drawn for it (the report's
    draws), in the gathered order (replica 0's prompts 0, 2, then replica 1's 1, 3), within [min, max]."""
    from common.rollout.lengths import draw_lengths

    spec = "lognormal:mean=20,sigma=0.6,min=4,max=48"
    shape = dict(nproc=2, warmup=0, steps=2, prompts=4, group=4)
    r, timed, samples, _ = run_e2e(tmp_path, spec, **shape)
    lengths = check_e2e(r, timed, samples, **shape)
    for step, got in enumerate(lengths):
        drawn = draw_lengths(spec, 4, 4, seed=1234, step=step)
        assert got == drawn[0] + drawn[2] + drawn[1] + drawn[3]
    flat = [n for step in lengths for n in step]
    assert 4 <= min(flat) and max(flat) <= 48 and len(set(flat)) > 5


def test_e2e_ab_compares_whole_runs(tmp_path):
    """bench/e2e.py --ab: A as given, B with the flags added (each run's own config says so), A first in the first
    pair; each ratio is B's seconds over A's from the two runs' own reports (e2e.json), e2e_ab.json is the line."""
    out = tmp_path / "ab"
    cmd = [os.path.join("bench", "e2e.py"), "--response-lengths", "fixed:4", "--prompt-len", 8]
    # one flag after --ab, as `--ab --true-on-policy` is typed (argparse alone reads it as a flag of its own)
    cmd += ["--warmup", 0, "--steps", 1, "--out", out, "--ab", "--micro-batch-size=1", "--pairs", 1, "--"]
    cmd += ["--prompts-per-step", 2, "--samples-per-prompt", 2, "--mini-batch-size", 4]
    proc = run_script(*cmd, timeout=300)
    r = bench_json(proc.stdout)
    with open(out / "e2e_ab.json") as f:
        assert json.load(f) == r
    runs = [line for line in proc.stdout.splitlines() if line.startswith("running: ")]
    assert len(runs) == 2 and str(out / "a0") in runs[0] and str(out / "b0") in runs[1]
    side = {}
    for name in ("a0", "b0"):
        with open(out / name / "config.json") as f:
            side[name] = json.load(f)["args"]["micro_batch_size"]
        with open(out / name / "e2e.json") as f:
            side[name + ".json"] = json.load(f)
    assert side["a0"] != 1 and side["b0"] == 1
    a, b = side["a0.json"], side["b0.json"]
    assert r["ab_flags"] == "--micro-batch-size=1" and r["pairs"] == 1 and r["a"] == [a] and r["b"] == [b]
    step = r["ratios"]["step_s"]
    assert step["ratios"] == [b["step_s_mean"] / a["step_s_mean"]] and step["median"] == step["ratios"][0]
    assert (step["a_median"], step["b_median"]) == (a["step_s_mean"], b["step_s_mean"])
    for phase in ("rollout_s", "train_s", "other_s"):
        assert r["ratios"][phase]["median"] == b["phases"][phase]["s"] / a["phases"][phase]["s"], phase
    assert r["ratios"]["tokens_per_s_per_gpu"]["median"] == b["tokens_per_s_per_gpu"] / a["tokens_per_s_per_gpu"]


def test_agentic_bench_passes_tool_workers_to_the_episodes():
    """bench/agentic.py's CPU smoke: --tool-workers reaches run_episodes (max_workers), both comparisons
    generate the same tokens as single-turn, the tools take the --tool-ms distribution's drawn times (as the
    episode driver measured them), and the result says what it ran."""
    code = (
        "import runpy, sys, common.rollout.episodes as ep\n"
        "real = ep.run_episodes\n"
        "def spy(*a, **k):\n"
        "    print('MAX_WORKERS', k['max_workers'], flush=True)\n"
        "    return real(*a, **k)\n"
        "ep.run_episodes = spy\n"
        "sys.argv = ['bench/agentic.py'] + sys.argv[1:]\n"
        "runpy.run_path('bench/agentic.py', run_name='__main__')\n"
    )
    args = "--shape tiny --episodes 4 --turns 2 --turn-tokens 4 --tool-ms uniform:min=20,max=40".split()
    proc = run_code(code, *args, "--reps", "1", "--tool-workers", "3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("MAX_WORKERS")}
    assert workers == {"3"}
    result = bench_json(proc.stdout)
    assert result["tool_workers"] == 3 and result["episodes_tokens"] == result["lockstep_tokens"] == 4 * 2 * 4
    assert 20 <= result["tool_ms_drawn_mean"] <= 40
    # measured by the driver: at least the drawn sleep; the upper bound catches a unit slip (seconds as ms), not
    # speed (on a loaded 2-core machine thread wake-ups and calls queued behind the 3 workers can triple it)
    for name in ("episodes", "lockstep"):
        assert result["tool_ms_drawn_mean"] <= result[f"{name}_tool_ms_per_turn"] < 1000
        assert result[f"{name}_single_tok_s"] > 0 and result[f"{name}_single_seconds"] > 0  # each its own baseline
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from agentic import ceilings, tool_delays

    delays = tool_delays("uniform:min=20,max=40", 4, 2)  # what the run drew
    for i, name in enumerate(("episodes", "lockstep")):  # one timed pair: its ceiling from its single-turn seconds
        assert result[f"{name}_ceiling"] == pytest.approx(ceilings(delays, result[f"{name}_single_seconds"])[i])


def test_agentic_bench_runs_only_the_sides_asked_for():
    """--sides lockstep: only the lock-step comparison runs (each of its rollouts printed as it ends), the result
    has no request-by-request keys, and the exit code looks at the side that ran. --dummy-weights and --max-num-seqs
    act on vLLM only (a GPU run's result gives the batch vLLM ran); on the CPU engine they are recorded, no more.
    Each rollout's collections are counted: here every lock-step rollout runs one full collection of its own, inside
    a heap --gc-freeze froze for it."""
    args = "--shape tiny --episodes 2 --turns 2 --turn-tokens 4 --tool-ms 10 --reps 1 --sides lockstep".split()
    args += ["--dummy-weights", "--max-num-seqs", "8", "--gc-freeze"]
    proc = run_code(
        "import gc, runpy, sys\n"
        "import common.rollout.episodes as ep\n"
        "real = ep.run_episodes\n"
        "def run(*a, **k):\n"
        "    print('frozen objects', gc.get_freeze_count() > 0)\n"
        "    gc.collect()\n"
        "    return real(*a, **k)\n"
        "ep.run_episodes = run\n"
        "sys.argv = ['bench/agentic.py'] + sys.argv[1:]\n"
        "runpy.run_path('bench/agentic.py', run_name='__main__')\n",
        *args,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = bench_json(proc.stdout)
    assert result["lockstep_tokens"] == 2 * 2 * 4 and result["lockstep_over_single"] > 0
    assert not any(key.startswith("episodes_") for key in result)
    assert result["dummy_weights"] is True and result["max_num_seqs"] == 8 and result["engine"] == "cpu"
    assert proc.stdout.count("frozen objects True") == 2  # the warm-up pair's rollout and the timed one
    assert result["lockstep_gc_full"] >= 1 and result["lockstep_gc_s"] > 0
    assert len(result["lockstep_seconds_per_pair"]) == 1
    lines = [line.strip() for line in proc.stdout.splitlines() if " rollout (pair " in line]
    assert len(lines) == 4  # a warm-up pair and one timed pair
    assert {line.split(" rollout")[0] for line in lines} == {"lockstep", "single-turn"}


def test_agentic_bench_ceilings_by_hand():
    """bench/agentic.py's ceilings: request by request the longest episode's tool time is added to the single-turn
    seconds, in waves each turn's slowest tool."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from agentic import ceilings

    delays = [[0.1, 0.2], [0.3, 0.05]]  # episode sums 0.3, 0.35; per turn the slowest 0.3, 0.2
    request, waves = ceilings(delays, 1.0)
    assert request == pytest.approx(1 / 1.35) and waves == pytest.approx(1 / 1.5)
    assert ceilings([[0.1] * 4] * 256, 2.51)[0] == pytest.approx(2.51 / 2.91)  # docs/agentic.md: 0.86


def test_episode_driver_bench():
    """bench/episode_driver.py (no model): each episode count runs its episodes to --turns turns on the stand-in
    engine, one worker per episode unless --tool-workers says otherwise (what reaches run_episodes), and the
    driver's seconds are the rollout's beyond the steps' nominal time and the unhidden tools."""
    code = (
        "import runpy, sys, common.rollout.episodes as ep\n"
        "real = ep.run_episodes\n"
        "def spy(*a, **k):\n"
        "    print('EPISODES', len(a[3]), 'WORKERS', k['max_workers'], flush=True)\n"
        "    return real(*a, **k)\n"
        "ep.run_episodes = spy\n"
        "sys.argv = ['bench/episode_driver.py'] + sys.argv[1:]\n"
        "runpy.run_path('bench/episode_driver.py', run_name='__main__')\n"
    )
    args = "--episodes 3 6 --turns 2 --turn-tokens 4 --step-ms 1 --tool-ms 5 --reps 1".split()
    proc = run_code(code, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    spied = [line.split() for line in proc.stdout.splitlines() if line.startswith("EPISODES")]
    assert [(int(e), int(w)) for _, e, _, w in spied] == [(3, 3), (6, 6)]
    result = bench_json(proc.stdout)
    for episodes in ("3", "6"):
        r = result["per_episodes"][episodes]
        assert r["engine_steps"] >= 2 * 4  # two turns of four steps each, one after the other
        assert r["driver_s"] == pytest.approx(r["seconds"] - r["engine_steps"] * 0.001 - 2 * 0.005)
        assert r["driver_ms_per_step"] == pytest.approx(1000 * r["driver_s"] / r["engine_steps"])
    proc = run_code(code, *args[:-2], "--tool-workers", "2", "--reps", "1")
    assert proc.returncode == 0 and "EPISODES 6 WORKERS 2" in proc.stdout


def test_episode_driver_host_bound_engine_by_hand():
    """--host-bound's stand-in: at most `batch` turns run, each step one token for each and seq_s of Python for
    each; a waiting turn starts when one ends. Three turns of 3 tokens, batch 2: two end at step 3, the third
    starts at step 4 and ends at step 6; single-turn generation of 3 requests of 3 tokens takes the same 6 steps."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from episode_driver import HostBoundEngine

    engine = HostBoundEngine(seq_s=0.001, batch=2, turn_tokens=3)
    for key in "abc":
        engine.add_turn(key, [1, 2], 5, 1.0, 1.0, 0)  # (max_tokens 5 > turn_tokens: 3 tokens)
    ends, start = {}, time.perf_counter()
    for step in range(1, 7):
        ends.update({key: (step, len(s.response_ids)) for key, s in engine.finished_turns()})
    seconds = time.perf_counter() - start
    assert ends == {"a": (3, 3), "b": (3, 3), "c": (6, 3)} and engine.steps == 6 and not engine.running
    assert seconds >= (3 * 2 + 3 * 1) * 0.001  # steps 1-3 two turns, 4-6 one: a millisecond of Python each
    single = HostBoundEngine(seq_s=0.001, batch=2, turn_tokens=3)
    assert single.generate_all(3, 3) >= 0.009 and single.steps == 6


def test_episode_driver_bench_host_bound():
    """--host-bound: the rollout's ratio is single-turn seconds over the episodes', both on the stand-in."""
    code = "import runpy, sys\nsys.argv = ['bench/episode_driver.py'] + sys.argv[1:]\n"
    code += "runpy.run_path('bench/episode_driver.py', run_name='__main__')\n"
    args = "--host-bound --batch 2 --seq-us 200 --episodes 3 --turns 2 --turn-tokens 4 --tool-ms 5 --reps 1".split()
    proc = run_code(code, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = bench_json(proc.stdout)["per_episodes"]["3"]
    assert r["over_single"] == pytest.approx(r["single_seconds"] / r["seconds"])
    assert r["single_seconds"] >= (8 * 2 + 8 * 1) * 200e-6  # 3 requests of 8 tokens, 2 at a time: 8 steps of 2, 8 of 1
    assert r["engine_steps"] >= 2 * 4 * 2  # two turns of 4 tokens, the third episode's after the first two's
    assert "host-bound, batch 2" in proc.stdout


def test_every_bench_shape_is_read_by_the_bridge_and_by_transformers(tmp_path):
    """bench/harness.py's shapes (config.json dicts written as they are): the bridge builds each and
    transformers reads each as its architecture's config (the engines start from the same file)."""
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import SHAPES, write_config_dir

    from common.model.bridge import parse_hf_config

    for name, fields in SHAPES.items():
        spec = parse_hf_config(fields)
        config = transformers.AutoConfig.from_pretrained(write_config_dir(str(tmp_path / name), name))
        assert spec.architecture == fields["architectures"][0] and config.hidden_size == spec.hidden_size, name
        assert spec.num_layers == fields["num_hidden_layers"], name


def test_e2e_with_off_policy_steps(tmp_path):
    """bench/e2e.py with --off-policy-steps 1 after `--`: groups draw their lengths when they start and a step
    trains groups started earlier, so the per-step exactness is not claimed (lengths_exact None); every trained
    group's responses have exactly the lengths one of the run's group draws gave, and the token counts are the
    saved samples'."""
    from common.rollout.lengths import draw_lengths

    spec = "uniform:min=2,max=9"
    out, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [os.path.join("bench", "e2e.py"), "--response-lengths", spec, "--prompt-len", 8]
    cmd += ["--warmup", 0, "--steps", 3, "--out", out, "--", "--prompts-per-step", 4, "--samples-per-prompt", 2]
    cmd += ["--mini-batch-size", 8, "--off-policy-steps", 1, "--partial-chunk-tokens", 3, "--save-rollouts", saved]
    proc = run_script(*cmd, timeout=300)
    r = bench_json(proc.stdout)
    assert r["lengths_exact"] is None and "NOT EXACT" not in proc.stdout
    draws = {tuple(draw_lengths(spec, 1, 2, seed=1234, step=g, round_=-1)[0]) for g in range(40)}
    for step in range(3):
        samples = torch.load(saved / f"step_{step:06d}.pt", weights_only=False)["samples"]
        groups = [tuple(len(s.response_ids) for s in samples[i : i + 2]) for i in range(0, 8, 2)]
        assert all(g in draws for g in groups), groups
        assert r["response_tokens_per_step"][step] == sum(map(sum, groups))


def test_lora_sync_writes_the_adapters_as_peft_does_and_needs_a_gpu(tmp_path):
    """bench/lora_sync.py (GPU only): the adapters it hands vLLM are PEFT's layout, as merge_to_hf.py --lora peft
    writes it (tests/test_lora.py): an A (r, in) and a B (out, r) of q, k, v, o, gate, up and down of every layer
    of the shape; on a CPU it exits with one line saying what it needs."""
    import transformers
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lora_sync
    from harness import write_config_dir

    config = transformers.AutoConfig.from_pretrained(write_config_dir(tmp_path / "tiny", "tiny"))
    shapes = {n: t.shape for n, t in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
    targets = lora_sync.adapter_targets(shapes)
    assert len(targets) == 2 * 7  # 2 layers
    factors = {name: (torch.randn(4, i), torch.randn(o, 4)) for name, (o, i) in targets.items()}
    os.makedirs(tmp_path / "peft")
    lora_sync.write_peft_files(tmp_path / "peft", factors, 4, 8.0, "base")
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(saved) == 2 * len(targets)
    for name, (a, b) in factors.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        assert torch.equal(saved[f"{prefix}.lora_A.weight"], a) and torch.equal(saved[f"{prefix}.lora_B.weight"], b)
    peft = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (peft["peft_type"], peft["r"], peft["lora_alpha"], peft["base_model_name_or_path"]) == (
        "LORA",
        4,
        8.0,
        "base",
    )
    assert peft["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    proc = run_script(os.path.join("bench", "lora_sync.py"), "--shape", "qwen2-0.5b", check=False, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "bench/lora_sync.py: needs a GPU and vLLM (it measures vLLM's two ways of taking LoRA weights)"
    ], proc.stderr[-2000:]
