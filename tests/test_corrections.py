"""Tests of common/rl/corrections.py (--rollout-correction) and the on-policy check of common/train/guard.py,
against numbers worked out by hand or with plain Python loops over the formulas (never the functions under test):

    .venv/bin/python -m pytest -q tests/test_corrections.py

- each correction's weights on small tensors: tis, seq-mask-is (product ratio), icepop, geo-mask (geometric mean),
  decoupled (masked above the cap), seq-offpolicy-mask (DeepSeek-V3.2: negative advantage and mean KL > delta), on
  padded rows and on packed rows (seq_ids) alike; tokens without an engine logprob count as ratio 1;
- the weights reach policy_loss's per-token loss; the logged metrics (masked shares, weight mean, ratio quantiles);
- the flags' resolution: defaults, --tis-cap as tis, what is refused;
- on_policy_failure: which numbers it checks, against which bound.
The runs of train_grpo.py and train_ppo.py with each flag: tests/test_train_grpo.py, tests/test_train_ppo.py.
"""

import math

import pytest
import torch

from common.rl.corrections import (
    correction_weights,
    decoupled_weights,
    geometric_mask,
    icepop_weights,
    loss_weights,
    offpolicy_sequence_mask,
    quantiles,
    resolve_correction,
    sequence_mask_is_weights,
    truncated_is_weights,
    uses_old_logprobs,
)
from common.rl.losses import policy_loss, sequence_means
from common.train.guard import on_policy_failure


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# per-token ratios r = pi_old / pi_behav of two rows of 3 response tokens and a pad; log r is what the functions take
RATIOS = [[1.5, 0.4, 1.1, 1.0], [0.9, 3.0, 1.0, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # row 0: 3 tokens, row 1: 2


def log_ratio():
    return torch.tensor(RATIOS).log() * MASK


def test_truncated_is_weights():
    old = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]], requires_grad=True)
    rollout = torch.zeros(1, 3)
    w = truncated_is_weights(old, rollout, cap=2.0)
    close(w, [[1.0, 2.0, 0.5]])  # pi_old / pi_rollout = 1, 3 -> capped at 2, 0.5
    assert not w.requires_grad


def test_icepop_keeps_the_ratio_inside_the_band_and_masks_both_sides():
    expected = [[r if 0.5 <= r <= 2.0 else 0.0 for r in row] for row in RATIOS]  # 0.4 and 3.0 fall out
    close(
        icepop_weights(log_ratio(), 0.5, 2.0) * MASK,
        [[e * m for e, m in zip(er, mr)] for er, mr in zip(expected, MASK.tolist())],
    )
    assert expected == [[1.5, 0.0, 1.1, 1.0], [0.9, 0.0, 1.0, 1.0]]


def test_sequence_masked_is_weights_use_the_product_ratio():
    products = [math.prod(r for r, m in zip(row, mrow) if m) for row, mrow in zip(RATIOS, MASK.tolist())]
    assert products == pytest.approx([0.66, 2.7])  # 1.5 * 0.4 * 1.1, 0.9 * 3.0
    w = sequence_mask_is_weights(log_ratio(), MASK, low=0.5, high=2.0)
    close(w, [[0.66] * 4, [0.0] * 4])  # every token of row 0 gets R = 0.66; row 1's 2.7 > 2: masked
    w = sequence_mask_is_weights(log_ratio(), MASK, low=0.7, high=3.0)
    close(w, [[0.0] * 4, [2.7] * 4])  # the lower end counts too
    # a product far out of range neither overflows nor passes: 40 tokens of ratio 10
    long = torch.full((1, 40), math.log(10.0))
    assert sequence_mask_is_weights(long, torch.ones(1, 40), 0.5, 2.0).abs().sum() == 0


