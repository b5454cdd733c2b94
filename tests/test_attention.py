"""Tests of common/model/attention.py (SDPAttention) and layer_spec(attention=...) in common/model/gpt.py.

    .venv/bin/python -m pytest -q tests/test_attention.py

fp32 on the CPU, against megatron's own DotProductAttention and against transformers:
  - the module alone: GQA (8 query heads on 2 groups), causal and with an explicit mask,
    outputs and q/k/v gradients equal to DotProductAttention (<= 1e-5); a non-causal
    variant is far off, so the comparison can fail;
  - whole models (tests/tiny_models.py: GQA everywhere, Qwen3's head_dim 32 != 64/4, Qwen2's
    q/k/v bias, Llama's scaled rope) at TP=1 in-process and at TP=2 (+SP) under torchrun:
    logits equal to transformers and to the local spec (<= 1e-5), every parameter gradient
    equal to the local spec's (<= 1e-5 relative to that tensor's largest gradient);
  - the state dict (what checkpoints and the HF bridge see) is the same for both specs;
  - apply_rope (SDPAttention's RoPE) equals megatron's unfused rotation, values and gradients,
    and compiles (inductor on the CPU: what runs on a GPU) to the same numbers.
The GPU (bf16, flash kernels, speed) is tests/gpu/test_sdpa_gpu.py.
"""

import pytest
import torch

from tests.conftest import LayoutLaunches

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dist_world_of_one():
    """This process as a world of one. init_distributed exports MASTER_ADDR/PORT for it; they
    are removed again afterwards, or later tests' subprocesses would inherit a port this
    process still listens on (EADDRINUSE)."""
    from common.run.dist import init_distributed

    with pytest.MonkeyPatch.context() as env:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            env.setenv(name, "")  # recorded as unset, so teardown removes what
            env.delenv(name)  # init_distributed exports
        yield init_distributed()


def core_attention_pair(num_heads=8, num_groups=2, head_dim=32):
    """(DotProductAttention, SDPAttention) built from the same TransformerConfig."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from common.model.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=num_heads * head_dim,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
    )
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kwargs), SDPAttention(**kwargs)


def qkv(seq=24, batch=3, num_heads=8, num_groups=2, head_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, num_heads, head_dim), (seq, batch, num_groups, head_dim), (seq, batch, num_groups, head_dim)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def run(module, tensors, mask=None):
    """Output (s, b, heads * d) and the q/k/v gradients of a fixed random projection of it."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out = module(*tensors, mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in tensors]


def test_core_attention_matches_local_causal(dist_world_of_one):
    local, sdpa = core_attention_pair()
    tensors = qkv()
    out_local, grads_local = run(local, tensors)
    out_sdpa, grads_sdpa = run(sdpa, tensors)
    assert out_sdpa.shape == (24, 3, 8 * 32)
    assert (out_sdpa - out_local).abs().max() <= TOLERANCE
    for g_sdpa, g_local in zip(grads_sdpa, grads_local):
        assert (g_sdpa - g_local).abs().max() <= TOLERANCE
    # negative control: the same kernel without the causal mask is far off
    q, k, v = (t.detach().permute(1, 2, 0, 3) for t in tensors)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert (full.permute(2, 0, 1, 3).reshape(24, 3, -1) - out_local).abs().max() > 1e-2


def test_core_attention_matches_local_explicit_mask(dist_world_of_one):
    """A megatron-style bool mask (True = masked): causal plus left padding of 5 tokens in
    batch row 1. Both modules use the given mask as is."""
    local, sdpa = core_attention_pair()
    tensors = qkv()
    mask = torch.ones(24, 24, dtype=torch.bool).triu(1).expand(3, 1, 24, 24).clone()
    mask[1, :, :, :5] = True
    mask[1, :, torch.arange(5), torch.arange(5)] = False  # padded rows attend to themselves
    out_local, grads_local = run(local, tensors, mask)
    out_sdpa, grads_sdpa = run(sdpa, tensors, mask)
    assert (out_sdpa - out_local).abs().max() <= TOLERANCE
    for g_sdpa, g_local in zip(grads_sdpa, grads_local):
        assert (g_sdpa - g_local).abs().max() <= TOLERANCE
    out_causal, _ = run(sdpa, tensors)  # the padding really changes row 1
    assert (out_causal[:, 1] - out_sdpa[:, 1]).abs().max() > 1e-2


