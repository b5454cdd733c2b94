"""Tests of common/rl/losses.py against ground truth: hand-computed numbers, torch.log_softmax on the
full vocabulary (TP=1 in-process, TP=2 under torchrun on gloo), Monte-Carlo KL.

    .venv/bin/python -m pytest -q tests/test_rl.py
"""

import json
import math

import pytest
import torch

from common.rl.advantages import gae, group_advantages, masked_whiten
from common.rl.logprobs import vocab_parallel_logprobs
from common.rl.losses import (
    aggregate_loss,
    explained_variance,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    value_loss,
)
from tests.conftest import run_torchrun


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# -----------------------------------------------------------------------------
# vocab_parallel_logprobs


def reference_logprobs(full, targets, vocab_size, temperature):
    logp_all = torch.log_softmax(full[..., :vocab_size].float() / temperature, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("vocab_size,temperature", [(11, 1.0), (9, 0.6)])  # 9 < 11 columns: padded vocab
def test_logprobs_tp1_values_and_grads(vocab_size, temperature):
    torch.manual_seed(0)
    full = 4 * torch.randn(2, 6, 11)
    targets = torch.randint(0, vocab_size, (2, 6))
    w, w2 = torch.randn(2, 6), torch.randn(2, 6)

    ref_full = full.clone().requires_grad_(True)
    ref_lp, ref_ent = reference_logprobs(ref_full, targets, vocab_size, temperature)
    ((ref_lp * w).sum() + (ref_ent * w2).sum()).backward()

    logits = full.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size, temperature=temperature, compute_entropy=True)
    ((lp * w).sum() + (ent * w2).sum()).backward()
    close(lp, ref_lp, 1e-5)
    close(ent, ref_ent, 1e-5)
    close(logits.grad, ref_full.grad, 1e-5)
    assert (logits.grad[..., vocab_size:] == 0).all()

    # logprobs only: entropy is None, same values and logprob gradient
    logits.grad = None
    lp2, none = vocab_parallel_logprobs(logits, targets, vocab_size, temperature=temperature)
    assert none is None
    close(lp2, ref_lp, 1e-5)
    (lp2 * w).sum().backward()
    ref_full.grad = None
    (reference_logprobs(ref_full, targets, vocab_size, temperature)[0] * w).sum().backward()
    close(logits.grad, ref_full.grad, 1e-5)


