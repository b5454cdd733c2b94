"""common/run/step.py and the small pieces both training loops share: this rank's micro-batches of a step
(StepBatches), the step's checkpoint description (StepCheckpoints), the policy loss's metrics
(common/rl/losses.py policy_metrics), the on-policy gate (common/train/guard.py gate_on_policy) and the
engine's context (common/run/build.py context_len).

    .venv/bin/python -m pytest -q tests/test_step.py

Checked by hand: which rows each data-parallel rank gets of each mini-batch (the ranks' rows partition the
mini-batch, in the order's slices), the forward-only passes' micro-batches at their own sizes, the metrics'
sums and counts of a two-row micro-batch. The scripts' own runs (tests/test_train_grpo.py, test_train_ppo.py,
test_distill.py) check these pieces in place: every flag they read is passed there.
"""

import types

import pytest
import torch

from common.rl.batch import pack_sequences
from common.rl.losses import policy_metrics
from common.rollout.engine import Sample
from common.run.build import PassLayout, context_len
from common.run.step import StepBatches, StepCheckpoints
from common.train.guard import OffPolicyError, gate_on_policy


def _args(**kw):
    base = dict(
        micro_batch_size=2,
        micro_batch_tokens=0,
        logprob_micro_batch_size=None,
        logprob_micro_batch_tokens=None,
        pp=1,
        pack=False,
        moe_dispatcher="alltoall",
    )
    return types.SimpleNamespace(**{**base, **kw})


def _batch(lengths):
    samples = [Sample([1, 2], [3] * n, [0.0] * n, "stop") for n in lengths]
    batch = pack_sequences(samples, pad_id=0, length_multiple=4)
    batch["row"] = torch.arange(len(samples))
    return batch


LAYOUT = PassLayout(tp_group=None, cp_group=None, expert_peers=None, multiple=4, sample_multiple=1)


def _rows(mbs):
    return [mb["row"].tolist() for mb in mbs]


def test_step_batches_split_each_mini_batch_over_the_data_parallel_ranks():
    batch = _batch([1, 6, 2, 5, 3, 4, 8, 7])  # 8 rows, mini-batches of 4, two DP ranks of 2 rows each
    order = torch.tensor([7, 2, 5, 0, 1, 6, 3, 4])
    mine = [
        StepBatches(batch, _args(), types.SimpleNamespace(dp_rank=d, dp_size=2), LAYOUT, mini_batch=4, rollout_batch=8)
        for d in range(2)
    ]
    # mini-batch m holds order[4m : 4m + 4]; rank d its slice [2d : 2d + 2], ordered by length in a micro-batch
    assert _rows(mine[0].of(order, 0)) == [[2, 7]]  # lengths 2, 7
    assert _rows(mine[1].of(order, 0)) == [[0, 5]]  # lengths 1, 4
    assert _rows(mine[0].of(order, 1)) == [[1, 6]]  # lengths 6, 8
    assert _rows(mine[1].of(order, 1)) == [[4, 3]]  # lengths 3, 5
    # the longest row of each micro-batch sets its cut: 2 + 7 - 1 = 8 positions, a multiple of 4
    assert mine[0].of(order, 0)[0]["tokens"].shape[1] == 8


def test_step_batches_forward_only_takes_every_row_at_the_forward_only_sizes():
    batch = _batch([1, 6, 2, 5, 3, 4, 8, 7])
    info = types.SimpleNamespace(dp_rank=1, dp_size=2)
    args = _args(logprob_micro_batch_size=1)  # one row per forward-only pass, two per update pass
    steps = StepBatches(batch, args, info, LAYOUT, mini_batch=4, rollout_batch=8)
    # identity order: mini-batch 0 = rows 0-3 (rank 1: 2, 3), mini-batch 1 = rows 4-7 (rank 1: 6, 7)
    assert _rows(steps.forward_only()) == [[2], [3], [7], [6]]  # each micro-batch sorted by length: 7 < 8
    assert _rows(steps.of(torch.arange(8), 1)) == [[7, 6]]
    batch["routes"] = torch.zeros(8, batch["tokens"].shape[1], 1, 2)  # added later (--routing-replay old)
    assert all("routes" in mb for mb in steps.forward_only())  # the micro-batches read the batch as it is now


def test_step_checkpoints_describe_the_run_and_name_lora_s_base(tmp_path):
    spec = types.SimpleNamespace(architecture="Qwen2ForCausalLM")
    args = types.SimpleNamespace(out=str(tmp_path), lora=None, model="Qwen/Qwen2-0.5B", mcore_ckpt=None)
    full = StepCheckpoints(None, args, spec=spec, dtype=torch.bfloat16, sampler=None, carry=None, hf_dir="/hf")
    assert full.meta == {"architecture": "Qwen2ForCausalLM", "dtype": "torch.bfloat16"}
    assert full.root == str(tmp_path / "checkpoints")
    args.lora = dict(rank=8, alpha=16.0, targets=["attention"])
    lora = StepCheckpoints(None, args, spec=spec, dtype=torch.bfloat16, sampler=None, carry=None, hf_dir="/hf")
    assert lora.meta["lora"] == dict(rank=8, alpha=16.0, targets=["attention"], base="Qwen/Qwen2-0.5B", base_mcore=None)


def test_policy_metrics_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 3 tokens of a mini-batch of 6
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    clipped = torch.tensor([[True, False, True], [True, False, False]])
    drift = torch.tensor([[0.1, -0.3, 5.0], [0.2, 5.0, 5.0]])
    m = policy_metrics(torch.tensor(0.5), entropy, clipped, drift, mask, torch.tensor(6.0))
    assert m["policy_loss"] == 0.5 and m["policy_loss__n"] == 0.5  # 3 of the mini-batch's 6 tokens
    assert (m["entropy"], m["entropy__n"]) == (6.0, 3.0)
    assert (m["clip_frac"], m["clip_frac__n"]) == (2.0, 3.0)
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6) and "first_update_logprob_err" not in m
    first = policy_metrics(torch.tensor(0.5), entropy, clipped, drift, mask, torch.tensor(6.0), first=True)
    assert first["first_update_logprob_err"].item() == pytest.approx(0.6)  # |0.1| + |-0.3| + |0.2|
    assert first["first_update_logprob_err__n"] == 3.0


def test_gate_on_policy_flushes_then_raises():
    flushed = []
    gate_on_policy({"logprob_mismatch": 0.001}, 0.01, 0, flush=lambda: flushed.append(1))
    assert flushed == []  # within the bound: nothing
    with pytest.raises(OffPolicyError, match="logprob_mismatch 0.05 > --check-on-policy 0.01"):
        gate_on_policy({"logprob_mismatch": 0.05}, 0.01, 0, flush=lambda: flushed.append(1))
    assert flushed == [1]  # the checkpoint and metrics written first


def test_context_len_is_the_longest_prompt_and_a_response_or_an_episode():
    task = types.SimpleNamespace(prompt_ids=[[1, 2, 3], [4]], eval_prompt_ids=[[5] * 7])
    assert context_len(types.SimpleNamespace(env=None, max_new_tokens=16), task) == 7 + 16  # the held-out too
    episodes = types.SimpleNamespace(env="game", max_episode_tokens=512, max_new_tokens=16)
    assert context_len(episodes, task) == 512