def test_geometric_mask_uses_the_mean_log_ratio():
    geo = [
        math.exp(sum(math.log(r) for r, m in zip(row, mrow) if m) / sum(mrow))
        for row, mrow in zip(RATIOS, MASK.tolist())
    ]
    assert geo == pytest.approx([0.66 ** (1 / 3), 2.7**0.5])  # 0.8707, 1.6432
    close(geometric_mask(log_ratio(), MASK, low=1 / 1.8, high=1.8), [[1.0] * 4, [1.0] * 4])
    close(geometric_mask(log_ratio(), MASK, low=0.9, high=1.8), [[0.0] * 4, [1.0] * 4])  # 0.87 < 0.9
    close(geometric_mask(log_ratio(), MASK, low=0.5, high=1.6), [[1.0] * 4, [0.0] * 4])  # 1.64 > 1.6
    # a long sequence of small per-token drifts passes where its product would not (the "length trap")
    drift = torch.full((1, 200), math.log(1.0005))
    assert geometric_mask(drift, torch.ones(1, 200), 1 / 1.001, 1.001).all()
    assert sequence_mask_is_weights(drift, torch.ones(1, 200), 1 / 1.001, 1.001).sum() == 0  # 1.0005^200 = 1.105


def test_decoupled_weights_mask_above_the_cap():
    close(decoupled_weights(log_ratio(), high=2.0), [[1.5, 0.4, 1.1, 1.0], [0.9, 0.0, 1.0, 1.0]])
    close(decoupled_weights(log_ratio(), high=5.0), RATIOS)  # AReaL's cap: nothing this close is masked