def test_logprobs_bf16_input_is_computed_in_fp32():
    torch.manual_seed(1)
    full = (3 * torch.randn(2, 4, 50)).bfloat16()
    targets = torch.randint(0, 50, (2, 4))
    lp, ent = vocab_parallel_logprobs(full, targets, 50, compute_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = reference_logprobs(full, targets, 50, 1.0)  # fp32 math on the bf16 values
    close(lp, ref_lp, 1e-5)
    close(ent, ref_ent, 1e-5)


def test_logprobs_one_output_used():
    # entropy computed but only logprobs in the loss (and the other way round): the backward
    # gets None for the unused output and must give that output's gradient alone
    torch.manual_seed(3)
    full = 3 * torch.randn(2, 5, 12)
    targets = torch.randint(0, 10, (2, 5))
    w = torch.randn(2, 5)
    for pick in (0, 1):
        ref_full = full.clone().requires_grad_(True)
        (reference_logprobs(ref_full, targets, 10, 0.9)[pick] * w).sum().backward()
        logits = full.clone().requires_grad_(True)
        (vocab_parallel_logprobs(logits, targets, 10, temperature=0.9, compute_entropy=True)[pick] * w).sum().backward()
        close(logits.grad, ref_full.grad, 1e-5)


def test_logprobs_of_time_major_logits_view():
    # common/model/gpt.py's GPTModel returns its logits as a (B, T, V) view of (T, B, V) memory (no
    # transposing copy): same values as contiguous logits, and the gradient comes back in the
    # input's memory order (so the output layer's backward copies nothing either)
    torch.manual_seed(5)
    time_major = 3 * torch.randn(7, 3, 30)  # (T, B, V)
    targets = torch.randint(0, 28, (3, 7))
    w = [torch.randn(3, 7), torch.randn(3, 7)]
    view = time_major.clone().requires_grad_(True)
    contiguous = time_major.transpose(0, 1).contiguous().requires_grad_(True)
    outs, grad_strides = [], []
    for logits in (view.transpose(0, 1), contiguous):
        logits.register_hook(lambda grad: grad_strides.append(grad.stride()))  # the gradient as returned
        lp, ent = vocab_parallel_logprobs(logits, targets, 28, temperature=0.8, compute_entropy=True)
        (lp * w[0] + ent * w[1]).sum().backward()
        outs.append((lp, ent))
    close(outs[0][0], outs[1][0], 1e-6)
    close(outs[0][1], outs[1][1], 1e-6)
    assert outs[0][0].shape == (3, 7)
    close(view.grad.transpose(0, 1), contiguous.grad, 1e-6)
    assert grad_strides == [view.transpose(0, 1).stride(), contiguous.stride()]  # each in its input's order


def test_logprobs_kernels_compile_like_eager():
    # On a GPU the three helpers run torch.compile'd (common/rl/fused.py: fullgraph, automatic dynamic
    # shapes). Compile them here with inductor's CPU backend, once: they must trace as one graph
    # each, give the eager values, and take a second shape (micro-batches differ in length: the
    # recompile with symbolic sizes).
    from common.rl.fused import compile_fn
    from common.rl.logprobs import _shard_grad, _shard_max, _shard_sums

    torch.manual_seed(4)
    shard_max, shard_sums, shard_grad = (compile_fn(f.eager) for f in (_shard_max, _shard_sums, _shard_grad))
    for B, T in [(2, 5), (3, 9), (4, 6)]:
        logits = (3 * torch.randn(B, T, 40)).bfloat16()
        g = [torch.randn(B, T) for _ in range(4)]
        targets = torch.randint(0, 40, (B, T))
        max_x = _shard_max(logits, 37, 0.7)
        close(shard_max(logits, 37, 0.7), max_x, 0)
        for entropy in (True, False):
            close(shard_sums(logits, max_x, 37, 0.7, entropy), _shard_sums(logits, max_x, 37, 0.7, entropy), 1e-5)
        for grad_entropy in (g[2], None):
            args = (logits, targets, g[0], max_x, g[1], g[0], grad_entropy, g[3], 37, 0.7)
            close(shard_grad(*args).float(), _shard_grad(*args).float(), 1e-2)  # bf16 output


def test_logprobs_gradcheck_float64():
    # finite differences on the custom backward, both outputs, with padding and temperature
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3))
    fn = lambda x: vocab_parallel_logprobs(x, targets, 6, temperature=0.8, compute_entropy=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,))


def test_logprobs_tp2_torchrun(tmp_path):
    out = tmp_path / "rl_tp2.json"
    run_torchrun("tests/rl_worker.py", 2, "--out", out)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    B, T = result["B"], result["T"]
    for rank, res in enumerate(result["ranks"]):
        for name in ["no_padding", "padding_in_last_shard", "last_shard_all_padding", "logprobs_only", "bf16_input"]:
            case = res[name]
            assert case["logprobs_dtype"] == "torch.float32", (rank, name)
            assert case["logprobs_err"] < 1e-5, (rank, name, case)
            assert case["entropy_err"] < 1e-5, (rank, name, case)
            assert case["entropy_is_none"] == (name == "logprobs_only")
            assert case["pad_grad_max"] == 0.0, (rank, name, case)
            # bf16 gradients carry bf16 rounding (8 mantissa bits) of values up to ~|w| + |w2|
            assert case["grad_err"] < (2e-2 if name == "bf16_input" else 1e-5), (rank, name, case)
        assert res["bf16_input"]["grad_dtype"] == "torch.bfloat16"
        # two (B, T)-sized all-reduces per call (max, then one stacked sum of <= 3 (B, T) tensors)
        assert res["num_collectives"] == 2 * 5
        assert res["max_collective_numel"] <= 3 * B * T


