"""Tests of --true-on-policy's plumbing (common/model/exact.py) on the CPU, fp32.

    .venv/bin/python -m pytest -q tests/test_exact.py

vLLM's kernels exist on GPUs only (tests/gpu/test_true_on_policy_gpu.py: the trainer's logprobs equal vLLM's bit
for bit there). Here exact.KERNELS holds torch references with vLLM's signatures and data layouts, among them a
paged attention that reads keys and values only through the block table, the sequence lengths and cu_seqlens
(pages of 4 tokens, so sequences span several). Checked:
  - a converted Qwen2 (q/k/v bias, GQA) gives the unconverted model's logits and parameter gradients (<= 1e-5),
    padded rows and packed rows (samples of 3, 9 and 6 tokens), Qwen3 (q/k norms, head_dim 32 != 64 / 4) padded
    rows, and every swapped op ran its kernel (counted):
    the token layouts, positions, pages and the straight-through gradients are right;
  - a kernel answer that is off shows in the logits while the gradient stays the reference's (the forward is the
    kernel's, the backward the reference function's);
  - at --tp 2, with and without --sp (tests/exact_worker.py under torchrun): the same logits, log-probabilities
    and gradients, each linear kernel multiplying this rank's shard, the log-probability kernel on whole rows;
  - the log-probability hook returns the sampler kernel's values, in the time-major layout too;
  - convert refuses a module it has no kernel for (MoE), and the flag's refusals at start-up.
"""

import argparse
import collections
import types

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import LayoutLaunches
from tests.test_attention import dist_world_of_one  # noqa: F401 (a fixture)

CALLS = collections.Counter()


def counted(name, fn):
    def call(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)

    return call


def rotary(positions, query, key, head_size, cos_sin, is_neox):  # vLLM's ops.rotary_embedding, in place
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[positions, :half][:, None], cos_sin[positions, half:][:, None]
    for x in (query, key):
        v = x.view(x.shape[0], -1, head_size)
        a, b = v[..., :half].clone(), v[..., half:].clone()
        v[..., :half], v[..., half:] = a * cos - b * sin, b * cos + a * sin


def paged_attention(q, k, v, out, cu_seqlens_q, seqused_k, softmax_scale, block_table, **unused):
    """vLLM's unified_attention, causal: each sequence's keys and values read from its pages."""
    bs = k.shape[1]
    for i in range(len(seqused_k)):
        start, end, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        pages = block_table[i, : (n + bs - 1) // bs].long()
        keys, values = (c[pages].reshape(-1, *c.shape[2:])[:n] for c in (k, v))  # (n, groups, d)
        repeat = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        queries = q[start:end]  # the last end - start positions of the sequence
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * softmax_scale
        at = torch.arange(n - (end - start), n)[:, None] >= torch.arange(n)[None, :]
        scores = scores.masked_fill(~at, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def silu_and_mul(out, y):
    d = y.shape[-1] // 2
    out.copy_(F.silu(y[..., :d]) * y[..., d:])


REFERENCES = dict(
    linear=lambda x, w, b=None: x @ w.t() + (0 if b is None else b),
    rms_norm=lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps),
    rotary=rotary,
    attention=paged_attention,
    silu_and_mul=silu_and_mul,
    token_logprobs=lambda rows, ids: torch.log_softmax(rows.float(), -1).gather(-1, ids),
)


@pytest.fixture
def reference_kernels(monkeypatch):
    from common.model import exact
    from common.rl import logprobs

    CALLS.clear()
    monkeypatch.setattr(exact, "KERNELS", types.SimpleNamespace(**{k: counted(k, f) for k, f in REFERENCES.items()}))
    monkeypatch.setattr(exact, "ENGINE", {"block_size": 4, "is_neox": True, "logits_dtype": torch.float32})
    monkeypatch.setattr(logprobs, "EXACT_TOKEN_LOGPROBS", exact.token_logprobs)
    return exact


def model_pair(tmp_path, name="qwen2"):
    """(spec, [chunks, chunks]): two copies of a tiny model with the same weights."""
    from common.model.gpt import build_model, load_hf_spec
    from common.model.weights_load import load_hf_weights
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model(name, str(tmp_path / name))
    spec = load_hf_spec(str(tmp_path / name))
    pair = []
    for _ in range(2):
        chunks = build_model(spec)
        load_hf_weights(chunks, spec, str(tmp_path / name))
        pair.append(chunks)
    return spec, pair


def rope_table(spec):  # vLLM's cos/sin cache: (positions, head_dim) = [cos | sin] of each angle
    inv = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim)
    freqs = torch.outer(torch.arange(256, dtype=torch.float), inv)
    return torch.cat((freqs.cos(), freqs.sin()), -1)