def test_offpolicy_sequence_mask_padded_and_packed():
    """DeepSeek-V3.2 eq. 9: masked where A < 0 and the sequence's mean log(pi_behav / pi) > delta."""
    behav = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0], [-3.0, -0.2, -0.1, 0.0]])
    current = torch.tensor([[-1.5, -2.5, -1.5, 9.0], [-1.2, -1.0, 5.0, 0.0], [-3.0, -0.2, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    kl = [
        sum(b - c for b, c, m in zip(br, cr, mr) if m) / sum(mr)
        for br, cr, mr in zip(*(x.tolist() for x in (behav, current, mask)))
    ]
    assert kl == pytest.approx([2.0 / 3, 0.1, 0.0])
    advantages = torch.tensor([-1.0, -1.0, -1.0])
    keep = offpolicy_sequence_mask(current, behav, mask, advantages, delta=0.5)
    close(keep, [[0.0] * 4, [1.0] * 4, [1.0] * 4])  # only row 0: A < 0 and 0.667 > 0.5
    close(offpolicy_sequence_mask(current, behav, mask, -advantages, delta=0.5), torch.ones(3, 4))  # A > 0: kept
    close(offpolicy_sequence_mask(current, behav, mask, advantages, delta=0.05), [[0.0] * 4, [0.0] * 4, [1.0] * 4])
    # per-token advantages (PPO's GAE): only the negative tokens of a far-off sequence
    token_adv = torch.tensor([[0.5, -0.2, 0.1, 0.0], [-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, 0.0]])
    close(
        offpolicy_sequence_mask(current, behav, mask, token_adv, delta=0.5), [[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    )
    # rows 0 and 1 packed into one row (ids 0 and 1), row 2 alone (id 4): the same mask on the same tokens
    packed = lambda x: torch.tensor([[*x[0, :3].tolist(), *x[1, :2].tolist()], [*x[2, :3].tolist(), 0.0, 0.0]])  # noqa: E731
    seq_ids = torch.tensor([[0, 0, 0, 1, 1], [4, 4, 4, 5, 5]])
    packed_mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0]])
    packed_adv = torch.full((2, 5), -1.0)
    keep = offpolicy_sequence_mask(packed(current), packed(behav), packed_mask, packed_adv, 0.5, seq_ids=seq_ids)
    close(keep * packed_mask, [[0, 0, 0, 1, 1], [1, 1, 1, 0, 0]])
    close(
        sequence_means(packed(behav) - packed(current), packed_mask, seq_ids) * packed_mask,
        [[2 / 3] * 3 + [0.1] * 2, [0, 0, 0, 0, 0]],
    )


def test_correction_weights_and_metrics():
    """The batch's weights and their metrics, hand-computed: a token without an engine logprob counts as ratio 1."""
    old = torch.tensor([[math.log(1.5), math.log(0.4), math.log(1.1), 0.0], [math.log(0.9), math.log(3.0), 0.0, 0.0]])
    engine = torch.zeros(2, 4)
    rollout_mask = MASK.clone()
    rollout_mask[0, 2] = 0  # row 0's third token brought no engine logprob: ratio 1, not 1.1
    weights, metrics = correction_weights("icepop", old, engine, rollout_mask, MASK, low=0.5, high=2.0)
    close(weights * MASK, [[1.5, 0.0, 1.0, 0.0], [0.9, 0.0, 0.0, 0.0]])
    kept = [1.5, 0.0, 1.0, 0.9, 0.0]  # the weights of the 5 loss tokens
    assert metrics["correction_weight_mean"] == pytest.approx(sum(kept) / 5)
    assert metrics["correction_masked_frac"] == pytest.approx(2 / 5)
    assert metrics["correction_masked_seq_frac"] == 1.0  # both rows lost a token
    ratios = sorted([1.5, 0.4, 0.9, 3.0])  # the 4 tokens with an engine logprob
    for q, key in ((0.05, "engine_ratio_p5"), (0.5, "engine_ratio_p50"), (0.95, "engine_ratio_p95")):
        at = q * 3
        expected = ratios[int(at)] + (at - int(at)) * (ratios[min(int(at) + 1, 3)] - ratios[int(at)])
        assert metrics[key] == pytest.approx(expected), key
    weights, metrics = correction_weights("tis", old, engine, rollout_mask, MASK, high=2.0)
    close(weights * MASK, [[1.5, 0.4, 1.0, 0.0], [0.9, 2.0, 0.0, 0.0]])
    assert metrics["correction_masked_frac"] == 0.0 and metrics["correction_masked_seq_frac"] == 0.0
    weights, metrics = correction_weights("seq-mask-is", old, engine, rollout_mask, MASK, low=0.5, high=2.0)
    close(weights * MASK, [[0.6, 0.6, 0.6, 0.0], [0.0, 0.0, 0.0, 0.0]])  # 1.5 * 0.4 * 1; 2.7 out
    assert metrics["correction_masked_seq_frac"] == 0.5 and metrics["correction_masked_frac"] == pytest.approx(2 / 5)
    weights, metrics = correction_weights("seq-offpolicy-mask", old, engine, rollout_mask, MASK, low=None, high=None)
    assert weights.eq(1).all() and sorted(metrics) == ["engine_ratio_p5", "engine_ratio_p50", "engine_ratio_p95"]
    for mode in ("none", "tis"):  # "none", or GRPO's on-policy steps (no old logprobs): ones, nothing logged
        weights, metrics = correction_weights(mode, None if mode == "tis" else old, engine, rollout_mask, MASK)
        assert weights.eq(1).all() and metrics == {}


def test_tis_weights_are_the_older_flags_bit_for_bit():
    old, engine = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), torch.randn(4, 6)
    mask = torch.ones(4, 6)
    weights, _ = correction_weights("tis", old, engine, mask, mask, high=1.3)
    assert torch.equal(weights, truncated_is_weights(old, engine, cap=1.3))


def test_weights_reach_the_policy_loss():
    """loss_t = -w_t * min(r A, clip(r) A): icepop's weights on ratio-1 tokens with A = 1 give -w_t."""
    logprobs = torch.zeros(2, 4, requires_grad=True)
    weights, _ = correction_weights("icepop", log_ratio(), torch.zeros(2, 4), MASK, MASK, low=0.5, high=2.0)
    loss, _ = policy_loss(logprobs, torch.zeros(2, 4), torch.ones(2), is_weights=weights)
    close(loss * MASK, [[-1.5, 0.0, -1.1, 0.0], [-0.9, 0.0, 0.0, 0.0]])
    (loss * MASK).sum().backward()
    close(logprobs.grad * MASK, [[-1.5, 0.0, -1.1, 0.0], [-0.9, 0.0, 0.0, 0.0]])  # masked tokens: no gradient


def test_loss_weights_of_a_micro_batch():
    behav = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    current = torch.tensor([[-1.5, -2.5, -1.5, 0.0], [-1.2, -1.0, 0.0, 0.0]])
    mb = dict(mask=MASK, advantages=torch.tensor([[-1.0] * 4, [-1.0] * 4]) * MASK, rollout_logprobs=behav)
    mb.update(rollout_mask=MASK, is_weights=torch.full((2, 4), 0.5))
    weights, metrics = loss_weights("seq-offpolicy-mask", mb, current, delta=0.5)
    close(weights * MASK, [[0.0] * 4, [0.5, 0.5, 0, 0]])  # row 0's mean KL 2/3 > 0.5: masked; row 1 keeps the batch's
    assert {k: float(v) for k, v in metrics.items()} == {
        "correction_masked_frac": 3.0,
        "correction_masked_frac__n": 5.0,
        "correction_masked_seq_frac": 1.0,
        "correction_masked_seq_frac__n": 2.0,
    }
    weights, metrics = loss_weights("icepop", mb, current)
    assert weights is mb["is_weights"] and metrics == {}


def test_quantiles_interpolate_like_torch():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(1))
    qs = [0.05, 0.5, 0.95]
    close(quantiles(values, qs), torch.quantile(values.double(), torch.tensor(qs, dtype=torch.float64)), 1e-12)
    assert quantiles(torch.tensor([2.0]), qs) == [2.0, 2.0, 2.0]


