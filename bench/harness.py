"""What the benchmark scripts share: model shapes, a model dir all ranks see, timing over ranks,
and the statistics of a comparison (paired rounds, the median of the per-pair ratios).

Shapes: config.json dicts of the published Qwen2 models, written from the configs of Qwen/Qwen2-0.5B,
Qwen2-1.5B and Qwen2-7B on the HF hub (not downloaded; only the shapes matter, the weights are random).
NB: Qwen2-7B's vocabulary is 152064, not the 151936 of the two small ones. "tiny" is a 2-layer
model of the same layout for CPU smoke runs and the tests.
"""

import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def qwen2_config(hidden, ffn, layers, heads, kv_heads, vocab, tied, max_pos=131072):
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_pos,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


SHAPES = {
    "tiny": qwen2_config(hidden=64, ffn=192, layers=2, heads=4, kv_heads=2, vocab=512, tied=True, max_pos=4096),
    "qwen2-0.5b": qwen2_config(hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True),
    "qwen2-1.5b": qwen2_config(hidden=1536, ffn=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tied=True),
    "qwen2-7b": qwen2_config(hidden=3584, ffn=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tied=False),
}
# Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA without q LoRA, 64 sigmoid-routed experts of
# which 6 active, 2 shared, layer 0 dense), from its published config.json; "-6l": its first 6
# layers, what one GPU holds with the optimizer state (bench/train.py).
SHAPES["moonlight-16b-a3b"] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
SHAPES["moonlight-16b-a3b-6l"] = dict(SHAPES["moonlight-16b-a3b"], num_hidden_layers=6)
# Qwen3-30B-A3B's published config.json, its first 6 of 48 layers (bench/train.py on one GPU)
SHAPES["qwen3-30b-a3b-6l"] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# the whole model (bench/sync.py at EP=2), and as many layers as train on two H200s at EP=2
SHAPES["qwen3-30b-a3b"] = dict(SHAPES["qwen3-30b-a3b-6l"], num_hidden_layers=48)
SHAPES["qwen3-30b-a3b-16l"] = dict(SHAPES["qwen3-30b-a3b-6l"], num_hidden_layers=16)
SHAPES["moonlight-16b-a3b-16l"] = dict(SHAPES["moonlight-16b-a3b"], num_hidden_layers=16)
# a CPU-sized Qwen3-MoE (smoke runs of the MoE paths: --ep 2 on gloo)
SHAPES["tiny-moe"] = dict(
    SHAPES["qwen3-30b-a3b-6l"],
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    torch_dtype="float32",
)

# the Qwen3-30B-A3B layout (48 layers, 128 experts, top-8, q/k norms) at CPU widths: a step
# dispatches as many ops as the real model's (--count-ops; --num-layers as on the GPU)
SHAPES["qwen3-30b-a3b-narrow"] = dict(
    SHAPES["qwen3-30b-a3b"],
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    torch_dtype="float32",
)

# Qwen3.5-35B-A3B's text model (gated delta nets in 3 of 4 layers, 256 experts, top-8, a gated shared
# expert), its first 4 of 40 layers: bench/train.py on one GPU (the recurrence is torch code here)
SHAPES["qwen3.5-35b-a3b-4l"] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "hidden_act": "silu",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# the same widths and experts with every layer full attention: what the delta nets cost against attention
SHAPES["qwen3.5-35b-a3b-4l-attn"] = dict(SHAPES["qwen3.5-35b-a3b-4l"], layer_types=["full_attention"] * 4)
# Qwen3.5-27B's text model (dense: 64 layers, gated delta nets in 3 of 4, a full-attention layer with an
# output gate after them), its first 4 layers: one GPU with the optimizer state; "-attn": all 4 full attention
SHAPES["qwen3.5-27b-4l"] = {
    **{k: v for k, v in SHAPES["qwen3.5-35b-a3b-4l"].items() if "expert" not in k and "moe" not in k},
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "linear_num_value_heads": 48,
}
SHAPES["qwen3.5-27b-4l-attn"] = dict(SHAPES["qwen3.5-27b-4l"], layer_types=["full_attention"] * 4)
# gpt-oss-20b (attention sinks, windows of 128 keys on alternate layers, 32 biased experts, top-4; bf16
# experts as merge_to_hf.py writes them), its first 4 of 24 layers
SHAPES["gpt-oss-20b-4l"] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_act": "silu",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_config_dir(out_dir, shape):
    """A model dir with only config.json: enough for build_model (random init) and for vLLM
    with load_format="dummy" + skip_tokenizer_init (weights come from the first sync)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f, indent=1)
    return out_dir


def shared_config_dir(shape, prefix, master, with_weights=False):
    """A config.json-only model dir of `shape` made by the master rank, its path broadcast to
    every rank (all ranks call this; one host: a temporary directory). with_weights: also
    random HF weights (transformers' init), for an engine that loads them at start."""
    holder = [tempfile.mkdtemp(prefix=prefix) if master else None]
    dist.broadcast_object_list(holder)
    if master:
        write_config_dir(holder[0], shape)
        if with_weights:
            import transformers

            config = transformers.AutoConfig.from_pretrained(holder[0])
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(holder[0])
    dist.barrier()
    return holder[0]


def max_over_ranks(value, device):
    """The largest of every rank's value (all ranks call this; a world of one returns it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, device):
    """Seconds of fn(), the slowest rank's, with the device synchronised around it (all ranks
    call this)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return max_over_ranks(time.perf_counter() - t0, device)


