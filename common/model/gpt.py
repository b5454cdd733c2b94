"""Build the Megatron-Core GPTModel from an HF config.

  build_model(spec, ...)                  -> list of model chunks (one per virtual pipeline stage)
  load_hf_spec(hf_dir)                    the bridge's HFModelSpec of an HF model directory
Unwrapping a chunk and naming its tensors globally: common/model/chunks.py.
The name/shape mapping itself lives in common/model/bridge.py; moving HF weights in and out of the
chunks (sharded load, bucketed export) in common/model/weights.py.
"""

import functools
import json
import os

import torch

from common.model.bridge import (
    HFModelSpec,
    check_parallel_layout,
    gpt_model_kwargs,
    parse_hf_config,
    transformer_config,
)


def load_hf_spec(hf_dir) -> HFModelSpec:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir} has no config.json: is it a HuggingFace model directory?")
    with open(path) as f:
        return parse_hf_config(json.load(f))


ATTENTION_CHOICES = ("sdpa", "local", "te")


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's norm, usable under sequence parallelism.

    megatron-core 0.16.1 builds the local spec's norms as WrappedTorchNorm, which asserts
    `not config.sequence_parallel` (transformer/torch_norm.py) because only TE/apex norms tag
    their weights for the SP gradient all-reduce. This is the same torch.nn.RMSNorm (same
    parameter names, so checkpoints and the bridge are unchanged) with the tag set: under SP
    each TP rank sees a slice of the sequence, and finalize_model_grads sums the weight's
    gradient over the TP group for every parameter with `sequence_parallel` True.
    """

    exact = False  # --true-on-policy (common/model/exact.py convert): vLLM's batch-invariant RMSNorm kernel

    def __init__(self, config, hidden_size, eps=1e-5, **unused):  # megatron passes normalization=, ...
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm built for normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        if not self.exact:
            return super().forward(x)
        from common.model import exact

        return exact.rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored zero-centred: x_normed * (1 + w), in fp32 (Qwen3.5's norms,
    transformers' Qwen3_5RMSNorm; the HF tensors load unchanged). No --true-on-policy kernel (refused at start)."""

    def forward(self, x):
        normed = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def layer_spec(spec: HFModelSpec, attention=None, moe=False, linear=False, gdn_kernel="torch"):
    """The megatron layer spec: RMSNorm, q/k norm for Qwen3, the core attention, the QKV
    projection of models with a QKV bias (common/model/linear.py: the bias added in the GEMM), and
    with moe=True an MoELayer (common/model/moe_router.py's Router and common/model/moe_experts.py's
    GroupedExperts) in place of the MLP.

    attention:
      "sdpa"  megatron's local spec with its core attention swapped for common/model/attention.py's
              SDPAttention (torch SDPA: flash / mem-efficient kernels on a GPU, no (T, T)
              score matrix). The default, on a GPU and on a CPU (same logits as "local" to
              fp32 rounding, tests/test_attention.py).
      "local" megatron's local spec as is (DotProductAttention: baddbmm + softmax + bmm).
      "te"    megatron's TransformerEngine spec (fused kernels, needs TE importable).
    linear=True (Qwen3.5's gated-delta-net layers): common/model/gdn.py's GatedDeltaNet in place of
    the self-attention, its recurrence on gdn_kernel ("torch" | "fla", see gdn.py). Qwen3.5's
    norms are ZeroCenteredRMSNorm, its full attention gated
    (TransformerConfig.attention_output_gate) with partial RoPE.
    The three have the same parameters; "te" names the fused norms differently
    (linear_qkv.layer_norm_weight), which the bridge maps too.
    Multi-latent attention (DeepSeek-V3) takes "sdpa" only: megatron's MLASelfAttention rotates
    q and k itself and asks its core attention for different q/k and v head sizes, which
    SDPAttention accepts and the local DotProductAttention does not.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    attention = attention or "sdpa"
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention={attention!r}; choose one of {ATTENTION_CHOICES}")
    mla = spec.mla is not None
    if mla and attention != "sdpa":
        raise ValueError(f"attention={attention!r}: multi-latent attention ({spec.architecture}) runs on 'sdpa'")
    if spec.gptoss is not None and attention != "sdpa":  # sinks and windows: common/model/gptoss.py
        raise ValueError(f"attention={attention!r}: {spec.architecture} runs on 'sdpa'")
    if spec.gdn is not None and attention == "te":
        raise ValueError(f"attention='te': {spec.architecture} (gated delta net) runs on 'sdpa' or 'local'")
    if attention == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise ImportError("attention='te' needs TransformerEngine; use 'sdpa' without it") from e
        if spec.moe is not None:
            raise ValueError("attention='te' is for dense models; MoE models use 'sdpa' or 'local'")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    if mla:
        from common.model.cpu_compat import megatron_without_te

        megatron_without_te()
    layer = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization="RMSNorm",
        qk_layernorm=spec.qk_norm or mla,
        multi_latent_attention=mla,
        num_experts=spec.moe.num_experts if moe else None,
    )
    if moe:
        from common.model.moe_experts import GroupedExperts
        from common.model.moe_router import Router

        layer.submodules.mlp.submodules.router = Router
        layer.submodules.mlp.submodules.experts.module = GroupedExperts
    # every MLP's activation (dense, routed experts, shared experts): common/model/swiglu.py, with the
    # config's use_te_activation_func (build_model)
    from common.model.swiglu import SwiGLU

    mlp = layer.submodules.mlp.submodules
    for sub in (mlp, getattr(mlp, "experts", None), getattr(mlp, "shared_experts", None)):
        sub = getattr(sub, "submodules", sub)
        if hasattr(sub, "activation_func"):
            sub.activation_func = SwiGLU
    # every norm of the layer (the final one: build_model) is RMSNorm above: SP works without TE/apex
    norm = RMSNorm if spec.gdn is None else ZeroCenteredRMSNorm
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    if linear:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from common.model.gdn import GatedDeltaNet

        layer.submodules.self_attention = ModuleSpec(
            module=GatedDeltaNet, params={"gdn": spec.gdn, "kernel": gdn_kernel}
        )
        return layer
    attn = layer.submodules.self_attention.submodules
    if mla:  # the norms of the q and kv latents
        attn.q_layernorm = attn.kv_layernorm = RMSNorm
    elif spec.qk_norm:
        attn.q_layernorm = attn.k_layernorm = norm
    if spec.qkv_bias and not mla:
        from common.model.linear import BiasInGemmColumnParallelLinear

        attn.linear_qkv = BiasInGemmColumnParallelLinear  # the QKV bias added by the GEMM, not after it
    if attention == "sdpa":
        from common.model.attention import SDPAttention

        # A fresh spec object per call, so this swap touches nothing shared. SelfAttention
        # calls submodules.core_attention(config=..., ...) directly: a class (or a partial of
        # one), not a ModuleSpec. SDPAttention applies RoPE itself, fused: build_model turns
        # megatron's off (position_embedding_type="none"). MLASelfAttention rotates its rope
        # head itself, so SDPAttention gets no rotary there.
        rope = {
            k: v
            for k, v in gpt_model_kwargs(spec).items()
            if k in ("rotary_base", "rope_scaling", "rope_scaling_factor", "rotary_percent")
        }
        attn.core_attention = SDPAttention if mla else functools.partial(SDPAttention, rotary=rope)
    return layer


def decoder_spec(spec: HFModelSpec, config, attention=None, vp_stage=None, gdn_kernel="torch"):
    """The decoder block spec of this pipeline (virtual) stage: its layers' specs (the MoE
    layer spec where spec.moe says so, dense elsewhere) and RMSNorm as the final norm
    (megatron's default would be WrappedTorchNorm). "te" keeps megatron's TE layer spec."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = layer_spec(spec, attention)
    if attention == "te":
        return dense
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    moe = layer_spec(spec, attention, moe=True) if spec.moe else None
    specs = [moe if spec.moe and spec.moe.moe_layers[first + i] else dense for i in range(count)]
    if spec.gdn is not None:  # Qwen3.5: gated delta nets where the layer types say so
        linear = layer_spec(spec, attention, moe=False, linear=True, gdn_kernel=gdn_kernel)
        linear_moe = layer_spec(spec, attention, moe=True, linear=True, gdn_kernel=gdn_kernel) if spec.moe else None
        for i in range(count):
            if spec.gdn.linear_layers[first + i]:
                specs[i] = linear_moe if spec.moe and spec.moe.moe_layers[first + i] else linear
    if spec.gptoss is not None:  # gpt-oss: sliding-window or full attention per config.layer_types
        from common.model.gptoss import gptoss_layer_spec

        kinds = {w: gptoss_layer_spec(layer_spec(spec, attention, moe=True), spec, w) for w in (True, False)}
        specs = [kinds[spec.gptoss.window_layers[first + i]] for i in range(count)]
    return TransformerBlockSubmodules(
        layer_specs=specs, layer_norm=RMSNorm if spec.gdn is None else ZeroCenteredRMSNorm
    )


_LOGITS_AS_VIEW = object()  # the `labels` marker of _gpt_model_class


@functools.cache
def _gpt_model_class():
    """megatron's GPTModel, except that the last stage returns its logits (B, T, V/tp) as a
    view of the (T, B, V/tp) tensor the output layer computes.

    Given no labels, megatron-core 0.16.1's GPTModel._postprocess returns
    logits.transpose(0, 1).contiguous(): a copy of the step's largest tensor, and one more of
    its gradient in the backward (52 ms of a 1.0 s Qwen2-1.5B training step at micro-batch 4 on
    an H200, docs/performance.md). Given labels it returns compute_language_model_loss(labels,
    logits) instead, with the (T, B, V/tp) logits: this class passes a marker as labels and
    returns the transposed view there. rl.vocab_parallel_logprobs computes in that memory
    order. With B = 1 the two are the same tensor layout. Real labels work as in megatron.
    """
    from megatron.core.models.gpt import GPTModel

    class GPTModelLogitsView(GPTModel):
        def forward(self, *args, labels=None, **kwargs):
            return super().forward(*args, labels=_LOGITS_AS_VIEW if labels is None else labels, **kwargs)

        def compute_language_model_loss(self, labels, logits):
            if labels is _LOGITS_AS_VIEW:
                return logits.transpose(0, 1)  # (T, B, V/tp) -> (B, T, V/tp), no copy
            return super().compute_language_model_loss(labels, logits)

    return GPTModelLogitsView


def build_model(
    spec: HFModelSpec,
    *,
    tp=1,
    pp=1,
    vpp=None,
    ep=1,
    etp=1,
    first_stage_layers=None,
    last_stage_layers=None,
    sequence_parallel=False,
    dtype=torch.float32,
    init_weights=False,
    attention=None,
    moe_aux_loss_coef=None,
    gdn_kernel="torch",
    **config_overrides,
):
    """One GPTModel per virtual pipeline stage of this rank (a list of one without VPP).

    attention: "sdpa" (default) | "local" | "te", see layer_spec.
    gdn_kernel: the recurrence of Qwen3.5's gated delta nets, "torch" | "fla" (common/model/gdn.py).
    MoE models: ep / etp expert (tensor) parallel sizes, moe_aux_loss_coef (None: the HF config's).
    first_stage_layers / last_stage_layers: decoder layers of the first / last pipeline stage
    (None: automatic, bridge.pipeline_layout); each layer keeps its global index, so weights
    load and checkpoints reshard whatever the split.

    Weights are left uninitialised unless init_weights: they are loaded next.
    Only the last pipeline stage has an output layer (and so logits).
    """
    from megatron.core import parallel_state as mpu

    split = dict(first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    check_parallel_layout(spec, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, **split)
    on_gpu = torch.cuda.is_available()
    if (attention or "sdpa") != "te":  # the MLPs' activation is the spec's module (common/model/swiglu.py)
        config_overrides = dict(use_te_activation_func=True, bias_activation_fusion=False, **config_overrides)
    config = transformer_config(
        spec,
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        perform_initialization=init_weights,
        moe_aux_loss_coef=moe_aux_loss_coef,
        **split,
        **config_overrides,
    )
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = dict(vp_stage=vp_stage) if vpp else {}
        block = decoder_spec(spec, config, attention, vp_stage if vpp else None, gdn_kernel)
        model_kwargs = gpt_model_kwargs(spec, tp=tp)
        if (attention or "sdpa") == "sdpa":
            model_kwargs["position_embedding_type"] = "none"  # SDPAttention applies RoPE (fused)
        model = _gpt_model_class()(  # megatron's GPTModel, logits without a transposing copy
            config=config,
            transformer_layer_spec=block,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, **stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, **stage),
            parallel_output=True,  # logits stay vocab-parallel: (B, T, V_padded/tp), a view of (T, B, .)
            **model_kwargs,
            **stage,
        )
        # The local spec's norms (torch.nn.RMSNorm) are created in fp32 whatever params_dtype
        # says; megatron's Float16Module casts the whole model, and so do we: DDP's grad
        # buffers and the optimizer assume one dtype (else a shape assertion at checkpoint save).
        model.to(dtype)
        _check_activations(model)
        if not init_weights:
            _mark_tensor_parallel(model)
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    if spec.moe is not None:
        from common.model.moe import sort_tokens_on_device

        sort_tokens_on_device(chunks)  # EP=1: no host waits in the token dispatch
    return chunks


def _check_activations(model):
    """With use_te_activation_func megatron's MLP applies the spec's activation module to the whole
    fc1 output; an MLP whose spec had none would apply plain SiLU there, ungated. Fail instead."""
    from megatron.core.transformer.mlp import MLP

    from common.model.swiglu import SwiGLU

    for name, module in model.named_modules():
        if (
            isinstance(module, MLP)
            and module.config.use_te_activation_func
            and not isinstance(module.activation_func, SwiGLU)
        ):
            raise RuntimeError(f"{name}: the MLP's spec has no activation module (common/model/gpt.py layer_spec)")


def _mark_tensor_parallel(model):
    """Tag TP-sharded weights as megatron's random init would.

    megatron-core 0.16.1 sets `tensor_model_parallel` / `partition_dim` on linear and
    embedding weights only inside its init functions (perform_initialization=True). We
    load weights instead; untagged shards count as replicas in the grad-norm computation,
    so clipping at TP>1 would use a wrong norm (tests/test_train_grpo.py compares TP=2 with
    TP=1 grad norms).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
