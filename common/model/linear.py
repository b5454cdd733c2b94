"""The QKV projection with its bias added inside the GEMM, a drop-in for megatron's ColumnParallelLinear.

Why: without TransformerEngine, megatron-core 0.16.1's linear function computes
`torch.matmul(x, w.t())` and then `output + bias` as a separate kernel
(tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication.forward). For a
model with a QKV bias (Qwen2, Qwen2-MoE) that add reads and writes the whole (tokens, q+k+v)
output once more per layer and forward: on an H200, for 4 x 4096 tokens at Qwen2-1.5B's shape,
the GEMM takes 136 us and the add 85 us, while `torch.addmm(bias, x, w.t())` (cuBLASLt's bias
epilogue) takes 137 us for both (docs/performance.md, section 3). The epilogue adds the bias to
the fp32 accumulator before the one rounding to bf16, so the output is also closer to exact.

`BiasInGemmColumnParallelLinear` is selected by a ModuleSpec swap in common/model/gpt.py:layer_spec
(linear_qkv of models with a QKV bias), never by patching megatron. It has ColumnParallelLinear's
parameters, attributes and backward (the weight gradient accumulated into main_grad, the bias
gradient a sum over tokens), so checkpoints, the bridge, the fused wgrad accumulation and the
weight sync see no difference. Only the forward's product differs, and only where megatron's
own path would compute the product locally then add: a trainable weight with a bias and no
sequence parallelism (under SP megatron all-gathers the input inside its function; that case,
frozen weights and bias-free layers keep megatron's path unchanged).
"""

import torch
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.utils import get_tensor_model_parallel_group_if_none

ENABLED = True  # False: megatron's matmul + add (bench/train.py --ab qkv-bias-gemm)


def save_linear_context(
    ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, grad_output_buffer,
    limit, tp_group,
):  # fmt: skip
    """What megatron's linear backward reads from its context (megatron-core 0.16.1,
    LinearWithGradAccumulationAndAsyncCommunication), its forward's arguments in their order; `input` is this
    rank's (with sequence parallelism the backward gathers it again)."""
    ctx.save_for_backward(input, weight)
    ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
    ctx.use_bias = bias is not None
    ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
    ctx.allreduce_dgrad = allreduce_dgrad
    ctx.sequence_parallel = sequence_parallel
    ctx.wgrad_deferral_limit = limit
    ctx.grad_output_buffer = grad_output_buffer
    ctx.tp_group = tp_group


class _LinearBiasInGemm(mcore_layers.LinearWithGradAccumulationAndAsyncCommunication):
    """megatron's autograd function with the forward's product and bias in one addmm; its backward
    is inherited unchanged and reads exactly the context fields set here (megatron-core 0.16.1)."""

    @staticmethod
    @mcore_layers.custom_fwd
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
    ):
        assert bias is not None and not sequence_parallel, "the caller keeps these cases on megatron's path"
        save_linear_context(
            ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
            grad_output_buffer, wgrad_deferral_limit, tp_group,
        )  # fmt: skip
        output = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
        return output.view(*input.shape[:-1], output.shape[-1])


class BiasInGemmColumnParallelLinear(mcore_layers.ColumnParallelLinear):
    """ColumnParallelLinear whose forward adds the bias in the GEMM (see the module docstring)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        bias, sequence_parallel = kwargs.get("bias"), kwargs.get("sequence_parallel")
        if not ENABLED or args or bias is None or sequence_parallel or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(kwargs["tp_group"])
        return _LinearBiasInGemm.apply(
            input,
            weight,
            bias,
            kwargs["gradient_accumulation_fusion"],
            kwargs["allreduce_dgrad"],
            False,
            kwargs["grad_output_buffer"],
            kwargs["wgrad_deferral_limit"],
            tp_group,
        )