# ---------------------------------------------------------------------------------------
# Comparing two things: interleaved pairs, the median of the per-pair ratios.
# Reporting the best round of each side separately let one lucky round decide: on one H200,
# plain vLLM 28.3k, 29.2k, 42.3k, 29.1k tokens/s against ours 23.2k, 31.9k, 28.7k, 32.0k gave
# a best-of ratio of 0.756x although ours was faster in two of the four rounds.


def run_pairs(run_a, run_b, reps, warmup=1):
    """Run A and B in interleaved pairs, the order alternating: (A, B), (B, A), (A, B), ...,
    so that neither side always runs first (right after the other, or with the clocks still
    low); the first `warmup` pairs are not kept. run_a / run_b are called with the pair's
    index (0, 1, ..., warm-up pairs included; e.g. the seed both sides of a pair share) and
    return what they measured (seconds, or a dict). Returns (a_results, b_results) of the
    `reps` kept pairs, in order. All ranks call this if run_a / run_b use collectives."""
    a_results, b_results = [], []
    for pair in range(warmup + reps):
        if pair % 2 == 0:
            a, b = run_a(pair), run_b(pair)
        else:
            b, a = run_b(pair), run_a(pair)
        if pair >= warmup:
            a_results.append(a)
            b_results.append(b)
    return a_results, b_results