# -----------------------------------------------------------------------------
# masked reductions


def test_masked_reductions():
    x = torch.tensor([[1.0, 2.0, float("-inf")], [4.0, 5.0, 6.0]])  # -inf sits on a masked position
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    close(masked_sum(x, mask), 13.0)
    close(masked_mean(x, mask), 3.25)
    close(masked_mean(x, mask, dim=-1), [1.5, 5.0])
    close(masked_sum(x, mask, dim=0), [5.0, 2.0, 6.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)

    # valid values 1, 2, 4, 6: mean 3.25, population var (5.0625+1.5625+0.5625+7.5625)/4 = 3.6875
    white = masked_whiten(torch.where(mask.bool(), x, 0.0), mask, eps=0.0)
    s = math.sqrt(3.6875)
    close(white, [[-2.25 / s, -1.25 / s, 0.0], [0.75 / s, 0.0, 2.75 / s]])


# -----------------------------------------------------------------------------
# advantages


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0, 3.0, 6.0])  # 3 prompts x G=3
    # group 0: mean 1/3, population std sqrt(2/9) -> [sqrt 2, -1/sqrt 2, -1/sqrt 2]
    # group 1: all equal -> 0; group 2: mean 3, population std sqrt(6) -> [-3, 0, 3] / sqrt 6
    s2, s6 = math.sqrt(2), math.sqrt(6)
    close(group_advantages(rewards, 3, eps=1e-12), [s2, -1 / s2, -1 / s2, 0, 0, 0, -3 / s6, 0, 3 / s6], 1e-6)
    close(group_advantages(rewards, 3, normalize_std=False), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0, -3, 0, 3], 1e-6)
    # equal non-round rewards give exactly 0, not rounding noise amplified by 1/eps
    assert (group_advantages(torch.full((4,), 0.1), 4) == 0).all()
    # G = 1 is defined (population std 0): advantage 0
    assert (group_advantages(torch.tensor([0.3, 0.7]), 1) == 0).all()


def test_gae_hand_computed():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); rows of length 3, 2 and 3 with a masked middle token
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.5, 9.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.6], [1.0, 0.5, 8.0], [0.2, 7.0, 0.3]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - .6 = .4; d1 = .9*.6 - .4 = .14, A1 = .14 + .72*.4 = .428;
    #        d0 = .9*.4 - .5 = -.14, A0 = -.14 + .72*.428 = .16816
    # row 1: A1 = 2 - .5 = 1.5; d0 = .9*.5 - 1 = -.55, A0 = -.55 + .72*1.5 = .53
    # row 2: A2 = 1 - .3 = .7; token 1 skipped; d0 = .5 + .9*.3 - .2 = .57, A0 = .57 + .72*.7 = 1.074
    close(adv, [[0.16816, 0.428, 0.4], [0.53, 1.5, 0.0], [1.074, 0.0, 0.7]], 1e-6)
    close(ret, [[0.66816, 0.828, 1.0], [1.53, 2.0, 0.0], [1.274, 0.0, 1.0]], 1e-6)

    # gamma = lam = 1: A_t = (sum of the remaining rewards) - V_t, the Monte-Carlo advantage
    adv1, ret1 = gae(rewards, values, mask)
    close(adv1, [[0.5, 0.6, 0.4], [1.0, 1.5, 0.0], [1.3, 0.0, 0.7]], 1e-6)
    close(ret1, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0], [1.5, 0.0, 1.0]], 1e-6)


