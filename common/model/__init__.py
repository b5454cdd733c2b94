"""The model: HF config and weights <-> Megatron-Core GPTModel, and the kernels it runs on.

    bridge.py           the one table of supported architectures; config -> TransformerConfig
    bridge_tensors.py   the tensor mapping: HF tensors <-> megatron parameters and their TP shards
    bridge_moe.py, bridge_mla.py, bridge_layout.py   the rules of MoE, multi-latent attention, pipeline layouts
    bridge_gdn.py       the rules of Qwen3.5's gated delta nets and gated attention
    bridge_vl.py        vision-language checkpoints (released Qwen3.5): their language model's config and tensors
    bridge_gptoss.py    the rules of gpt-oss: sinks, windows per layer, YaRN, fused biased experts, MXFP4
    unsupported.py      UnsupportedModelError
    gpt.py              build_model: layer specs and the GPTModel chunks
    chunks.py           unwrap a chunk; its tensors under global names
    weights_load.py     HF weights in: each rank's sharded reads of the safetensors, checked finite
    weights.py          HF weights out: the bucketed export for the weight sync and merge_to_hf.py
    critic.py           the GPTModel body with a value head (PPO's critic, reward models)
    lora.py             LoRA adapters on the tensor-parallel linears; merged weights for the export
    attention.py, attention_cp.py   core attention: SDPA, packed (varlen), context parallel
    gdn.py              the gated delta net layer (Qwen3.5's linear attention), pure torch, packed samples
    gdn_kernels.py      which recurrence kernel the delta nets run (torch, or fla's fused one where it trains)
    gptoss.py           gpt-oss's layers: attention with sinks and sliding windows, its experts and clamped SwiGLU
    moe.py, moe_router.py, moe_experts.py   MoE dispatch, routing, grouped experts
    routing_replay.py   MoE routing replay: routers sent to recorded experts, or recording their own
    exact.py            --true-on-policy: the forward on the rollout engine's own (vLLM's) kernels, bit for bit
    swiglu.py, linear.py   the MLPs' activation kernel, the QKV bias in the GEMM
    flops.py            model FLOPs per token (MFU)
    sizes.py            parameters, activations and KV cache per rank of a layout (the memory plan's arithmetic)
    cpu_compat.py       the adapter that lets megatron-core run on a CPU (applied only without a GPU)

May import common.rl (not common.train, common.rollout or common.run).
"""
