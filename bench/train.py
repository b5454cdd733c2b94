"""Benchmark one GRPO training step: tokens/s, seconds per step, peak GPU memory and MFU.

    python bench/train.py --shape qwen2-1.5b                                    # 1 GPU, Qwen2-1.5B
    torchrun --nproc_per_node 2 bench/train.py --shape qwen2-7b --tp 2          # nvidia-h200-x2, Qwen2-7B
    torchrun --nproc_per_node 4 bench/train.py --shape qwen2-7b --tp 4          # nvidia-h200-x4 (or --tp 2: DP=2)
    torchrun --nproc_per_node 2 bench/train.py --shape qwen2-7b --cp 2 --seq-len 32768 --num-seqs 1 --no-baseline
    torchrun --nproc_per_node 2 bench/train.py --shape qwen3-30b-a3b-6l --ep 2 --no-baseline   # MoE at EP=2
    python bench/train.py --shape qwen3.5-35b-a3b-4l --no-baseline   # gated delta nets (-attn: all attention)
    python bench/train.py --shape tiny --steps 2 --warmup 1                     # CPU smoke run (fp32)
    torchrun --nproc_per_node 2 bench/train.py --shape tiny --tp 2 --steps 1 --warmup 1   # CPU, gloo

What is timed: the part of train_grpo.py's step that runs on the trainer for one batch of
--num-seqs sequences (global) of --seq-len tokens each, i.e.
  1. old logprobs: a forward-only pass over every micro-batch (vocab_parallel_logprobs,
     copied to the host and summed over DP ranks, as train_grpo.py does);
  2. forward/backward of the PPO loss over the same micro-batches (vocab_parallel_logprobs
     with entropy -> policy_loss -> aggregate_loss "token_mean"), megatron DDP;
  3. optimizer.step() (megatron Adam, fp32 main params, grad clipping) + scheduler step.
Not timed: rollout, reward, weight sync, and the reference-model pass of --kl-coef > 0 (one
more forward: add 1x forward FLOPs and its time if you run one). Random weights
(build_model(init_weights=True)) and random token ids: the speed depends only on the shapes.
Every row is a full --seq-len sequence (no padding, no sequence packing); the response mask
covers the second half of each row, as a prompt of seq_len/2 tokens would.

Two configurations run in the same process, one after the other, each for --warmup + --steps
steps: the candidate (--attention, --recompute, ...) and a baseline, megatron-core's local spec
as it comes (attention="local", no activation recompute), with the same batch geometry. The
candidate/baseline ratios of tokens/s and peak memory are printed. A configuration that runs
out of GPU memory is reported as OOM and the run goes on.
Not in interleaved pairs (bench/moe.py and bench/packing.py pair theirs): each configuration is a
model build with its own optimizer state and peak memory (Qwen2-7B, TP=2, micro-batch 1, H200s: 80
GiB the candidate, 118 GiB the baseline per GPU), which do not fit on the GPUs together at the
shapes this bench is for, and a rebuild per pair would add a build and a warm-up to every pair. So
the two run sequentially; each reports the median of its per-step times with min and max beside the
mean (one slow step shows as a max far from the median), and the ratios compare the two
configurations' means (tokens/s) and medians (s/step), measured minutes apart in one process.

The numbers:
  tokens/s      num_seqs * seq_len * steps / wall seconds of the timed steps (all GPUs together)
  s/step        mean seconds per step (median, min and max printed and in the JSON line)
  peak GiB      torch.cuda.max_memory_allocated over warmup + timed steps, the largest rank
  MFU           model FLOPs per step / s per step / (num GPUs * peak dense bf16 FLOP/s)
Model FLOPs (standard dense-transformer count; recompute is NOT counted, so this is MFU, not
hardware FLOPs utilisation): forward per token = 2 * (matmul weights of every layer + the LM
head) + attention score and value matmuls 2 * 2 * layers * seq_len * (heads * head_dim) * c,
with c = 1/2 (causal: only the lower triangle is useful work, as Megatron-LM's current
training.py num_floating_point_operations and NeMo count) for the headline MFU, and c = 1 (the
full T x T, as PaLM's appendix B and older Megatron-LM releases count) for "MFU full attn".
A step counts 4x forward FLOPs per token: 1x the logprob pass, 3x the forward/backward.
The LM head uses the HF vocabulary (Megatron-LM uses the padded one: equal at TP=1 and for 7B at
TP<=4; 151936 vs 152064 for 0.5B/1.5B at TP=2). Embedding lookups, norms, biases, rotary and the
softmax are not counted.
Peak FLOP/s: --peak-tflops, default from the device name (H100/H200 SXM: 989 dense bf16).
Target: MFU >= 0.45 for 1.5B on 1 GPU and 7B on 2-4 GPUs at 2k-4k tokens.

--kernels eager runs the candidate without common/rl/fused.py's compiled kernels (the baseline
never uses them); --kernels no-rope compiles the logprob kernels but leaves SDPAttention's RoPE
eager (the RoPE fusion's own gain). --profile adds, for the candidate: device time per kernel
category and the top kernels of one profiled step, the device's idle share, the host's top ops,
the host ops that launched the most device time (with input shapes), the source lines where
the host waited for the device (torch.cuda.set_sync_debug_mode), and the logprob kernels timed
alone. --count-ops (a CPU run) counts the tensor ops one more step dispatches, by pass and by the
code that dispatched them: the kernel launches of the same step on a GPU, whose host they bind
(e.g. `torchrun --nproc_per_node 2 bench/train.py --shape qwen3-30b-a3b-narrow --num-layers 14
--ep 2 --moe-dispatcher allgather --seq-len 256 --micro-batch-size 2 --count-ops --no-baseline
--warmup 1 --steps 1`: the 30B's layout at CPU widths; a layer's share is the difference of two
--num-layers).
Qwen3.5 shapes: the baseline's gated delta nets run the pure-torch recurrence, the candidate's
--gdn-kernel; `--attention local --gdn-kernel fla` isolates the fused recurrence's gain (both sides
local attention).

Output: a table on rank 0, then one line `BENCH_JSON {...}` with every number and setting.
"""

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from features import FEATURES, ab_switches  # noqa: E402
from harness import SHAPES, format_kernel_summary, format_op_counts, max_over_ranks, timed  # noqa: E402  (Qwen2 0.5B/1.5B/7B config.json dicts, and "tiny")