def test_gae_packed_rows_lam_0_and_1():
    # The layout of common/rl/batch.py pack_sequences: prompt positions masked at the start of a
    # row, the response, then right padding. Rows end at different positions (a 3-token
    # response, a 1-token one, an empty row). Masked positions hold garbage (nan values, stray
    # rewards) that must not leak into any valid token. gamma 0.5.
    nan = float("nan")
    rewards = torch.tensor([[9.0, 0.0, -0.1, 1.0, 5.0], [7.0, 0.0, 1.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[nan, 0.2, 0.5, 0.8, nan], [nan, nan, 0.3, nan, nan], [nan] * 5])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])

    # lam = 0: one-step TD, A_t = r_t + gamma V_next - V_t, V_next = 0 after the last token
    # row 0: A3 = 1 - .8 = .2; A2 = -.1 + .5*.8 - .5 = -.2; A1 = 0 + .5*.5 - .2 = .05; row 1: 1 - .3
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.0)
    close(adv, [[0, 0.05, -0.2, 0.2, 0], [0, 0, 0.7, 0, 0], [0] * 5], 1e-6)
    close(ret, [[0, 0.25, 0.3, 1.0, 0], [0, 0, 1.0, 0, 0], [0] * 5], 1e-6)

    # lam = 1: returns are the discounted rewards-to-go, whatever the values
    # row 0: R3 = 1, R2 = -.1 + .5 = .4, R1 = 0 + .5*.4 = .2; A = R - V
    adv1, ret1 = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    close(ret1, [[0, 0.2, 0.4, 1.0, 0], [0, 0, 1.0, 0, 0], [0] * 5], 1e-6)
    close(adv1, [[0, 0.0, -0.1, 0.2, 0], [0, 0, 0.7, 0, 0], [0] * 5], 1e-6)
    assert torch.isfinite(adv).all() and torch.isfinite(ret1).all()


# -----------------------------------------------------------------------------
# policy loss and aggregation


def test_dual_clip_hand_computed():
    """c = 3: for A < 0 the loss is capped at 3|A| (gradient 0 there); A > 0 is untouched."""
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    old = torch.zeros(1, 4)
    logprobs = ratios.log().requires_grad_(True)
    plain, _ = policy_loss(logprobs, old, adv)
    close(plain, [[5.0, 2.0, -1.2, 1.6]], 1e-6)  # r=5,A=-1: -min(-5, -1.2) = 5; r=.5,A=-2: clip .8 -> 1.6
    loss, clipped = policy_loss(logprobs, old, adv, dual_clip=3.0)
    close(loss, [[3.0, 2.0, -1.2, 1.6]], 1e-6)  # only r=5, A=-1 exceeds 3 * |A|
    assert clipped.tolist() == [[True, False, True, True]]
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 2.0, 0.0, 0.0]], 1e-6)  # d(-r A)/dlogp = -r A = 2 for r=2, A=-1


