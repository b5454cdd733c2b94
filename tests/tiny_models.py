"""Tiny random HF models built in code (no downloads), one per supported architecture.

Norm weights and biases are perturbed away from their 1/0 init, so every tensor of the
mapping changes the logits and a wrong mapping cannot hide.
"""

import torch

ARCH_CONFIGS = {
    # Qwen2: q/k/v bias, GQA (4 heads, 2 groups)
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
    ),
    # Qwen2 with tied embeddings (as Qwen2-0.5B / 1.5B)
    "qwen2_tied": (
        "Qwen2ForCausalLM",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
    ),
    # Llama-3.2 style: llama3 rope scaling, tied embeddings
    "llama": (
        "LlamaForCausalLM",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=16384,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0,
            },
        ),
    ),
    # Qwen3: q/k norm, head_dim 32 != hidden/heads = 16
    "qwen3": (
        "Qwen3ForCausalLM",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        "MistralForCausalLM",
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
}

# Mixture-of-Experts (tests/test_moe.py): 8 experts, top-2, 4 layers with dense layers mixed in
_MOE_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)
MOE_CONFIGS = {
    # Qwen3-MoE: q/k norm, renormalised top-k, layer 1 dense (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            _MOE_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen2-MoE: qkv bias, shared expert + sigmoid gate, top-k not renormalised, MoE every 2nd layer
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        dict(
            _MOE_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
    # Mixtral: every layer MoE, experts named block_sparse_moe.experts.{e}.w1/w2/w3 on disk
    "mixtral": (
        "MixtralForCausalLM",
        dict(_MOE_COMMON, intermediate_size=32, num_local_experts=8, sliding_window=None, rope_theta=1e6),
    ),
}

# DeepSeek-V3 (tests/test_deepseek.py): multi-latent attention with q LoRA and YaRN (mscale
# 1/1: the softmax scale changes), 8 experts in 4 groups (top-2 groups, top-4 experts),
# sigmoid routing with a random score-correction bias, a shared expert, layer 0 dense, an odd
# layer count. topk_method/scoring_func: as the released config.json has them (vLLM needs them,
# transformers 5 does not write them).
_DEEPSEEK = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    },
)
MOE_CONFIGS["deepseek_v3"] = ("DeepseekV3ForCausalLM", _DEEPSEEK)
# the small variants: no q LoRA (q_proj), plain RoPE, one expert group (Moonlight's routing)
MOE_CONFIGS["deepseek_v3_small"] = (
    "DeepseekV3ForCausalLM",
    dict(
        _DEEPSEEK,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
)


# Qwen3.5 (tests/test_qwen35.py): gated delta nets and gated full attention alternating (the released
# models: 3 of 4 layers linear), 2 key heads shared by 4 value heads, key head 16 != value head 8,
# partial RoPE (a quarter of head_dim 16), zero-centred norms; the multimodal RoPE sections as released
_QWEN35 = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
# Qwen3.5-MoE: the same layers with a sparse MLP in each (4 experts, top-2, renormalised) and a shared
# expert behind a sigmoid gate
_QWEN35_MOE = {k: v for k, v in _QWEN35.items() if k != "intermediate_size"}
_QWEN35_MOE.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
GDN_CONFIGS = {"qwen3_5": ("Qwen3_5ForCausalLM", _QWEN35), "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", _QWEN35_MOE)}
# not the vision-language Qwen3_5Config / Qwen3_5MoeConfig
_CONFIG_CLASS = {"Qwen3_5ForCausalLM": "Qwen3_5TextConfig", "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig"}
# gpt-oss (tests/test_gptoss.py): attention sinks, sliding windows of 6 keys on alternate layers (the
# parity batches are 24 tokens long), YaRN untruncated as released, 8 biased experts (top-2), q/k/v/o biases
_GPTOSS = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
)
GPTOSS_CONFIGS = {"gpt_oss": ("GptOssForCausalLM", _GPTOSS)}


def make_tiny_hf_model(name, seed=0, layers=None):
    """layers: another num_hidden_layers (e.g. an odd count for uneven pipeline stages)."""
    import transformers

    arch, kwargs = {**ARCH_CONFIGS, **MOE_CONFIGS, **GDN_CONFIGS, **GPTOSS_CONFIGS}[name]
    kwargs = dict(kwargs, num_hidden_layers=layers or kwargs["num_hidden_layers"])
    if layers and "layer_types" in kwargs:  # the pattern repeated to the new depth
        kwargs["layer_types"] = [kwargs["layer_types"][i % len(kwargs["layer_types"])] for i in range(layers)]
    config_cls = getattr(transformers, _CONFIG_CLASS.get(arch, arch.replace("ForCausalLM", "Config")))
    config = config_cls(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif pname.endswith("sinks"):  # gpt-oss: sinks that take a visible share of the attention
                p.copy_(torch.randn_like(p))
            elif (name in MOE_CONFIGS or name.endswith("_moe")) and ("gate" in pname or "experts" in pname):
                p.copy_(torch.randn_like(p) * 0.05)  # transformers 5 starts routers at zero: make them route
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek-V3: zeros would hide a lost bias
                buf.copy_(torch.randn_like(buf) * 0.05)
    return model


def save_tiny_hf_model(name, out_dir, seed=0, max_shard_size=None, layers=None):
    """A complete HF model dir: weights, config.json and the embedded byte-level tokenizer
    (259 tokens, within every tiny model's vocabulary of 300)."""
    from common.run.embedded import build_tokenizer

    model = make_tiny_hf_model(name, seed, layers)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    build_tokenizer().save_pretrained(out_dir)
    return model


VL_ARCHITECTURES = {  # the text CausalLM -> its vision-language checkpoint (common/model/bridge_vl.py)
    "Qwen3_5ForCausalLM": "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForConditionalGeneration",
}


def save_tiny_vl_model(name, out_dir, seed=0, layers=None, fused_experts=False):
    """The vision-language checkpoint of a tiny Qwen3.5 (GDN_CONFIGS): transformers' own
    ForConditionalGeneration with a one-block vision tower, its language model and LM head those of
    make_tiny_hf_model(name, seed, layers), saved by save_pretrained (tensors under
    model.language_model., model.visual.*), plus a multi-token-prediction tensor (mtp.*) as the
    released checkpoints have; fused_experts: the routed experts as released, one (E, 2I, H)
    gate_up_proj and one (E, H, I) down_proj per layer. Returns the text model."""
    import os

    import transformers
    from safetensors.torch import load_file, save_file

    from common.run.embedded import build_tokenizer

    text = make_tiny_hf_model(name, seed, layers)
    arch = VL_ARCHITECTURES[text.config.architectures[0]]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text.config.hidden_size)
    config = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))(
        text_config=text.config.to_dict(), vision_config=vision, tie_word_embeddings=text.config.tie_word_embeddings
    )
    config.architectures = [arch]
    torch.manual_seed(seed + 1)
    vl = getattr(transformers, arch)(config).float().eval()
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.randn(text.config.hidden_size, 2 * text.config.hidden_size)
    if fused_experts:
        experts = sorted({k.split(".experts.")[0] for k in tensors if ".mlp.experts." in k})
        for prefix in experts:
            e = text.config.num_experts

            def pop(i, proj, prefix=prefix):
                return tensors.pop(f"{prefix}.experts.{i}.{proj}.weight")

            tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(
                [torch.cat([pop(i, "gate_proj"), pop(i, "up_proj")]) for i in range(e)]
            )
            tensors[f"{prefix}.experts.down_proj"] = torch.stack([pop(i, "down_proj") for i in range(e)])
    save_file(tensors, path, metadata={"format": "pt"})
    return text