def test_unsupported_inputs_are_errors(dist_world_of_one):
    from megatron.core.packed_seq_params import PackedSeqParams

    _, sdpa = core_attention_pair()
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="packed"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams())
    with pytest.raises(ValueError, match="sq == sk"):
        sdpa(q, k[:10], v[:10], None)


def check_rows(rows, where):
    for name, per_rank in rows.items():
        for rank, row in enumerate(per_rank):
            at = f"{name} {where} rank {rank}"
            print(
                f"{at}: sdpa-hf {row['sdpa_vs_hf']:.1e} local-hf {row['local_vs_hf']:.1e} "
                f"sdpa-local {row['sdpa_vs_local']:.1e} grad rel {row['grad_max_rel_diff']:.1e}"
            )
            assert row["sdpa_vs_hf"] <= TOLERANCE, at
            assert row["local_vs_hf"] <= TOLERANCE, at
            assert row["sdpa_vs_local"] <= TOLERANCE, at
            assert row["grad_max_rel_diff"] <= TOLERANCE, at
            assert row["grad_nonzero"], at


@pytest.fixture(scope="module")
def attention_models_dir(tmp_path_factory):
    """The tiny models that cover the attention shapes: GQA + q/k/v bias (qwen2), head_dim !=
    hidden/heads + q/k norm (qwen3), scaled rope + tied embeddings (llama)."""
    from tests.tiny_models import save_tiny_hf_model

    root = tmp_path_factory.mktemp("attention_models")
    for name in ("qwen2", "qwen3", "llama"):
        save_tiny_hf_model(name, str(root / name))
    return root


def test_models_tp1_in_process(dist_world_of_one, attention_models_dir):
    from tests.attention_worker import compare

    rows = compare(str(attention_models_dir), tp=1)
    check_rows({name: [row] for name, row in rows.items()}, "tp1")


TP2_LAYOUTS = {"tp2": (2, ["--tp", 2]), "tp2_sp": (2, ["--tp", 2, "--sp"])}


@pytest.fixture(scope="module")
def tp2_runs(attention_models_dir, tmp_path_factory):  # both layouts in one torchrun launch
    return LayoutLaunches(
        "tests/attention_worker.py",
        TP2_LAYOUTS,
        ["--models-dir", attention_models_dir],
        tmp_path_factory.mktemp("attention"),
    )


@pytest.mark.parametrize("layout", list(TP2_LAYOUTS))
def test_models_tp2_torchrun(tp2_runs, layout):
    flags = TP2_LAYOUTS[layout][1]
    rows = tp2_runs[layout]
    assert sorted(rows) == ["llama", "qwen2", "qwen3"] and all(len(r) == 2 for r in rows.values())
    check_rows(rows, " ".join(map(str, flags)))


def test_same_state_dict_and_spec_choices(dist_world_of_one, attention_models_dir):
    from common.model.attention import SDPAttention
    from common.model.gpt import build_model, layer_spec, load_hf_spec

    spec = load_hf_spec(str(attention_models_dir / "qwen3"))
    local, sdpa = build_model(spec, attention="local")[0], build_model(spec)[0]  # default: sdpa
    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SDPAttention)
    assert not isinstance(local.decoder.layers[0].self_attention.core_attention, SDPAttention)

    def shapes(model):  # _extra_state entries are None
        return {k: getattr(v, "shape", v) for k, v in model.state_dict().items()}

    assert shapes(local) == shapes(sdpa)
    # RoPE: megatron's on the local spec; on the SDPA spec SDPAttention's own, megatron's off
    assert local.rotary_pos_emb is not None and not hasattr(sdpa, "rotary_pos_emb")
    assert sdpa.decoder.layers[0].self_attention.core_attention.rotary is not None
    # the swap builds a new spec each call: megatron's own local spec is untouched
    assert layer_spec(spec, "local").submodules.self_attention.submodules.core_attention is not SDPAttention
    with pytest.raises(ValueError, match="flash"):
        layer_spec(spec, "flash")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="TransformerEngine"):
            layer_spec(spec, "te")