def test_gspo_sequence_ratio_hand_computed():
    """GSPO: one ratio per row, exp of the mean log-ratio over the row's masked tokens; its
    gradient, aggregated per sequence, is the paper's s_i * A_i * mean_t grad log pi(y_t)."""
    old = torch.tensor([[-1.1, -2.3, -1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.9, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0])
    s = math.exp((0.1 + 0.3 + 0.1) / 3)  # 1.18: the masked mean of (logprob - old); the pad's 5.0 is left out
    loss, clipped = policy_loss(logprobs, old, adv, clip_low=0.2, clip_high=0.3, sequence_mask=mask)
    close(loss[:, :3], [[-s] * 3], 1e-6)
    assert not clipped[:, :3].any()
    aggregate_loss(loss, mask, "seq_mean_token_mean").backward()
    close(logprobs.grad[:, :3], [[-s / 3] * 3], 1e-6)  # d/dlogp_t of -s * A with s = exp(mean): -s/3
    assert logprobs.grad[0, 3] == 0  # the padding token: outside the mean and the loss

    # the same gradient as the sequence-level objective written out directly
    lp2 = logprobs.detach().clone().requires_grad_(True)
    seq_ratio = torch.exp(((lp2 - old) * mask).sum() / mask.sum())
    (-seq_ratio * adv).sum().backward()
    close(lp2.grad, logprobs.grad, 1e-6)

    # clipped per sequence: s = exp(0.2) > 1 + 0.1, A > 0 -> every token of the row clipped, no gradient
    lp3 = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss3, clipped3 = policy_loss(lp3, torch.tensor([[-1.1, -2.3]]), adv, clip_high=0.1, sequence_mask=torch.ones(1, 2))
    close(loss3, [[-1.1, -1.1]], 1e-6)
    assert clipped3.all()
    loss3.sum().backward()
    close(lp3.grad, [[0.0, 0.0]], 0)


def test_policy_loss_hand_computed():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5, 1.5, 1.25]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0, 2.0]])
    old = torch.randn(1, 6)
    logprobs = (old + ratios.log()).requires_grad_(True)
    loss, clipped = policy_loss(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    # r=1.5,A=1 -> clipped at 1.28; r=.5,A=-1 -> clipped at .8; r=1.1 inside; r=.5,A=1 -> unclipped
    # (min keeps the lower 0.5); r=1.5,A=-1 -> unclipped (-1.5 < -1.28); r=1.25 < 1.28 inside
    close(loss, [[-1.28, 0.8, -1.1, -0.5, 1.5, -2.5]], 1e-6)
    assert clipped.tolist() == [[True, True, False, False, False, False]]
    loss.sum().backward()
    # d(-ratio * A)/dlogp = -ratio * A where unclipped; exactly 0 where clipped
    close(logprobs.grad, [[0.0, 0.0, -1.1, -0.5, 1.5, -2.5]], 1e-6)

    # symmetric clip 0.2 clips r = 1.25 too
    _, clipped_sym = policy_loss(logprobs, old, adv)
    assert clipped_sym.tolist() == [[True, True, False, False, False, True]]

    # (B,) advantages broadcast over tokens; is_weights multiply, detached
    lp = torch.randn(2, 3, requires_grad=True)
    old2 = lp.detach() + 0.1 * torch.randn(2, 3)
    seq_adv = torch.tensor([0.5, -2.0])
    a, _ = policy_loss(lp, old2, seq_adv)
    b, _ = policy_loss(lp, old2, seq_adv[:, None].expand(2, 3))
    close(a, b, 0)
    w = torch.rand(2, 3, requires_grad=True)
    c, _ = policy_loss(lp, old2, seq_adv, is_weights=w)
    close(c, a * w, 1e-7)
    c.sum().backward()
    assert w.grad is None


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_aggregate_loss_hand_computed():
    close(aggregate_loss(PER_TOKEN, MASK, "token_mean"), 18 / 5)  # (1+2+4+5+6) / 5
    close(aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_mean"), 3.25)  # (1.5 + 5) / 2
    close(aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_sum_norm", max_len=4), 2.25)  # (3/4 + 15/4) / 2
    close(aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_sum_norm"), 3.0)  # default max_len = T = 3
    with pytest.raises(ValueError):
        aggregate_loss(PER_TOKEN, MASK, "seq_mean")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_loss_microbatches_and_dp_sum_to_full_batch(mode):
    # 8 sequences of very different lengths; 2 "DP ranks" x 2 micro-batches of 2 sequences each
    torch.manual_seed(3)
    B, T, max_len = 8, 10, 10
    per_token = torch.randn(B, T, dtype=torch.float64)
    lengths = torch.tensor([1, 10, 3, 7, 2, 9, 5, 4])
    mask = (torch.arange(T) < lengths[:, None]).long()
    full = aggregate_loss(per_token, mask, mode, max_len=max_len)

    num_tokens, num_seqs = mask.sum(), B  # global: what an all_reduce over DP of local counts gives
    total = 0.0
    for dp_rank in range(2):
        for micro in range(2):
            rows = slice(4 * dp_rank + 2 * micro, 4 * dp_rank + 2 * micro + 2)
            width = int(lengths[rows].max())  # micro-batches padded only to their own longest row
            total = total + aggregate_loss(
                per_token[rows, :width],
                mask[rows, :width],
                mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                max_len=max_len,
            )
    close(total, full, 1e-12)

    # the local defaults would NOT sum to the full-batch loss: the global normalisers matter
    local_total = sum(
        aggregate_loss(per_token[i : i + 2], mask[i : i + 2], mode, max_len=max_len) for i in range(0, B, 2)
    )
    assert abs(local_total - full) > 0.5 * abs(full)


# -----------------------------------------------------------------------------
# KL


def test_kl_penalty_hand_computed():
    logp, logq = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    close(kl_penalty(logp, logq, "k1"), [ln2])  # log p/q
    close(kl_penalty(logp, logq, "k2"), [0.5 * ln2**2])  # 0.2402265
    close(kl_penalty(logp, logq, "k3"), [0.5 + ln2 - 1])  # q/p - log(q/p) - 1 = 0.1931472
    for kind in ["k1", "k2", "k3"]:
        close(kl_penalty(logq, logq, kind), [0.0])
    with pytest.raises(ValueError):
        kl_penalty(logp, logq, "k4")


def test_kl_penalty_monte_carlo():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    exact_kl = float((p * (p / q).log()).sum())  # 0.5 ln 2.5 + 0.2 ln 0.4 = 0.2748872
    close(exact_kl, 0.5 * math.log(2.5) + 0.2 * math.log(0.4), 1e-12)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[samples], q.log()[samples]
    means = {kind: kl_penalty(logp, logq, kind).mean().item() for kind in ["k1", "k2", "k3"]}
    # k1 and k3 are unbiased (std errors ~0.0016 and ~0.001 here)
    assert abs(means["k1"] - exact_kl) < 0.01
    assert abs(means["k3"] - exact_kl) < 0.01
    # k2 is biased: E_p[0.5 (log p/q)^2] = 0.5 * 0.7 * ln(2.5)^2 = 0.2938594, not the KL
    assert abs(means["k2"] - 0.5 * 0.7 * math.log(2.5) ** 2) < 0.01
    assert abs(means["k2"] - exact_kl) > 0.015


# -----------------------------------------------------------------------------
# critic


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 0.5, 0.6, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, clipped = value_loss(values, old, returns, mask, clip=0.2)
    # v=1 -> clip .7: max(1, 1.69); v=0 -> clip .3: max(0, .09); v=.5: .25; v=.6 within: 1.96;
    # v=0 -> clip .3, ret 2: max(4, 2.89) unclipped larger; last token masked
    close(loss, [[0.845, 0.045, 0.125, 0.98, 2.0, 0.0]], 1e-6)
    assert clipped.tolist() == [[True, True, False, False, False, False]]
    loss.sum().backward()
    # clipped tokens: the max picks the clipped term, whose V is outside the clip range -> 0 grad
    close(values.grad, [[0.0, 0.0, 0.5, -1.4, -2.0, 0.0]], 1e-6)
    # within the clip range nothing is clipped, although in fp32 old + (V - old) is not V here (a
    # PPO replay's vf_clip_frac counted such a token at one layout and not at another)
    values, old = torch.tensor([[0.052956532686948776]]), torch.tensor([[0.13004156947135925]])
    assert (old + (values - old)).item() != values.item()
    assert not value_loss(values, old, torch.zeros(1, 1), torch.ones(1, 1), clip=0.2)[1].any()


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 5), returns, mask) == pytest.approx(0.0)
    # R - V = [1, 0, 0, -1]: var 0.5; var R = 1.25 -> 1 - 0.4
    values = torch.tensor([[0.0, 2.0, 3.0, 5.0, -7.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(0.6)
    assert math.isnan(explained_variance(values, torch.ones(1, 5), mask))