def test_resolve_correction_defaults_and_refusals():
    assert resolve_correction(None) == ("none", None, None, None)
    assert resolve_correction(None, tis_cap=3.0) == ("tis", None, 3.0, None)  # the older flag
    assert resolve_correction("tis") == ("tis", None, 2.0, None)
    assert resolve_correction("seq-mask-is") == ("seq-mask-is", 0.5, 2.0, None)
    assert resolve_correction("seq-mask-is", high=4.0) == ("seq-mask-is", 0.25, 4.0, None)
    assert resolve_correction("icepop") == ("icepop", 0.5, 2.0, None)
    assert resolve_correction("icepop", high=5.0) == ("icepop", 0.5, 5.0, None)
    assert resolve_correction("geo-mask") == ("geo-mask", 1 / 1.001, 1.001, None)
    assert resolve_correction("decoupled") == ("decoupled", None, 5.0, None)
    assert resolve_correction("seq-offpolicy-mask") == ("seq-offpolicy-mask", None, None, 0.5)
    assert resolve_correction("seq-offpolicy-mask", delta=0.1) == ("seq-offpolicy-mask", None, None, 0.1)
    for kwargs, says in (
        (dict(mode="icepop", tis_cap=2.0), "--tis-cap is --rollout-correction tis"),
        (dict(mode=None, tis_cap=2.0, high=3.0), "give one of them"),
        (dict(mode="tis", low=0.5), "--correction-low has no meaning with --rollout-correction tis"),
        (dict(mode="icepop", delta=0.5), "--correction-delta has no meaning"),
        (dict(mode="seq-offpolicy-mask", high=2.0), "--correction-high has no meaning"),
        (dict(mode="none", high=2.0), "--correction-high has no meaning with --rollout-correction none"),
        (dict(mode="icepop", low=3.0), "--correction-low 3.0 must be in [0, --correction-high 2.0]"),
        (dict(mode="tis", high=0.0), "--correction-high must be > 0"),
        (dict(mode="geo-mask", high=math.inf), "must be a finite number"),
    ):
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            resolve_correction(kwargs.pop("mode"), **kwargs)
    assert [m for m in ("none", "tis", "seq-offpolicy-mask", "decoupled") if uses_old_logprobs(m)] == [
        "tis",
        "decoupled",
    ]


def test_on_policy_failure():
    ok = {"first_update_logprob_err": 1e-7, "logprob_mismatch": 0.02, "ppo_kl": 0.3}  # ppo_kl: later updates' too
    assert on_policy_failure(ok, 0.1) is None
    said = on_policy_failure({**ok, "logprob_mismatch": 3.4}, 0.1, step=4)
    assert said.startswith("step 5: the first update is not on-policy: logprob_mismatch 3.4 > --check-on-policy 0.1")
    assert "ppo_kl" not in said and "\n" not in said
    assert "first_update_logprob_err 1e-07" in on_policy_failure(ok, 0.0)
    # GRPO's on-policy steps log no first_update_logprob_err: their one update's ppo_kl is checked (|.|)
    assert "ppo_kl 0.001" in on_policy_failure({"ppo_kl": -0.001, "logprob_mismatch": 0.0}, 1e-4)
    assert on_policy_failure({"ppo_kl": 0.0}, 0.0) is None
    assert "logprob_mismatch nan" in on_policy_failure({"logprob_mismatch": math.nan}, 0.1)