def paired_ratios(a, b):
    """a[i] / b[i] for every pair i of two sides measured in the same pairs (run_pairs), with
    their median, min and max, and each side's own median. For seconds, a / b is B's speed-up
    over A; for tokens/s it is A's speed relative to B. The median of the ratios is not the
    ratio of the medians: a pair where both sides ran slow (a busy host) cancels out.
    Returns dict(median, min, max, ratios, a_median, b_median)."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    ratios = [x / y for x, y in zip(a, b)]
    return dict(
        median=statistics.median(ratios),
        min=min(ratios),
        max=max(ratios),
        ratios=ratios,
        a_median=statistics.median(a),
        b_median=statistics.median(b),
    )


# ---------------------------------------------------------------------------------------
# Where the device time goes: one call of fn under torch.profiler, kernels by category

# first match wins, on the lower-cased kernel name: flash kernels also carry "sm90" in their
# names, so attention comes before matmul; inductor's fused kernels are named triton_*
KERNEL_CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("communication", ("nccl",)),
    ("fused (triton)", ("triton",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
    ("norm", ("norm",)),
    ("reduction", ("reduce",)),
    ("copy / fill", ("memcpy", "memset", "copy", "fill", "cat", "index", "gather", "scatter")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def kernel_category(name):
    lower = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in lower for k in keys):
            return category
    return "other"


def summarize_kernels(kernels, wall_us, top=25):
    """kernels: (name, start_us, duration_us) of every device kernel in a window of wall_us.
    Returns dict(wall_ms, busy_ms (union of kernel intervals: time the device was doing
    anything), idle_frac, categories {name: ms}, top [(ms, count, name)])."""
    by_category, by_name, intervals = {}, {}, []
    for name, start, duration in kernels:
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + duration / 1e3
        total, count = by_name.get(name, (0.0, 0))
        by_name[name] = (total + duration / 1e3, count + 1)
        intervals.append((start, start + duration))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):  # union of [start, end) intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    ranked = sorted(((ms, count, name) for name, (ms, count) in by_name.items()), reverse=True)[:top]
    return dict(
        wall_ms=wall_us / 1e3,
        busy_ms=busy / 1e3,
        idle_frac=1 - busy / wall_us if wall_us else None,
        categories=dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        top=ranked,
    )


def profile_kernels(fn, device, trace=None):
    """Run fn() once under torch.profiler; summarize_kernels of the device kernels it ran (on a
    CPU, of the CPU ops instead: the same bookkeeping, for the tests). trace: a .json.gz path
    to write every kernel to, {"wall_us", "kernels": [[name, start_us, duration_us], ...],
    "host_top": [[op, calls, self_cpu_us, cpu_us], ...] (the 80 ops of most self CPU time)}
    (starts from this process's profiler clock: to line ranks up, match their collectives)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    # record_function ranges (e.g. "Optimizer.step#AdamW.step") also appear on the device
    # timeline: they span kernels, they are not kernels
    kernels = [
        (e.name, e.time_range.start, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == kind and not getattr(e, "is_user_annotation", False)
    ]
    summary = summarize_kernels(kernels, wall_us)
    # host side: the ops that cost the CPU most of its own time (launch overhead shows up here)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    if trace:
        import gzip

        host = [(e.key, e.count, e.self_cpu_time_total, e.cpu_time_total) for e in ops[:80]]
        with gzip.open(trace, "wt") as f:
            json.dump({"wall_us": wall_us, "kernels": kernels, "host_top": host}, f)
    summary["host_top"] = [(e.self_cpu_time_total / 1e3, e.count, e.key) for e in ops[:20]]
    summary["host_ms"] = sum(e.self_cpu_time_total for e in ops) / 1e3
    # which op (and input shapes) launched the device time: tells a transpose copy of the
    # logits from a weight-gradient accumulation, which the kernel names do not
    self_time = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    shaped = sorted(
        (
            e
            for e in prof.key_averages(group_by_input_shape=True)  # host ops, not the kernels
            if e.self_cpu_time_total > 0 and self_time(e) > 0
        ),
        key=self_time,
        reverse=True,
    )
    summary["op_shapes_top"] = [(self_time(e) / 1e3, e.count, e.key, str(e.input_shapes)[:120]) for e in shaped[:20]]
    return summary


def host_syncs(fn):
    """Run fn() once with torch.cuda.set_sync_debug_mode("warn"): every operation that makes the
    CPU wait for the GPU (a .item(), a copy to pageable host memory, a mask index needing
    nonzero, ...) warns from its Python line. Returns [(count, "file:line")], most frequent first.
    Each such wait drains the GPU's queue, which then idles while the CPU launches again."""
    import collections
    import warnings

    counts = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    return [(n, where) for where, n in counts.most_common()]


def count_ops(fn):
    """Run fn() once counting the tensor operations it dispatches (aten ops and collectives; not
    views, allocations or CPU scalars): on a GPU nearly every one is a kernel launch, so a CPU
    run counts the launches the same step makes on a GPU, whose host they bind, and names the
    code that makes them. Each op is counted under its pass, "forward" (recorded by autograd),
    "no_grad" (not recorded: the logprob pass, the optimizer, a custom autograd Function's
    forward) or "backward", and under the innermost frame of the project (common/, the scripts,
    the tests) or of megatron-core that made it; a backward op under the frame that made its
    autograd node in the forward (autograd's anomaly mode records it), else under the node's
    name. A function that common/rl/fused.py compiles on a GPU (eager on a CPU) and torch's
    RMSNorm (a fused CUDA kernel, decomposed on a CPU) count as one op per call, plus one
    backward op per call recorded by autograd (inductor's fused kernels; a few more where it
    cannot fuse, e.g. a sort). Returns dict(total, by_pass, sites=[[count, pass, site], ...]
    most first, ops=[[count, op], ...] all ops outside those functions, most first)."""
    import collections
    import re
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    from common.rl import fused

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    skip = (os.path.abspath(__file__), os.path.join(root, "common", "model", "cpu_compat.py"))
    # the functions that are one kernel each way on a GPU: (file, name) of their code -> label
    one_kernel = {
        (f.__code__.co_filename, f.__code__.co_name): f"compiled: {f.__module__}.{f.__name__}"
        for f in fused.COMPILED_ON_GPU
    }
    norm = torch.nn.functional.rms_norm  # torch's RMSNorm: aten::_fused_rms_norm on CUDA, decomposed on a CPU
    one_kernel[norm.__code__.co_filename, norm.__code__.co_name] = "fused on a GPU: torch.nn.functional.rms_norm"

    def label(filename, function):
        if "megatron" + os.sep in filename:
            return "megatron" + os.sep + filename.split("megatron" + os.sep, 1)[1] + ":" + function
        if filename.startswith(root) and filename not in skip and os.sep + "site-packages" + os.sep not in filename:
            return os.path.relpath(filename, root) + ":" + function
        return None

    def live_site():  # (site, the frame of the one-kernel function the op is in, or None)
        frame, site = sys._getframe(2), None
        while frame is not None:
            key = (frame.f_code.co_filename, frame.f_code.co_name)
            if key in one_kernel:
                return one_kernel[key], frame
            site = site or label(*key)
            frame = frame.f_back
        return site or "?", None

    def backward_site(node):  # the forward frames anomaly mode recorded for the node, innermost last
        frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', "".join(node.metadata.get("traceback_", [])))
        if any(key in one_kernel for key in frames):
            return None  # counted with its one-kernel forward
        return next(filter(None, (label(*key) for key in reversed(frames))), type(node).__name__)

    by_site, by_op, last_call = collections.Counter(), collections.Counter(), [None]
    aten = torch.ops.aten  # ops that launch nothing on a GPU: allocations, views without the view tag, CPU scalars
    no_kernel = {
        aten.detach,
        aten.alias,
        aten._unsafe_view,
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.new_empty,
        aten.new_empty_strided,
        aten.scalar_tensor,
    }

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket not in no_kernel:
                node = torch._C._current_autograd_node()
                where = "backward" if node is not None else "forward" if torch.is_grad_enabled() else "no_grad"
                site, call = live_site()
                if call is not None:  # in a one-kernel function (e.g. one a custom backward calls): one per call
                    if call is not last_call[0]:
                        by_site[where, site] += 1
                        if where == "forward":  # and its backward
                            by_site["backward", site] += 1
                else:
                    if node is not None:  # a backward op: under the code that made its node
                        site = backward_site(node)
                    if site:
                        by_site[where, site] += 1
                        by_op[str(func.overloadpacket)] += 1
                last_call[0] = call  # held: a new call is a new frame object
            return func(*args, **(kwargs or {}))

    with torch.autograd.detect_anomaly(check_nan=False), Counter():
        fn()
    last_call[0] = None
    by_pass = collections.Counter()
    for (where, _), n in by_site.items():
        by_pass[where] += n
    return dict(
        total=sum(by_pass.values()),
        by_pass=dict(by_pass),
        sites=[[n, where, name] for (where, name), n in by_site.most_common()],
        ops=[[n, op] for op, n in by_op.most_common()],
    )


def format_op_counts(counts, top=40):
    """Lines of text for count_ops' result: the `top` sites."""
    lines = [
        f"tensor ops dispatched in one step: {counts['total']} ("
        + ", ".join(f"{where} {n}" for where, n in counts["by_pass"].items())
        + "); by site:"
    ]
    lines += [f"  {n:7d}  {where:8s} {name}" for n, where, name in counts["sites"][:top]]
    lines.append("  by op: " + ", ".join(f"{op} {n}" for n, op in counts["ops"][:12]))
    return lines


def format_kernel_summary(summary):
    """Lines of text: the busy/idle split, ms per category, the top kernels."""
    lines = [
        f"profile of one step: wall {summary['wall_ms']:.1f} ms, device busy {summary['busy_ms']:.1f} ms "
        f"(idle {100 * summary['idle_frac']:.1f}%)"
    ]
    total = sum(summary["categories"].values()) or 1.0
    lines += [f"  {name:16s} {ms:9.1f} ms  {100 * ms / total:5.1f}%" for name, ms in summary["categories"].items()]
    lines.append("  top kernels:")
    lines += [f"  {ms:9.1f} ms x{count:<5d} {name[:110]}" for ms, count, name in summary["top"]]
    if "host_top" in summary:
        lines.append(f"  host: {summary['host_ms']:.1f} ms of op self time on the CPU; top ops:")
        lines += [f"  {ms:9.1f} ms x{count:<5d} {name[:110]}" for ms, count, name in summary["host_top"]]
    if summary.get("op_shapes_top"):
        lines.append("  ops by their own device time, with input shapes:")
        lines += [
            f"  {ms:9.1f} ms x{count:<5d} {name} {shapes}" for ms, count, name, shapes in summary["op_shapes_top"]
        ]
    if summary.get("syncs") is not None:
        lines.append(
            f"  host waits for the device (torch.cuda.set_sync_debug_mode): {sum(n for n, _ in summary['syncs'])}"
        )
        lines += [f"  {n:6d} x {where}" for n, where in summary["syncs"][:15]]
    return lines
