"""MoE routing replay (--routing-replay rollout|old): routes recorded, carried and replayed.

    .venv/bin/python -m pytest -q tests/test_routing_replay.py

tests/routing_replay_worker.py (one process) samples with the CPU engine (transformers) on the
tiny Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3 of tests/tiny_models.py and scores the
samples with the trainer's Megatron model whose router is perturbed: without replay the
logprobs differ from the engine's, with the engine's routes replayed they equal them
(DeepSeek-V3, whose perturbed score-correction bias moves only the choice of experts) or
differ by what the perturbed gating weights make (the others), padded and packed alike; the
routes the trainer records itself (R2) replay to its own logprobs; the router's gradient under
replay equals the one derived by hand; an update's gradients are the same with activation
recomputation. The scripts' runs with replay (EP=2, CP=2) are in tests/test_moe.py,
tests/test_deepseek.py and tests/test_long_sequences.py.
"""

import json
import sys

import pytest
import torch

from tests.conftest import launch, script_env

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def replay_results(tiny_moe_models_dir):
    args = [str(tiny_moe_models_dir), ",".join(FAMILIES)]
    script = "tests/routing_replay_worker.py"
    proc = launch([sys.executable, script, *args], script, args, env=script_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[7:])
            results[row["model"]] = row
            print(row)
    assert sorted(results) == sorted(FAMILIES)
    return results


@pytest.mark.parametrize("name", FAMILIES)
def test_replayed_routes_give_the_engines_logprobs(replay_results, name):
    """(a) + (b): the engine's routes, through padded micro-batches of two rows and packed passes."""
    r = replay_results[name]
    assert r["routes_per_sample_ok"] and r["routes_shape"][2] == r["moe_layers"]
    # unperturbed: the trainer's own routing is the engine's, token for token (routes aligned)
    assert r["exact"] < 1e-5 and r["exact_mismatch"] == 0.0
    # perturbed router: its own top-k differs on some (token, layer) pairs, and the logprobs with it
    assert r["replayed_mismatch"] > 0.02 and r["perturbed"] > 0.01
    if name == "deepseek_v3":  # the bias moves the choice only: replayed, the engine's logprobs exactly
        assert r["replayed"] < 1e-5
    else:  # what is left is the perturbed gating weights' share (noise 0.002: 12-30x less than without)
        assert r["replayed"] < 0.02 and r["replayed"] < r["perturbed"] / 5
    assert abs(r["replayed_packed"] - r["replayed"]) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_recorded_routes_replay_to_the_models_own_logprobs(replay_results, name):
    """--routing-replay old: routes recorded in packed passes, gathered into the batch, replayed in
    padded ones: the model's own logprobs, its own top-k everywhere."""
    r = replay_results[name]
    assert r["recorded"] < 1e-6 and r["recorded_mismatch"] == 0.0 and r["recorded_where_engine_ran"]
    assert r["engine_routes_differ_from_recorded"] > 0  # the perturbed model's routes are its own


@pytest.mark.parametrize("name", FAMILIES)
def test_router_stays_differentiable_under_replay(replay_results, name):
    """(c): replayed experts, gating weights from the current logits: the router weight's gradient
    equals the hand-derived one (softmax over the chosen logits; Qwen2-MoE: the softmax over all
    logits at the chosen experts; DeepSeek-V3: the chosen sigmoid scores renormalised and scaled)
    and is not zero; the routing map is the replayed one."""
    r = replay_results[name]
    assert r["map_is_target"] and r["grad_max"] > 0.1
    assert r["grad_diff"] < 1e-5 * r["grad_max"]


def test_recomputation_in_the_backward_replays_the_same_routes(replay_results):
    """--recompute full / selective (moe): megatron re-runs the routers inside the backward, which
    take their micro-batch's targets from RouterReplay's backward queue: an update's gradients
    equal those without recomputation (two micro-batches, the router perturbed), and differ from
    the unreplayed update's (the check can fail)."""
    r = replay_results[FAMILIES[0]]
    assert r["recompute_grad_diff"] < 1e-6 and r["replay_changes_grads"] > 1e-3


def _samples_with_routes(layers=2, topk=2):
    from common.rollout.engine import Sample

    samples = []
    for i, (p, n) in enumerate(((3, 4), (2, 1), (4, 6), (2, 3))):
        tokens = list(range(10 * i, 10 * i + p + n))
        routes = torch.arange((p + n - 1) * layers * topk, dtype=torch.int16).view(p + n - 1, layers, topk) + 100 * i
        samples.append(Sample(tokens[:p], tokens[p:], [0.0] * n, "stop", routes=routes))
    return samples