def test_apply_rope_matches_megatron_and_compiles():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from common.model.attention import apply_rope, apply_rope_qk
    from common.rl.fused import compile_fn

    torch.manual_seed(0)
    compiled_rope = compile_fn(apply_rope.eager)  # one compiled function for all lengths, as on a GPU
    compiled_rope_qk = compile_fn(apply_rope_qk.eager)
    for s in (7, 12, 9):  # lengths: the second recompiles with a symbolic length, the third reuses it
        t = torch.randn(s, 2, 3, 16, requires_grad=True)
        freqs = torch.rand(s, 1, 1, 8) * 10
        freqs = torch.cat((freqs, freqs), dim=-1)  # megatron's layout: each angle twice
        w = torch.randn(s, 2, 3, 16)
        ours = apply_rope(t, freqs)
        (grad,) = torch.autograd.grad((ours * w).sum(), t)
        ref = _apply_rotary_pos_emb_bshd(t, freqs)
        (ref_grad,) = torch.autograd.grad((ref * w).sum(), t)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
        assert (ours - t).abs().max() > 0.1  # the rotation did something
        compiled = compiled_rope(t, freqs)
        torch.testing.assert_close(compiled, ours, atol=1e-6, rtol=0)
        (compiled_grad,) = torch.autograd.grad((compiled * w).sum(), t)
        torch.testing.assert_close(compiled_grad, grad, atol=1e-6, rtol=0)
        bf16 = apply_rope(t.detach().bfloat16(), freqs)
        assert bf16.dtype == torch.bfloat16 and (bf16.float() - ours).abs().max() < 0.05
        # queries and keys in one call (SDPAttention's): each exactly apply_rope, eager and compiled
        k = torch.randn(s, 2, 1, 16)
        for both in (apply_rope_qk(t, k, freqs), *([compiled_rope_qk(t, k, freqs)] if s == 7 else [])):
            torch.testing.assert_close(both[0], ours, atol=1e-6, rtol=0)
            torch.testing.assert_close(both[1], apply_rope(k, freqs), atol=1e-6, rtol=0)


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, bottom_right=True):
    """What flash attention's varlen kernel computes (the CPU has none): each sequence's queries
    against its keys, causal aligned bottom-right (query i sees keys <= i + len_k - len_q), GQA
    by repeating k/v. (t, heads, d) in, (t, heads, v_d) out, fp32 math."""
    out = []
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1)  # (heads, ., d)
        repeat = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        shift = (e - c) - (b - a) if bottom_right else 0
        allowed = torch.arange(e - c)[None, :] <= torch.arange(b - a)[:, None] + shift
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_prefixes_equal_the_global_mask(cp):
    """The GPU path of context parallelism (padded rows): each CP rank's two chunks as query
    sequences against their key prefixes of the gathered keys, through a varlen kernel with
    bottom-right causal alignment, equal causal attention over the whole sequence restricted
    to that rank's tokens (what the masked path computes), for every rank; GQA, two rows,
    and v's head size != q/k's (MLA). Top-left alignment (the wrong convention) differs."""
    from common.model.attention_cp import context_parallel_prefix_attention

    torch.manual_seed(0)
    h, b, heads, groups, d, dv = 3, 2, 4, 2, 8, 6
    s = 2 * h  # one rank's tokens: two chunks
    full = 2 * cp * h
    q_all = torch.randn(full, b, heads, d)
    k_all, v_all = torch.randn(full, b, groups, d), torch.randn(full, b, groups, dv)
    # ground truth: causal attention over the whole sequence
    rep = heads // groups
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_all.permute(1, 2, 0, 3),
        k_all.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
        v_all.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
        is_causal=True,
    ).permute(2, 0, 1, 3)  # (full, b, heads, dv)

    def positions(r):  # global positions of rank r's tokens (common/rl/batch.py:context_parallel_slice)
        return torch.cat([torch.arange(r * h, (r + 1) * h), torch.arange((2 * cp - 1 - r) * h, (2 * cp - r) * h)])

    gathered_k = torch.cat([k_all[positions(r)] for r in range(cp)])  # rank after rank, as the all-gather
    gathered_v = torch.cat([v_all[positions(r)] for r in range(cp)])
    for rank in range(cp):
        mine = positions(rank)
        out = context_parallel_prefix_attention(q_all[mine], gathered_k, gathered_v, cp, rank, varlen_reference)
        assert out.shape == (s, b, heads, dv)
        torch.testing.assert_close(out, ref[mine], atol=1e-6, rtol=1e-5)
        top_left = context_parallel_prefix_attention(
            q_all[mine], gathered_k, gathered_v, cp, rank, lambda *a: varlen_reference(*a, bottom_right=False)
        )
        assert (top_left - ref[mine]).abs().max() > 1e-2  # every rank's second chunk starts past position 0


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_packed_prefixes_equal_per_sample_attention(cp):
    """The same for packed rows under CP (megatron's THD + CP layout): with the index and
    boundaries of context_parallel_packed_prefixes, a varlen kernel (bottom-right causal) over
    each rank's chunks of every sample equals each sample's own causal attention, restricted
    to that rank's tokens, for every rank (samples of different lengths, GQA); a layout that
    takes the gathered keys as if they were in sample order fails."""
    from common.model.attention_cp import context_parallel_packed_prefixes
    from common.rl.batch import thd_context_parallel_layout

    torch.manual_seed(0)
    lengths = [4 * cp, 2 * cp, 6 * cp, 2 * cp]  # multiples of 2cp, as the packing pads them
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    total, heads, groups, d, dv = int(cu[-1]), 4, 2, 8, 6
    q_all, k_all = torch.randn(total, heads, d), torch.randn(total, groups, d)
    v_all = torch.randn(total, groups, dv)
    ref = torch.cat(
        [
            varlen_reference(
                q_all[a:b], k_all[a:b], v_all[a:b], torch.tensor([0, b - a]), torch.tensor([0, b - a]), b - a, b - a
            )
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
    )  # each sample alone

    def mine(r):  # where rank r's tokens sit in the whole row
        sample, position = thd_context_parallel_layout(cu, cp, r, total // cp)
        return cu.long()[sample] + position

    gathered_k = torch.cat([k_all[mine(r)] for r in range(cp)])
    gathered_v = torch.cat([v_all[mine(r)] for r in range(cp)])
    for rank in range(cp):
        index, cu_q, cu_k = context_parallel_packed_prefixes(cu, cp, rank, total)
        assert int(cu_q[-1]) == total // cp and int(cu_k[-1]) == len(index)
        out = varlen_reference(q_all[mine(rank)], gathered_k[index], gathered_v[index], cu_q, cu_k, 0, 0)
        torch.testing.assert_close(out, ref[mine(rank)], atol=1e-6, rtol=1e-5)
        wrong = varlen_reference(
            q_all[mine(rank)], k_all[index], v_all[index], cu_q, cu_k, 0, 0
        )  # keys in sample order
        assert (wrong - ref[mine(rank)]).abs().max() > 1e-2


@pytest.mark.parametrize("cp", [2, 3])
def test_split_prefix_attention_equals_causal_attention(cp):
    """Context parallelism's split attention (common/model/attention_cp.py): each CP rank's two chunks
    against the keys of the earlier chunks (no mask) and their own (causal), one kernel call
    per part merged by log-sum-exp, here with torch's CPU flash kernels (the GPU runs cuDNN's
    through the same code): output and the gradients of q and of the gathered k / v equal
    causal attention over the whole sequence restricted to each rank (fp32), GQA, two rows."""
    from common.model.attention_cp import split_prefix_attention

    torch.manual_seed(0)
    h, b, heads, groups, d = 3, 2, 4, 2, 8
    full = 2 * cp * h
    q_all, k_all, v_all = (
        torch.randn(full, b, n, d, dtype=torch.float64).float().requires_grad_() for n in (heads, groups, groups)
    )
    rep, scale = heads // groups, d**-0.5
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_all.permute(1, 2, 0, 3),
        k_all.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
        v_all.permute(1, 2, 0, 3).repeat_interleave(rep, 1),
        is_causal=True,
        scale=scale,
    ).permute(2, 0, 1, 3)
    weights = torch.randn(ref.shape)
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q_all, k_all, v_all))

    def positions(r):  # global positions of rank r's tokens (common/rl/batch.py:context_parallel_slice)
        return torch.cat([torch.arange(r * h, (r + 1) * h), torch.arange((2 * cp - 1 - r) * h, (2 * cp - r) * h)])

    order = torch.cat([positions(r) for r in range(cp)])  # the all-gather's order: rank after rank
    grads = [torch.zeros_like(x) for x in (q_all, k_all, v_all)]
    for rank in range(cp):
        mine = positions(rank)
        q = q_all.detach()[mine].requires_grad_()
        k, v = (x.detach()[order].requires_grad_() for x in (k_all, v_all))
        out = split_prefix_attention(q, k, v, cp, rank, scale, "cpu")
        torch.testing.assert_close(out, ref[mine].detach(), atol=1e-6, rtol=1e-5)
        dq, dk, dv = torch.autograd.grad((out * weights[mine]).sum(), (q, k, v))
        grads[0][mine] += dq
        grads[1][order] += dk  # the backward's reduce-scatter, by hand
        grads[2][order] += dv
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
