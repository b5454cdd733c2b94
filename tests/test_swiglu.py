"""common/model/swiglu.py: the MLPs' activation module (its Triton backward: tests/gpu/test_swiglu_gpu.py)."""

import torch
import torch.nn.functional as F

from common.model.swiglu import SwiGLU, swiglu, swiglu_backward, swiglu_backward_reference
from tests.test_attention import dist_world_of_one  # noqa: F401  (the fixture)


def test_backward_formula_is_the_gradient_of_swiglu():
    """The kernel's formula (in torch ops) against autograd of silu(a) * b, in fp64; and the
    module's CPU path is that expression."""
    torch.manual_seed(0)
    y = (3 * torch.randn(4, 6, 16, dtype=torch.float64)).requires_grad_()
    a, b = y.chunk(2, -1)
    out = F.silu(a) * b
    grad = torch.randn_like(out)
    (expected,) = torch.autograd.grad(out, y, grad)
    torch.testing.assert_close(swiglu_backward_reference(grad, y.detach()), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(swiglu_backward(grad, y.detach()), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(swiglu(y), out)


def test_every_mlp_of_a_model_gets_the_module(dist_world_of_one):  # noqa: F811 (the fixture)
    """Dense MLPs, routed experts and shared experts (Qwen2-MoE: both) all apply SwiGLU; with the
    config's use_te_activation_func megatron would otherwise apply plain SiLU there, ungated."""
    from megatron.core.transformer.mlp import MLP

    from common.model.bridge import parse_hf_config
    from common.model.gpt import build_model
    from tests.tiny_models import ARCH_CONFIGS, MOE_CONFIGS

    for arch, config in (ARCH_CONFIGS["qwen2"], MOE_CONFIGS["qwen2_moe"]):
        model = build_model(parse_hf_config(dict(config, architectures=[arch])))[0]
        mlps = [m for m in model.modules() if isinstance(m, MLP)]
        assert len(mlps) > 2 and all(isinstance(m.activation_func, SwiGLU) for m in mlps), arch
        assert model.config.use_te_activation_func and not model.config.bias_activation_fusion