def forward(model, ids, packed=None):
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    extra = {}
    if packed is not None:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0, *torch.tensor(packed).cumsum(0).tolist()], dtype=torch.int32)
        extra["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(packed), max_seqlen_kv=max(packed)
        )
    return model(ids, positions, None, **extra)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model,packed", [("qwen2", None), ("qwen2", [3, 9, 6]), ("qwen3", None)])
def test_converted_model_equals_the_reference(dist_world_of_one, reference_kernels, tmp_path, model, packed):  # noqa: F811
    exact = reference_kernels
    spec, (plain, converted) = model_pair(tmp_path, model)
    exact.ENGINE["cos_sin"] = rope_table(spec)
    exact.convert(converted)
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (1, 18) if packed else (3, 11))
    out = {}
    for name, chunks in (("plain", plain), ("converted", converted)):
        logits = forward(chunks[0], ids, packed)
        (logits.float().square().mean()).backward()
        out[name] = logits.detach(), grads(chunks[0])
    assert (out["plain"][0] - out["converted"][0]).abs().max() <= 1e-5
    assert out["plain"][1].keys() == out["converted"][1].keys() and len(out["plain"][1]) > 10
    for name, g in out["plain"][1].items():
        assert (g - out["converted"][1][name]).abs().max() <= 1e-5 * g.abs().max(), name
    layers = spec.num_layers
    norms = 4 if spec.qk_norm else 2  # input, pre-MLP (and Qwen3's q and k norms)
    # every linear (qkv, proj, fc1, fc2 per layer, the output layer), every norm (per layer, the final one),
    # one attention and one activation per layer
    assert CALLS == {"linear": 4 * layers + 1, "rms_norm": norms * layers + 1, "rotary": layers, "attention": layers,
                     "silu_and_mul": layers}, CALLS  # fmt: skip


TP2_LAYOUTS = {"tp2": (2, ["--tp", 2]), "tp2_sp": (2, ["--tp", 2, "--sp"])}


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):  # both layouts in one torchrun launch (tests/exact_worker.py)
    from tests.tiny_models import save_tiny_hf_model

    root = tmp_path_factory.mktemp("exact")
    save_tiny_hf_model("qwen2", str(root / "qwen2"))
    return LayoutLaunches("tests/exact_worker.py", TP2_LAYOUTS, ["--model-dir", root / "qwen2"], root)


@pytest.mark.parametrize("layout", list(TP2_LAYOUTS))
def test_converted_model_at_tp2(tp2_runs, layout):
    """At --tp 2 (and with --sp) the converted model's logits, log-probabilities and gradients are the plain
    model's, each linear kernel multiplies this rank's shard (the engine's at --rollout-tp 2), and the
    log-probability kernel gets whole rows of the vocabulary (the shards gathered, as vLLM gathers them)."""
    layers = 4  # tests/tiny_models.py qwen2: hidden 64, 4 heads of 16 / 2 groups, MLP 96, vocabulary 300
    for rank, rows in enumerate(tp2_runs[layout]):
        for case, row in rows.items():
            at = f"{layout} rank {rank} {case}: {row}"
            assert row["logits"] <= 1e-5 and row["logprobs"] <= 1e-5 and row["grad_rel"] <= 1e-5, at
            assert row["grad_names"], at
            assert row["calls"] == {"linear": 4 * layers + 1, "rms_norm": 2 * layers + 1, "rotary": layers,
                                    "attention": layers, "silu_and_mul": layers, "token_logprobs": 1}, at  # fmt: skip
            # this rank's output rows: q/k/v (2 heads + 1 + 1 group of 16), o_proj and fc2 (hidden 64),
            # fc1 (gate and up halves of 96), the output layer (vocabulary padded to 512, halved)
            assert row["linear_out"] == [64, 96, 256], at
            assert row["logprob_row"] == 300, at


