"""Model FLOPs and the throughput metrics of a step (tokens/s, MFU), one convention for the
training scripts' metrics.jsonl and bench/train.py.

    forward_flops_per_token(spec, seq_len)         model FLOPs of one forward pass, per token
    step_throughput(spec, samples, times, ...)     tokens, step_tokens_per_s_per_gpu, gen_tokens_per_s,
                                                   train_tokens_per_s_per_gpu, train_mfu
"""

import torch

# Dense (no sparsity) bf16 peak, TFLOP/s, from NVIDIA's data sheets; first match on the
# device name wins, so the PCIe/NVL variants come before the SXM parts.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0), ("H200", 989.0)]
# the phases in which the trainer runs the model (common/offload.Timer keys of the scripts)
TRAINER_PHASES = ("old_logprob_s", "ref_s", "teacher_s", "values_s", "train_s")


def forward_flops_per_token(spec, seq_len, causal=True):
    """Model FLOPs of one forward pass, per token, for sequences of seq_len tokens.

    2 FLOPs (multiply + add) per weight of every matmul: q/k/v, o, gate/up/down of each layer
    (MoE layers: the router, top-k experts and the shared expert, the active weights), and the LM
    head (vocab x hidden; tied or not, the product is computed). Attention: QK^T and
    (softmax)V each cost 2 * seq_len * heads * head_dim per token and layer over the full
    T x T; causal=True counts the useful lower triangle only (half), as Megatron-LM and NeMo do.
    Gated delta nets (Qwen3.5) count their projections, their depthwise conv and the recurrence
    (linear in seq_len: 6 dk dv FLOPs per token and value head) instead.
    """
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, f = spec.hidden_size, spec.ffn_hidden_size
    attention_weights = h * (q_dim + 2 * kv_dim) + q_dim * h  # qkv, o
    v_dim = kv_dim
    mla = getattr(spec, "mla", None)
    if mla is not None:  # q (LoRA or not), kv down + up, o; values have their own head size
        v_dim = spec.num_heads * mla.v_head_dim
        q = h * mla.q_lora_rank + mla.q_lora_rank * q_dim if mla.q_lora_rank else h * q_dim
        kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * spec.num_heads * (
            mla.qk_nope_head_dim + mla.v_head_dim
        )
        attention_weights = q + kv + v_dim * h
    mlps = [3 * h * f] * spec.num_layers  # gate+up+down
    moe = getattr(spec, "moe", None)
    if moe is not None:  # MoE layers count their active weights: router, top-k experts, shared expert
        active = h * moe.num_experts + moe.topk * 3 * h * moe.ffn_hidden_size + 3 * h * moe.shared_expert_size
        mlps = [active if is_moe else dense for is_moe, dense in zip(moe.moe_layers, mlps)]
    full_layers, recurrence = spec.num_layers, 0
    gdn = getattr(spec, "gdn", None)
    if gdn is not None:  # Qwen3.5: gated full attention (a gate row per query row) and gated delta nets
        linear = sum(gdn.linear_layers)
        full_layers -= linear
        attention_weights += h * q_dim
        gdn_weights = h * sum(gdn.in_pieces(1)) + gdn.value_dim * h  # in_proj, out_proj
        # per token and value head, the recurrence's three dk x dv products (S^T k, k delta^T, S^T q)
        # and the depthwise conv
        recurrence = linear * (2 * 3 * gdn.key_head_dim * gdn.value_head_dim * gdn.num_value_heads)
        recurrence += linear * 2 * gdn.conv_dim * gdn.conv_kernel
        matmul_extra = linear * (gdn_weights - attention_weights)
    else:
        matmul_extra = 0
    matmul_weights = spec.num_layers * attention_weights + matmul_extra + sum(mlps) + spec.vocab_size * h
    keys = seq_len * (0.5 if causal else 1.0)  # keys a token attends, on average
    gptoss = getattr(spec, "gptoss", None)
    windowed = sum(gptoss.window_layers) if gptoss is not None else 0  # gpt-oss: at most sliding_window keys
    attention = (
        2 * (full_layers - windowed) * keys + 2 * windowed * min(keys, gptoss.sliding_window if windowed else 0)
    ) * (q_dim + v_dim * spec.num_heads // spec.num_kv_heads)  # QK^T over the q/k head size, (softmax)V over v's
    return 2 * matmul_weights + attention + recurrence


def peak_tflops(device_name):
    """Dense bf16 peak TFLOP/s of a known GPU by its name, else None."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def step_throughput(spec, samples, times, *, forward_passes, world_size, device, other_models=()):
    """Throughput of one RL step for metrics.jsonl (samples: every sample of the step, all ranks').

    tokens, response_tokens     prompt + response tokens of the step's samples; their responses' alone
    step_tokens_per_s_per_gpu   tokens / step seconds / world size: the whole step, sync to checkpoint
                                (NeMo-RL's "Tokens / sec / GPU"; bench/e2e.py)
    gen_tokens_per_s            response tokens generated / rollout seconds (all replicas together)
    train_tokens_per_s_per_gpu  prompt + response tokens of the step / trainer seconds (old/ref
                                logprobs, critic values, updates: TRAINER_PHASES) / world size
    train_mfu                   model FLOPs of those passes / trainer seconds / (world size * peak
                                bf16 FLOP/s); on a GPU of PEAK_BF16_TFLOPS only
    forward_passes: forward-pass equivalents per token, a backward counting 2 (GRPO with a
    reference model and one PPO epoch: 1 old + 1 ref + 3 update = 5). Padding and recompute are
    not counted (model FLOPs, as bench/train.py). other_models: specs of other models that ran one
    forward pass over the step's tokens in the trainer's time (the distillation teacher, its own size)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    response_tokens = sum(len(s.response_ids) for s in samples)
    metrics = dict(tokens=sum(lengths), response_tokens=response_tokens)
    if times.get("step_s"):
        metrics["step_tokens_per_s_per_gpu"] = sum(lengths) / times["step_s"] / world_size
    if times.get("rollout_s"):
        metrics["gen_tokens_per_s"] = response_tokens / times["rollout_s"]
    trainer_s = sum(times.get(key, 0.0) for key in TRAINER_PHASES)
    if trainer_s > 0:
        metrics["train_tokens_per_s_per_gpu"] = sum(lengths) / trainer_s / world_size
        peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        if peak:
            flops = forward_passes * sum(n * forward_flops_per_token(spec, n) for n in lengths)
            flops += sum(n * forward_flops_per_token(other, n) for other in other_models for n in lengths)
            metrics["train_mfu"] = flops / trainer_s / (world_size * peak * 1e12)
    return metrics