from common.model.flops import forward_flops_per_token  # noqa: E402  (one FLOP convention with the scripts' metrics)
from common.model.flops import peak_tflops as default_peak_tflops  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --- model (random weights: the shape is all that matters)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen2-1.5b", help="built-in config.json of the model to time"
    )
    p.add_argument("--config", default=None, help="an HF config.json to take the shape from instead of --shape")
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="keep only the first N decoder layers of the shape (e.g. an MoE shape that must fit one H100)",
    )
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="model dtype (default: bf16 on GPU, fp32 on CPU)"
    )
    # --- candidate configuration (the baseline is always attention=local, no recompute)
    p.add_argument(
        "--attention",
        choices=["sdpa", "local", "te"],
        default="sdpa",
        help="core attention: torch SDPA (flash), megatron's local baddbmm+softmax, or TransformerEngine",
    )
    p.add_argument(
        "--gdn-kernel",
        choices=["torch", "fla"],
        default="torch",
        help="Qwen3.5 shapes: the gated delta nets' recurrence (common/model/gdn.py): the pure-torch one or fla's "
        "fused kernels (where fla trains); the baseline always runs torch",
    )
    p.add_argument(
        "--kernels",
        choices=["compiled", "eager", "no-rope"],
        default="compiled",
        help="common/rl/fused.py's kernels (vocabulary logprobs, SDPAttention's RoPE): torch.compile'd, as "
        "training runs them on a GPU, or eager, or no-rope: all compiled but the RoPE (the baseline "
        "always runs eager; on a CPU all are eager)",
    )
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="activation recompute: megatron's recompute_granularity (selective: --recompute-modules; "
        "full: whole layers, uniform method)",
    )
    p.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=["core_attn", "mlp", "layernorm"],
        default=["core_attn"],
        help="with --recompute selective: megatron's recompute_modules (layernorm needs TransformerEngine)",
    )
    p.add_argument(
        "--recompute-num-layers",
        type=int,
        default=1,
        help="with --recompute full: layers per recomputed chunk (uniform), or layers recomputed (block)",
    )
    p.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default="uniform",
        help="with --recompute full: megatron's recompute_method: uniform = every layer, in chunks of "
        "--recompute-num-layers; block = only the first --recompute-num-layers layers of each "
        "pipeline stage (the others keep their activations: less compute, more memory)",
    )
    # --- batch geometry
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; 128 for --shape tiny)")
    p.add_argument(
        "--num-seqs", type=int, default=None, help="sequences per step, all ranks together (default 8; 4 for tiny)"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=None, help="sequences per forward pass per rank (default 1; 2 for tiny)"
    )
    p.add_argument(
        "--logprob-micro-batch-size",
        type=int,
        default=None,
        help="sequences per pass of the old-logprob (forward-only) pass per rank, as the scripts' flag "
        "(default: --micro-batch-size)",
    )
    # --- parallelism (data parallelism is what is left: world / (tp * pp))
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="Megatron pipeline parallel size")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context parallel size: every sequence cut over N ranks (common/model/attention.py); no baseline "
        "then, megatron's local attention has no context parallelism",
    )
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE shapes)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE shapes)")
    p.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard optimizer state over data-parallel ranks (as train_grpo.py does by default)",
    )
    p.add_argument("--overlap-grad-reduce", action="store_true", help="overlap the DP gradient reduce with backward")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="the candidate trains LoRA adapters of this rank on attention and MLP (alpha 2 r), the base frozen, "
        "as the scripts' --lora-rank (0: full fine-tuning); the baseline stays full fine-tuning",
    )
    p.add_argument(
        "--wgrad-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="weight gradients accumulated into the fp32 buffer inside the GEMM (as the scripts do; "
        "--no-wgrad-fusion: megatron's separate bf16 gradient + add, and MoE experts' gradients "
        "one by one, to measure the difference)",
    )
    p.add_argument(
        "--device-sort",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE at EP=1: tokens sorted by expert on the device, as the scripts do (common/model/moe.py; "
        "--no-device-sort: megatron's all-gather dispatcher, which waits for the device)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the candidate's decoder layers captured as CUDA graphs by megatron-core's own local "
        "implementation (TransformerConfig cuda_graph_impl='local'; no TransformerEngine): one graph "
        "launch per layer and pass instead of its kernel launches, for a step the host cannot "
        "launch fast enough. Graphs are recorded in the first warm-up step and need the same shapes "
        "every step (this bench's full rows); a GPU, and not with --ab, --pp > 1 or --recompute",
    )
    p.add_argument(
        "--moe-dispatcher",
        choices=["alltoall", "allgather"],
        default=None,
        help="MoE token dispatcher at --ep > 1 (default alltoall, as the scripts; allgather: common/model/moe.py "
        "DeviceSortDispatcher over the EP group, which needs equal token counts on every EP rank: this "
        "bench's fixed-length batches have them, the training scripts' micro-batches do not)",
    )
    # --- measurement
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (with --ab: also its pairs)")
    p.add_argument(
        "--ab",
        choices=list(FEATURES),
        default=None,
        help="after the timed steps, time the candidate with this feature off and on in alternate steps "
        "(--steps pairs after one warm-up pair, order alternating) and print the median of the "
        "per-pair ratios off / on: in-process, so a machine that drifts affects both sides alike ("
        + "; ".join(f"{name}: {text}" for name, text in FEATURES.items())
        + ")",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (allocator, optimizer state)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense TFLOP/s of one device for MFU (default: from the GPU name, H100/H200 989; "
        "required on other GPUs; on a CPU MFU is null unless given)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline (e.g. when it would not fit)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the candidate's timed steps, profile one more step (torch.profiler, rank 0) and print "
        "device time per kernel category and the top kernels, plus the logprob kernels timed alone",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="with --profile: every rank writes the profiled step's device kernels (name, start, duration) "
        "and its top host ops to DIR/kernels_rank<r>.json.gz, e.g. to see which EP rank arrives late "
        "at each collective and why",
    )
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="(CPU runs) after the candidate's timed steps, count the tensor ops one more step dispatches "
        "(rank 0), by pass and by the code that dispatched them: the kernel launches a GPU would make "
        "(harness.count_ops)",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and data")
    return p


def recompute_overrides(recompute, modules, num_layers):
    """--recompute -> megatron TransformerConfig fields (common/model/bridge.py:recompute_config)."""
    from common.model.bridge import recompute_config

    if recompute == "selective" and "layernorm" in modules:  # with TE only (recompute_config's modules have none)
        if importlib.util.find_spec("transformer_engine") is None:
            raise SystemExit("--recompute-modules layernorm needs TransformerEngine in megatron-core 0.16.1")
        return dict(recompute_granularity="selective", recompute_modules=list(modules))
    return recompute_config(recompute, modules, num_layers)


def make_batch(spec, num_seqs, seq_len, seed):
    """num_seqs rows of random tokens laid out exactly as train_grpo.py packs rollouts:
    a prompt of seq_len/2 tokens, a response of seq_len/2 tokens, no padding.
    Returns the dict of (N, T) tensors on the host, with one GRPO advantage per row."""
    from common.rl import batch as B

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (num_seqs, seq_len), generator=g)
    prompt = seq_len // 2
    samples = [
        SimpleNamespace(
            prompt_ids=row[:prompt].tolist(),
            response_ids=row[prompt:].tolist(),
            response_logprobs=[0.0] * (seq_len - prompt),
        )
        for row in ids
    ]
    batch = B.pack_sequences(samples, pad_id=0, length=seq_len)
    batch["advantages"] = torch.randn(num_seqs, generator=g)[:, None] * batch["mask"]  # (N, T)
    batch["row"] = torch.arange(num_seqs)
    return batch


def sdpa_takes_flash(spec, tp, seq_len, micro_batch_size, dtype):
    """Whether torch's flash-attention kernel accepts the call --attention sdpa makes on this rank
    (causal, GQA without repeated k/v, this shape and dtype; GPU only). torch does not report
    which kernel SDPA dispatched to: True says flash can run this call and is enabled, and
    torch picks it when it can unless its priority list (version-dependent) puts another first.
    To be sure, profile one step (torch.profiler: look for flash kernels)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, groups = spec.num_heads // tp, spec.num_kv_heads // tp
    q = torch.zeros(micro_batch_size, heads, seq_len, spec.head_dim, dtype=dtype, device="cuda")
    kv = torch.zeros(micro_batch_size, groups, seq_len, spec.head_dim, dtype=dtype, device="cuda")
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=heads != groups)
        return True
    except RuntimeError:  # "No available kernel"
        return False


def run_config(
    spec,
    info,
    batch,
    *,
    attention,
    overrides,
    dtype,
    tp,
    pp,
    sp,
    cp,
    ep,
    etp,
    micro_batch_size,
    logprob_micro_batch_size,
    steps,
    warmup,
    distributed_optimizer,
    overlap_grad_reduce,
    kernels="eager",
    profile=False,
    trace=None,
    count=False,
    wgrad_fusion=True,
    device_sort=True,
    ab=None,
    lora_rank=0,
):
    """Build the model, run warmup + timed training steps, free everything (lora_rank > 0: the base frozen,
    rank-r adapters on attention and MLP trained, as --lora-rank does in the scripts).

    All ranks call this. Returns dict(step_times, phase_times, peak_bytes, profile) or dict(oom=True):
    per timed step its seconds and [logprob pass, forward/backward, optimizer] seconds, each the
    slowest rank's; profile: harness.profile_kernels of one more step (rank 0's) or None (trace:
    its folder for every rank's kernel list); op_counts: harness.count_ops of one more step (count).
    """
    from harness import count_ops, host_syncs, paired_ratios, profile_kernels, run_pairs
    from megatron.core import parallel_state as mpu

    from common.model.gpt import build_model
    from common.rl import batch as B
    from common.rl import fused
    from common.rl.logprobs import vocab_parallel_logprobs
    from common.rl.losses import aggregate_loss, masked_sum, policy_loss
    from common.train import schedule
    from common.train.setup import setup_training

    fused.COMPILE = kernels != "eager"
    fused.EAGER = {"apply_rope", "apply_rope_qk"} if kernels == "no-rope" else set()
    on_gpu = info.device.type == "cuda"
    graphs = overrides.get("cuda_graph_impl") == "local"
    num_rows, seq_len = batch["tokens"].shape
    per_dp = num_rows // info.dp_size
    my_rows = torch.arange(info.dp_rank * per_dp, (info.dp_rank + 1) * per_dp)  # this DP rank's rows
    num_micro = per_dp // micro_batch_size
    tp_group = mpu.get_tensor_model_parallel_group()
    num_tokens = batch["mask"].sum()  # token_mean normaliser: valid tokens of the whole batch, all DP ranks
    scale = num_micro * info.dp_size  # undo megatron's 1/num_micro and DDP's DP averaging (aggregate_loss)

    # what --ab padding-mask and --ab logprob-micro-batch switch off: megatron told the padding (the
    # passes' `valid`), the old-logprob pass in micro-batches of logprob_micro_batch_size (else the update's)
    passes = {"padding_mask": True, "logprob_micro_batch": True}

    def my_micro_batches(size=micro_batch_size):
        return B.split_micro_batches(
            {k: v[my_rows] for k, v in batch.items() if passes["padding_mask"] or k != "valid"}, size
        )

    def logprob_loss_fn(mb, logits):  # last pipeline stage: logits (mb, T, V/tp)
        logprobs, _ = vocab_parallel_logprobs(logits, mb["targets"], spec.vocab_size, tp_group)
        B.scatter_tokens(old_logprobs, mb, logprobs.float())  # on the device: no sync per micro-batch
        return logprobs.sum() * 0, {}

    def ppo_loss_fn(mb, logits):  # the train_grpo.py loss with --loss-agg token_mean, no KL
        mask = mb["mask"]
        logprobs, entropy = vocab_parallel_logprobs(
            logits, mb["targets"], spec.vocab_size, tp_group, compute_entropy=True
        )
        per_token, clipped = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], clip_low=0.2, clip_high=0.2)
        loss = aggregate_loss(per_token, mask, "token_mean", num_tokens=num_tokens)
        metrics = {
            "policy_loss": loss.detach(),
            "entropy": masked_sum(entropy.detach(), mask),
            "clip_frac": masked_sum(clipped.float(), mask),
        }
        return loss * scale, metrics

    def training_step():
        """One step; returns the seconds of its three phases (the device synchronised after each)."""
        ticks = [time.perf_counter()]
        # 1. old logprobs: forward only; each DP rank fills its rows (each CP rank its columns), the
        #    sum gives all rows everywhere
        old_logprobs.zero_()
        size = logprob_micro_batch_size if passes["logprob_micro_batch"] else micro_batch_size
        # --cuda-graphs: megatron records a layer's graph in training mode and creates the graphs at
        # the end of that schedule call; a forward-only call first would create forward-only graphs the
        # update cannot use. In eval mode a forward-only pass runs eagerly until the update's graphs
        # exist, and then replays their forward.
        for chunk in model if graphs else ():
            chunk.eval()
        with torch.no_grad():
            schedule.run_micro_batches(
                model, my_micro_batches(size), logprob_loss_fn, forward_only=True, device=info.device
            )
        for chunk in model if graphs else ():
            chunk.train()
        batch["old_logprobs"] = schedule.all_reduce_sum(
            old_logprobs[:-1], mpu.get_data_parallel_group(with_context_parallel=True), info.device
        ).cpu()
        _sync(on_gpu)
        ticks.append(time.perf_counter())
        # 2. forward/backward of the PPO loss (DDP reduces the gradients at the end)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule.run_micro_batches(model, my_micro_batches(), ppo_loss_fn, forward_only=False, device=info.device)
        _sync(on_gpu)
        ticks.append(time.perf_counter())
        # 3. optimizer step (grad norm + clipping, Adam, bf16 params from the fp32 main params)
        _, grad_norm, _ = optimizer.step()
        if not check:  # the first step's numbers: equal at any layout of the same batch (e.g. --cp 2 vs dp 2)
            mask = batch["mask"].bool()
            check.update(
                logprob_mean=batch["old_logprobs"][mask].mean().item(), grad_norm=float(grad_norm or 0.0), grad_norms=[]
            )
        # every step's, warm-up and timed: the same batch each step, so two runs of one seed agree step by
        # step (e.g. --cuda-graphs against eager: the graphs replay from the second step on)
        if len(check["grad_norms"]) < warmup + steps:
            check["grad_norms"].append(float(grad_norm or 0.0))
        scheduler.step(1)
        _sync(on_gpu)
        ticks.append(time.perf_counter())
        return [b - a for a, b in zip(ticks, ticks[1:])]

    model = optimizer = scheduler = ab_pairs = None
    old_logprobs = torch.zeros(num_rows + 1, seq_len, device=info.device)  # (N, T) + scatter_tokens' spare row
    batch["old_logprobs"] = torch.zeros(num_rows, seq_len)
    phase_times, oom, kernels, op_counts = (
        [],
        False,
        None,
        None,
    )  # per timed step: [logprob, fwd_bwd, optimizer] seconds
    check = {}  # the first step's mean old logprob over response tokens and gradient norm, every step's norm
    try:
        chunks = build_model(
            spec,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            etp=etp,
            sequence_parallel=sp,
            dtype=dtype,
            init_weights=True,
            attention=attention,
            **overrides,
        )
        if lora_rank:
            from common.model.lora import add_lora

            add_lora(chunks, rank=lora_rank, alpha=2.0 * lora_rank)
        model, optimizer, scheduler = setup_training(
            chunks,
            lr=1e-6,
            clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
            overlap_grad_reduce=overlap_grad_reduce,
            total_steps=steps + warmup,
        )
        features = ab_switches(model, optimizer, passes)
        chosen = {
            "wgrad-fusion": wgrad_fusion,
            "device-sort": device_sort,
            "allgather": overrides.get("moe_token_dispatcher_type") == "allgather",
            "padding-mask": True,
            "logprob-micro-batch": True,
            "qkv-bias-gemm": True,
            "swiglu-kernel": True,
            "cp-split": True,
            "listed-copies": True,
            "compiled-dispatch": True,
            "compiled-router": True,
            "in-place-experts": True,
        }
        for name, on in chosen.items():
            features[name](on)
        del chunks
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()  # from here: weights, grads, optimizer state, activations
        for step in range(warmup + steps):
            _sync(on_gpu)
            phases = training_step()
            if step >= warmup:
                phase_times.append(phases)
        if ab:  # the feature off and on in alternate steps of this process: paired, drift cancels

            def step_with(on):
                def run(_pair):
                    features[ab](on)
                    _sync(on_gpu)
                    return max_over_ranks(sum(training_step()), info.device)

                return run

            ab_pairs = paired_ratios(*run_pairs(step_with(False), step_with(True), reps=steps))  # off / on
            features[ab](chosen[ab])  # back to the configuration asked for (--profile runs next)
        if profile:
            kernels = profile_kernels(
                training_step, info.device, trace=trace and os.path.join(trace, f"kernels_rank{info.rank}.json.gz")
            )
            kernels["syncs"] = host_syncs(training_step) if on_gpu else None
        if count:
            op_counts = count_ops(training_step)
    except torch.OutOfMemoryError:  # the traceback (and its tensors) is dropped at the end of this block
        oom = True
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    if graphs:
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

        delete_cuda_graphs()  # the graphs' memory pool, before a baseline runs
    model = optimizer = scheduler = None
    batch.pop("old_logprobs")
    gc.collect()  # megatron's DDP/optimizer objects hold reference cycles
    if on_gpu:
        torch.cuda.empty_cache()
    # every rank must agree (an OOM on some ranks only would hang a collective before this; with
    # identical shapes per rank they run out together)
    oom = max_over_ranks(float(oom), info.device) > 0
    if oom:
        return dict(oom=True)
    return dict(
        step_times=[max_over_ranks(sum(phases), info.device) for phases in phase_times],
        phase_times=[[max_over_ranks(t, info.device) for t in phases] for phases in phase_times],
        peak_bytes=max_over_ranks(peak, info.device) if on_gpu else None,
        profile=kernels,
        check=check,
        ab=ab_pairs,
        op_counts=op_counts,
    )


def time_logprob_kernels(num_tokens, v_local, dtype, device, reps=5):
    """Milliseconds of vocab_parallel_logprobs alone on random (1, num_tokens, v_local) logits
    (one TP rank's shard, no communication): logprobs forward, and forward + backward with the
    entropy as in the PPO loss; eager and torch.compile'd. Median of `reps` after a warm-up (the
    slowest rank's, harness.timed)."""
    from common.rl import fused
    from common.rl.logprobs import vocab_parallel_logprobs

    def median_ms(fn):  # harness.timed: synchronised, the slowest rank's seconds
        times = [timed(fn, device) * 1e3 for _ in range(reps + 1)]
        return sorted(times[1:])[reps // 2]

    logits = torch.randn(1, num_tokens, v_local, device=device).mul_(3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v_local, (1, num_tokens), device=device)
    weights = torch.randn(1, num_tokens, device=device)

    def forward():
        with torch.no_grad():
            vocab_parallel_logprobs(logits, targets, v_local)

    def forward_backward():
        logprobs, entropy = vocab_parallel_logprobs(logits, targets, v_local, compute_entropy=True)
        ((logprobs + 0.01 * entropy) * weights).sum().backward()
        logits.grad = None

    result = {}
    for mode in ("eager", "compiled"):
        fused.COMPILE = mode == "compiled"
        result[f"{mode}_fwd_ms"] = median_ms(forward)
        result[f"{mode}_fwd_bwd_ms"] = median_ms(forward_backward)
    return result


def _sync(on_gpu):
    if on_gpu:
        torch.cuda.synchronize()


def summarize(run, *, tokens_per_step, flops_per_step, flops_per_step_full, world_size, peak_flops):
    """Measured step times -> the reported numbers (None where not defined)."""
    if run.get("oom"):
        return dict(status="oom")
    times = run["step_times"]
    step_s = sum(times) / len(times)  # the mean: tokens/s and MFU are over all timed steps
    phase_s = [sum(column) / len(times) for column in zip(*run["phase_times"])]  # means
    achieved = flops_per_step / step_s  # model FLOP/s, all devices together
    mfu = achieved / (world_size * peak_flops) if peak_flops else None
    mfu_full = flops_per_step_full / step_s / (world_size * peak_flops) if peak_flops else None
    return dict(
        status="ok",
        profile=run.get("profile"),
        op_counts=run.get("op_counts"),
        first_step=run["check"],
        ab=run.get("ab"),
        tokens=tokens_per_step * len(times),
        seconds=sum(times),
        tokens_per_s=tokens_per_step * len(times) / sum(times),
        step_s=step_s,
        tokens_per_s_per_device=tokens_per_step * len(times) / sum(times) / world_size,
        step_s_median=statistics.median(times),
        step_s_min=min(times),
        step_s_max=max(times),
        logprob_s=phase_s[0],
        fwd_bwd_s=phase_s[1],
        optimizer_s=phase_s[2],
        tflops_per_device=achieved / world_size / 1e12,
        mfu=mfu,
        mfu_full_attn=mfu_full,
        peak_mem_gib=run["peak_bytes"] / 2**30 if run["peak_bytes"] is not None else None,
    )


def main():
    args = build_parser().parse_args()
    from common.model.bridge import expected_hf_names, expected_hf_shape, padded_vocab_size, parse_hf_config
    from common.run.dist import destroy_distributed, init_distributed, print0

    tiny = args.config is None and args.shape == "tiny"
    seq_len = args.seq_len or (128 if tiny else 4096)
    num_seqs = args.num_seqs or (4 if tiny else 8)
    micro_batch_size = args.micro_batch_size or (2 if tiny else 1)
    if args.config:
        with open(args.config) as f:
            config, shape_name = json.load(f), args.config
    else:
        config, shape_name = SHAPES[args.shape], args.shape
    if args.num_layers:
        config, shape_name = dict(config, num_hidden_layers=args.num_layers), f"{shape_name}, {args.num_layers} layers"
        if "layer_types" in config:  # per-layer kinds (Qwen3.5, gpt-oss): the first num_layers, repeating
            kinds = config["layer_types"]
            config["layer_types"] = [kinds[i % len(kinds)] for i in range(args.num_layers)]
    spec = parse_hf_config(config)
    overrides = recompute_overrides(args.recompute, args.recompute_modules, args.recompute_num_layers)
    if args.recompute == "full":
        overrides["recompute_method"] = args.recompute_method
    if args.moe_dispatcher:
        overrides["moe_token_dispatcher_type"] = args.moe_dispatcher
    if args.cuda_graphs:  # layers graphed once recorded; one warm-up run per graph before its capture
        overrides.update(cuda_graph_impl="local", cuda_graph_warmup_steps=1)
    baseline_overrides = {}
    if spec.gdn is not None:  # the candidate's recurrence kernel; the baseline's is the plain torch one
        overrides["gdn_kernel"], baseline_overrides["gdn_kernel"] = args.gdn_kernel, "torch"

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    info = init_distributed(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, seed=args.seed)
    on_gpu = info.device.type == "cuda"
    if args.count_ops and on_gpu:
        raise SystemExit(
            "--count-ops is for CPU runs (CUDA_VISIBLE_DEVICES= ...): on a GPU, --profile counts the "
            "kernel launches (cudaLaunchKernel in its host ops)"
        )
    if args.cuda_graphs:
        refused = [
            flag
            for flag, on in (("--ab", args.ab), ("--pp > 1", args.pp > 1), ("--recompute", args.recompute != "none"))
            if on
        ]
        if not on_gpu or refused:
            raise SystemExit(
                "--cuda-graphs: "
                + (
                    "needs a GPU (CUDA graphs)"
                    if not on_gpu
                    else f"not with {', '.join(refused)} (graphs are recorded once, in the first "
                    "warm-up step, for one schedule of one layout)"
                )
            )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # megatron's graph manager asserts an RNG tracker whose states a graph can capture
        model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=True, force_reset_rng=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_gpu else "fp32")]
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak_tflops = args.peak_tflops or (default_peak_tflops(device_name) if on_gpu else None)
    if on_gpu and peak_tflops is None:
        raise SystemExit(f"unknown peak FLOP/s of {device_name!r}: pass --peak-tflops (dense bf16 of one device)")
    logprob_micro_batch_size = args.logprob_micro_batch_size or micro_batch_size
    for flag, size in (
        ("--micro-batch-size", micro_batch_size),
        ("--logprob-micro-batch-size", logprob_micro_batch_size),
    ):
        if num_seqs % (info.dp_size * size):
            raise SystemExit(f"--num-seqs {num_seqs} must be a multiple of dp {info.dp_size} x {flag} {size}")
    if args.ab == "logprob-micro-batch" and logprob_micro_batch_size == micro_batch_size:
        raise SystemExit(
            f"--ab logprob-micro-batch compares --logprob-micro-batch-size with --micro-batch-size "
            f"{micro_batch_size}: give it another size"
        )
    if args.sp and seq_len % (args.tp * args.cp):
        raise SystemExit(f"--sp needs --seq-len {seq_len} divisible by --tp x --cp {args.tp * args.cp}")
    if args.cp > 1 and seq_len % (2 * args.cp):
        raise SystemExit(f"--cp {args.cp} needs --seq-len {seq_len} divisible by 2 x cp (each rank takes two chunks)")

    # FLOPs of one step: 4 forward passes' worth per token (logprob pass 1x, fwd+bwd 3x)
    tokens_per_step = num_seqs * seq_len
    flops_per_step = 4 * forward_flops_per_token(spec, seq_len, causal=True) * tokens_per_step
    flops_per_step_full = 4 * forward_flops_per_token(spec, seq_len, causal=False) * tokens_per_step
    params = sum(torch.Size(expected_hf_shape(n, spec)).numel() for n in expected_hf_names(spec))
    batch = make_batch(spec, num_seqs, seq_len, args.seed)
    common = dict(
        dtype=dtype,
        tp=args.tp,
        pp=args.pp,
        sp=args.sp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        micro_batch_size=micro_batch_size,
        logprob_micro_batch_size=logprob_micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        distributed_optimizer=args.distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        wgrad_fusion=args.wgrad_fusion,
        device_sort=args.device_sort,
    )
    numbers = dict(
        tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_step,
        flops_per_step_full=flops_per_step_full,
        world_size=info.world_size,
        peak_flops=peak_tflops * 1e12 if peak_tflops else None,
    )
    params_text = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params:,}"
    print0(
        f"{shape_name}: {params_text} params, {seq_len} tokens x {num_seqs} sequences per step, "
        f"micro-batch {micro_batch_size} (logprob pass {logprob_micro_batch_size}), "
        f"{str(dtype).replace('torch.', '')}, "
        f"world {info.world_size} "
        f"(tp {info.tp_size} pp {info.pp_size} cp {info.cp_size} ep {info.ep_size} dp {info.dp_size}"
        f"{' sp' if args.sp else ''}) on {device_name}"
    )

    flash = (
        sdpa_takes_flash(spec, args.tp, seq_len, micro_batch_size, dtype)
        if on_gpu and args.attention == "sdpa"
        else None
    )

    # ---- candidate, then baseline (megatron-core's local spec as it comes), same batch
    candidate = summarize(
        run_config(
            spec,
            info,
            batch,
            attention=args.attention,
            overrides=overrides,
            kernels=args.kernels,
            profile=args.profile,
            trace=args.trace,
            ab=args.ab,
            count=args.count_ops,
            lora_rank=args.lora_rank,
            **common,
        ),
        **numbers,
    )
    left_gib = torch.cuda.memory_allocated() / 2**30 if on_gpu else None  # what the first run left behind
    if args.no_baseline or args.cp > 1:  # megatron's local attention refuses context parallelism
        baseline = dict(status="skipped")
    else:
        baseline = summarize(
            run_config(spec, info, batch, attention="local", overrides=baseline_overrides, **common), **numbers
        )

    # ---- report
    recompute_text = {
        "none": "none",
        "selective": "selective " + ",".join(args.recompute_modules),
        "full": f"full, {args.recompute_method} {args.recompute_num_layers} layer(s)",
    }[args.recompute]
    gdn = ", gated delta nets {}" if spec.gdn is not None else ""  # the recurrence kernel of each side
    rows = [
        (
            f"candidate: {args.attention}, recompute {recompute_text}{', CUDA graphs' if args.cuda_graphs else ''}"
            + gdn.format(args.gdn_kernel),
            candidate,
        ),
        ("baseline: local, recompute none" + gdn.format("torch"), baseline),
    ]

    def fmt(value, pattern):
        return "-" if value is None else pattern.format(value)

    print0(
        "step = old-logprob forward + PPO forward/backward + optimizer step; model FLOPs = 4x forward per token, "
        "causal attention half (full T x T in MFU full)"
    )
    if flash is not None:
        print0(f"SDPA: torch's flash-attention kernel {'accepts' if flash else 'does NOT accept'} this attention call")
    print0(f"peak {fmt(peak_tflops, '{:.0f}')} TFLOP/s per device; {args.steps} timed steps after {args.warmup} warmup")
    print0(
        f"{'':52s} {'tokens/s':>10s} {'s/step':>8s} {'TFLOP/s/dev':>11s} {'MFU':>6s} {'MFU full':>8s} {'peak GiB':>8s}"
    )
    for label, r in rows:
        if r["status"] != "ok":
            print0(f"{label:52s} {r['status'].upper()}")
            continue
        print0(
            f"{label:52s} {r['tokens_per_s']:10.0f} {r['step_s']:8.3f} {r['tflops_per_device']:11.2f} "
            f"{fmt(r['mfu'], '{:.3f}'):>6s} {fmt(r['mfu_full_attn'], '{:.3f}'):>8s} "
            f"{fmt(r['peak_mem_gib'], '{:.2f}'):>8s}"
        )
        print0(
            f"{'':4s}per step: median {r['step_s_median']:.3f} s (min {r['step_s_min']:.3f}, max "
            f"{r['step_s_max']:.3f}, {args.steps} steps); mean logprob pass {r['logprob_s']:.3f} s, "
            f"forward/backward {r['fwd_bwd_s']:.3f} s, optimizer {r['optimizer_s']:.3f} s"
        )
        print0(
            f"{'':4s}first step: mean old logprob {r['first_step']['logprob_mean']:.6f}, "
            f"grad norm {r['first_step']['grad_norm']:.6f} (the same at any layout with the same random "
            f"weights: not across --ep sizes, each EP rank initialises its own experts)"
        )
        print0(f"{'':4s}grad norm per step: " + " ".join(f"{g:.6f}" for g in r["first_step"]["grad_norms"]))
        if r.get("ab"):
            a = r["ab"]
            print0(
                f"{'':4s}--ab {args.ab}: step time off / on, median of {len(a['ratios'])} pairs {a['median']:.3f}x "
                f"(min {a['min']:.3f}, max {a['max']:.3f}); median step off {a['a_median']:.3f} s, on "
                f"{a['b_median']:.3f} s"
            )
        if r.get("profile"):
            for line in format_kernel_summary(r["profile"]):
                print0(f"{'':4s}{line}")
        if r.get("op_counts"):
            for line in format_op_counts(r["op_counts"]):
                print0(f"{'':4s}{line}")
    logprob_kernels = None
    if args.profile and on_gpu:  # the vocabulary part of the loss alone, one micro-batch's worth
        v_local = padded_vocab_size(spec.vocab_size, args.tp) // args.tp
        logprob_kernels = time_logprob_kernels(micro_batch_size * seq_len, v_local, dtype, info.device)
        print0(
            f"vocab_parallel_logprobs alone, {micro_batch_size * seq_len} tokens x {v_local} vocabulary columns: "
            + ", ".join(f"{k} {v:.2f}" for k, v in logprob_kernels.items())
        )
    both = candidate["status"] == "ok" and baseline["status"] == "ok"
    ratio_tokens = candidate["tokens_per_s"] / baseline["tokens_per_s"] if both else None
    # sequential, not paired (docstring): the ratio of the two medians, beside that of the means
    ratio_median = baseline["step_s_median"] / candidate["step_s_median"] if both else None
    ratio_mem = (
        candidate["peak_mem_gib"] / baseline["peak_mem_gib"] if both and candidate["peak_mem_gib"] is not None else None
    )
    print0(
        f"candidate / baseline: tokens/s x{fmt(ratio_tokens, '{:.2f}')} (median step times: "
        f"x{fmt(ratio_median, '{:.2f}')}), peak memory x{fmt(ratio_mem, '{:.2f}')}"
        + (f"  (baseline: {baseline['status'].upper()})" if baseline["status"] != "ok" else "")
    )
    if candidate["status"] == "ok" and candidate["mfu"] is not None:
        print0(f"target MFU >= 0.45: {'met' if candidate['mfu'] >= 0.45 else 'not met'} ({candidate['mfu']:.3f})")

    from megatron.core import package_info

    result = dict(
        bench="train",
        device=device_name,
        torch=torch.__version__,
        megatron_core=package_info.__version__,
        world_size=info.world_size,
        tp=info.tp_size,
        pp=info.pp_size,
        cp=info.cp_size,
        ep=info.ep_size,
        etp=info.etp_size,
        dp=info.dp_size,
        sp=args.sp,
        shape=shape_name,
        params=params,
        seq_len=seq_len,
        num_seqs=num_seqs,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_seqs // info.dp_size // micro_batch_size,
        logprob_micro_batch_size=logprob_micro_batch_size,
        packing="none (every row a full seq_len sequence; response mask = second half)",
        attention=args.attention,
        sdpa_flash=flash,
        gdn_kernel=args.gdn_kernel if spec.gdn is not None else None,
        kernels=args.kernels,
        logprob_kernels=logprob_kernels,
        recompute=args.recompute,
        recompute_modules=args.recompute_modules if args.recompute == "selective" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute == "full" else None,
        recompute_method=args.recompute_method if args.recompute == "full" else None,
        dtype=str(dtype).replace("torch.", ""),
        distributed_optimizer=args.distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        wgrad_fusion=args.wgrad_fusion,
        device_sort=args.device_sort,
        cuda_graphs=args.cuda_graphs,
        steps=args.steps,
        warmup=args.warmup,
        peak_tflops=peak_tflops,
        flops_per_step=flops_per_step,
        flops_per_step_full_attn=flops_per_step_full,
        flop_convention="4x forward per token (logprob pass + fwd/bwd); forward = 2 x matmul weights incl. LM head "
        "+ 4 x layers x seq_len x heads*head_dim x 1/2 (causal); *_full_attn without the 1/2",
        candidate=candidate,
        baseline=baseline,
        ratio_tokens_per_s=ratio_tokens,
        ratio_step_s_median=ratio_median,
        ratio_peak_mem=ratio_mem,
        comparison="sequential (one configuration after the other), not paired",
        mem_left_before_baseline_gib=left_gib,
        args=vars(args),
    )
    print0("BENCH_JSON " + json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