def test_forward_is_the_kernel_gradient_the_reference(dist_world_of_one, reference_kernels, tmp_path):  # noqa: F811
    exact = reference_kernels
    spec, (plain, converted) = model_pair(tmp_path)
    exact.ENGINE["cos_sin"] = rope_table(spec)
    exact.convert(converted)
    off = dict(REFERENCES, rms_norm=lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps) * 1.01)
    exact.KERNELS = types.SimpleNamespace(**off)
    ids = torch.randint(0, spec.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    a, b = forward(plain[0], ids), forward(converted[0], ids)
    assert (a - b).abs().max() > 1e-3  # the kernel's values reach the logits
    norm = converted[0].decoder.final_layernorm
    x = torch.randn(5, spec.hidden_size, requires_grad=True)
    norm(x).sum().backward()
    expected = torch.autograd.grad(F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps).sum(), x)[0]
    assert torch.allclose(x.grad, expected, atol=1e-6)  # the reference's gradient, not 1.01 x it


def test_logprob_hook_returns_the_kernels_values(reference_kernels):
    from common.rl.logprobs import vocab_parallel_logprobs

    exact = reference_kernels
    exact.KERNELS.token_logprobs = lambda rows, ids: torch.full(ids.shape, -3.0)
    memory = torch.randn(6, 2, 13)  # (T, B, V): the trainer's time-major logits, handed over as a (B, T, V) view
    logprobs, _ = vocab_parallel_logprobs(memory.transpose(0, 1), torch.randint(0, 10, (2, 6)), 10)
    assert logprobs.shape == (2, 6) and bool((logprobs == -3.0).all())
    exact.KERNELS.token_logprobs = REFERENCES["token_logprobs"]
    targets = torch.randint(0, 10, (2, 6))
    expected = torch.log_softmax(memory.transpose(0, 1)[..., :10], -1).gather(-1, targets[..., None])[..., 0]
    assert torch.equal(vocab_parallel_logprobs(memory.transpose(0, 1), targets, 10)[0], expected)


def test_convert_refuses_modules_without_kernels(dist_world_of_one, tmp_path):  # noqa: F811
    from common.model.exact import convert
    from common.model.gpt import build_model, load_hf_spec
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path / "moe"))
    with pytest.raises(ValueError, match="--true-on-policy: .* has no engine-exact kernels"):
        convert(build_model(load_hf_spec(str(tmp_path / "moe"))))


def test_the_flag_sets_rollout_logprobs_all(capsys, tmp_path):
    """--true-on-policy alone gets --rollout-logprobs all (where the default at --temperature 1 is the prefill
    check); another mode given with it is refused as the script parses its flags."""
    import train_grpo
    from common.run.flags_rollout import resolve_true_on_policy

    args = argparse.Namespace(true_on_policy=True, rollout_logprobs=None)
    resolve_true_on_policy(args)
    assert args.rollout_logprobs == "all"
    assert train_grpo.parse_args(["--out", str(tmp_path)]).rollout_logprobs == "prefill"
    with pytest.raises(SystemExit):
        train_grpo.parse_args(["--true-on-policy", "--rollout-logprobs", "prefill"])
    assert "--rollout-logprobs all, not prefill" in capsys.readouterr().err


def test_start_up_refusals(tmp_path):
    from common.model.gpt import load_hf_spec
    from common.run.layout_checks import _check_true_on_policy
    from common.train.guard import UsageError
    from tests.tiny_models import save_tiny_hf_model

    for name in ("qwen2", "qwen3", "qwen3_moe"):
        save_tiny_hf_model(name, str(tmp_path / name))
    ok = dict(rollout="vllm", load_rollouts=None, tp=1, cp=1, rollout_tp=1, temperature=1.0, top_p=1.0, dtype=None)
    for layout in ({}, {"tp": 2, "rollout_tp": 2}):  # nothing to refuse
        _check_true_on_policy(argparse.Namespace(**{**ok, **layout}), load_hf_spec(str(tmp_path / "qwen2")))
    for model, change, says in (
        ("qwen3_moe", {}, "has MoE layers"),
        ("qwen2", {"rollout": "cpu"}, "needs the vLLM engine"),
        ("qwen2", {"tp": 2}, "--tp 2 --rollout-tp 1: the engine's tensor-parallel split must be the trainer's"),
        ("qwen2", {"rollout_tp": 2}, "--tp 1 --rollout-tp 2"),
        ("qwen2", {"cp": 2}, "--cp 2"),
        ("qwen2", {"temperature": 0.7}, "--temperature 1 --top-p 1"),
        ("qwen2", {"dtype": "fp32"}, "bf16"),
        ("qwen2", {"lora_rank": 8}, "LoRA"),
    ):
        with pytest.raises(UsageError, match=says):
            _check_true_on_policy(argparse.Namespace(**{**ok, **change}), load_hf_spec(str(tmp_path / model)))