def _check_positions(batch, mb):
    """Every token of a micro-batch carries its source position's routes (-1 where it has none)."""
    from common.model.routing_replay import token_positions

    rows, cols = token_positions(mb)
    source = torch.cat([batch["routes"], torch.full_like(batch["routes"][:1], -1)])  # + the spare row
    assert torch.equal(mb["routes"], source[rows, cols])


@pytest.mark.parametrize("mode", ["padded", "packed", "padded_cp", "packed_cp"])
def test_routes_ride_with_the_tokens(mode):
    """pack_sequences puts each sample's routes at its tokens (-1 at its last token and the padding);
    micro-batches (cut, extended with empty rows), packed passes and context-parallel slices carry
    each token's routes with it."""
    from common.rl import batch as B

    samples = _samples_with_routes()
    batch = B.pack_sequences(samples, pad_id=0, length_multiple=4, routes=True)
    batch["row"] = torch.arange(len(samples))
    assert batch["routes"].dtype == torch.int16 and batch["routes"].shape == (4, 12, 2, 2)
    for i, s in enumerate(samples):
        ran = len(s.prompt_ids) + len(s.response_ids) - 1
        assert torch.equal(batch["routes"][i, :ran], s.routes) and (batch["routes"][i, ran:] == -1).all()
    cp = 2 if mode.endswith("_cp") else 1
    multiple, sample_multiple = B.length_multiples(1, cp)
    mbs = B.micro_batches(
        batch, torch.arange(4), 2, length_multiple=multiple, pack="packed" in mode, sample_multiple=sample_multiple
    )
    for mb in mbs:
        for rank in range(cp):
            _check_positions(batch, B.context_parallel_slice(mb, cp, rank) if cp > 1 else mb)
    extended = B._extend(batch["routes"][:1], 2, B._fill("routes"))  # the empty rows of an EP peer's longer pass
    assert (extended[1:] == -1).all()


def test_samples_without_routes_are_refused():
    from common.rl import batch as B

    samples = _samples_with_routes()
    samples[2].routes = None
    with pytest.raises(ValueError, match="1 of 4 samples carry no MoE routes"):
        B.pack_sequences(samples, pad_id=0, routes=True)


def test_saved_rollouts_without_routes_are_refused(tmp_path):
    """--load-rollouts with --routing-replay rollout: rollouts saved without routes are refused at
    start-up (exit 2, one line), before anything is built."""
    from tests.conftest import run_script

    samples = _samples_with_routes()
    for s in samples:
        s.routes = None
    (tmp_path / "rollouts").mkdir()
    torch.save({"samples": samples, "rewards": torch.zeros(4)}, tmp_path / "rollouts" / "step_000000.pt")
    args = ("--embedded-model", "moe", "--steps", 1, "--load-rollouts", tmp_path / "rollouts", "--out", tmp_path / "o")
    proc = run_script("train_grpo.py", *args, "--routing-replay", "rollout", check=False)
    assert proc.returncode == 2 and "carry no MoE routes" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


def test_routes_from_vllm_finds_the_moe_layers():
    """vLLM's routed_experts (tokens, num_hidden_layers, k): the MoE layers read at their decoder
    indices or first, whichever vLLM wrote (a written layer has k distinct experts per token)."""
    from common.rollout.routes import routes_from_vllm

    moe_layers = [False, True, True, False, True]  # DeepSeek-style: dense layers among MoE ones
    gen = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(7 * 3)]).view(7, 3, 2)
    by_index = torch.zeros(7, 5, 2, dtype=torch.int32)
    by_index[:, [1, 2, 4]] = routes.int()
    first = torch.zeros(7, 5, 2, dtype=torch.int32)
    first[:, :3] = routes.int()
    for array in (by_index.numpy(), first.numpy(), routes.numpy()):
        got = routes_from_vllm(array, moe_layers)
        assert got.dtype == torch.int16 and torch.equal(got, routes.to(torch.int16))
    with pytest.raises(ValueError, match="neither"):
        routes_from_vllm(torch.zeros(7, 5, 2, dtype=torch.int32).numpy(), moe_layers)
    with pytest.raises(ValueError, match="for 4 layers"):
        routes_from_vllm(torch.zeros(7, 4, 2).numpy(), moe_layers)
