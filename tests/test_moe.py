"""Mixture-of-Experts: the bridge against transformers at every expert layout, and its refusals.

    .venv/bin/python -m pytest -q tests/test_moe.py

tests/parity_worker.py runs under torchrun (gloo) over the tiny Qwen3-MoE (q/k norm, a
dense layer mixed in), Qwen2-MoE (shared expert with its sigmoid gate, top-k not
renormalised, MoE every 2nd layer) and Mixtral (block_sparse_moe names on disk) of
tests/tiny_models.py, saved in the hub's one-tensor-per-expert layout:
  - fp32 logits vs transformers <= 1e-4 (measured ~3e-7) at 1 rank, EP=2, TP=2+SP (EP=1:
    tokens gathered over TP and sorted by expert on the device), TP=2+EP=2+SP, TP=2+ETP=2+SP
    and PP=2+EP=2; at EP=2 and TP=2+EP=2+SP also with --moe-dispatcher allgather (tokens
    gathered over EP, this rank's experts' share sorted on the device), whose gradients equal
    the all-to-all's (relative 1e-5);
  - the export gives back every per-expert HF tensor bit-identical, nothing missing or extra;
  - wrong mappings (k/v swapped, two experts exchanged, fc1 cut naively at TP>1) do not match;
  - the load-balancing loss and expert-load metrics of a right-padded batch, taken through the
    trainer's path, equal transformers' over the valid tokens (its attention mask), and
    without the mask equal transformers' unmasked ones (rel. 1e-5).
Also: the GRPO/PPO scripts at EP=2, a training checkpoint of EP=1 resumed at EP=2, and the
offline tools (convert_hf_to_mcore.py --verify, merge_to_hf.py) round-tripping bit-exactly.
"""

import pytest
import torch

from tests.conftest import LayoutLaunches, run_batch_worker, run_script, run_torchrun
from tests.tiny_models import MOE_CONFIGS

TOLERANCE = 1e-4
LAYOUTS = {
    "one_rank": (1, []),
    "ep2": (2, ["--ep", 2]),
    "tp2_sp": (2, ["--tp", 2, "--sp"]),  # EP=1: tokens gathered over TP, sorted on the device (common/model/moe.py)
    "tp2_ep2_sp": (2, ["--tp", 2, "--sp", "--ep", 2]),
    "tp2_etp2_sp": (2, ["--tp", 2, "--sp", "--etp", 2]),
    "pp2_ep2": (4, ["--pp", 2, "--ep", 2]),
}


@pytest.fixture(scope="module")
def parity(tiny_moe_models_dir, tmp_path_factory):
    return LayoutLaunches(
        "tests/parity_worker.py", LAYOUTS, ["--models-dir", tiny_moe_models_dir], tmp_path_factory.mktemp("parity")
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_parity(layout, parity):
    nproc, flags = LAYOUTS[layout]
    results = parity[layout]
    assert sorted(results) == sorted(MOE_CONFIGS)
    for name, ranks in results.items():
        assert len(ranks) == nproc
        for rank, row in enumerate(ranks):
            where = f"{name} {layout} rank {rank}"
            print(
                f"{where}: max_abs_diff={row['max_abs_diff']:.2e} experts_swapped={row['control_experts_swapped']:.2e}"
            )
            assert row["max_abs_diff"] <= TOLERANCE, where
            assert row["export_missing"] == [] and row["export_extra"] == [] and row["export_mismatch"] == [], where
            # each rank's own TP pieces (export_hf_weights(local_reads=)): boxes of the HF tensors
            assert row["pieces_mismatch"] == [], where
            assert (row["pieces"] > 0) == ("--tp" in flags and "--pp" not in flags), where
            # experts stacked per layer (the vLLM sync): the same tensors; blocks wherever experts are not TP-split
            assert row["blocks_mismatch"] == [], where
            assert (row["expert_blocks"] > 0) == ("--etp" not in flags), where
            assert row["control_kv_swapped"] > 100 * TOLERANCE, where
            assert row["control_experts_swapped"] > 100 * TOLERANCE, where
            if "--tp" in flags and name != "mixtral":  # mixtral has no TP-sharded gate_up at etp 1
                assert row["control_naive_fc1"] > 100 * TOLERANCE, where
            # the routers' statistics of a right-padded batch: padding left out, as transformers' attention mask does
            stats = row["routing_statistics"]
            if name.startswith("deepseek"):  # no aux loss (noaux_tc): the router-bias update's token counts
                print(f"{where}: bias update counted / expected {stats}")
                (masked, expected), (unmasked, all_tokens) = stats["masked"], stats["unmasked"]
                assert masked == expected and unmasked == all_tokens, where
                assert masked < unmasked or all_tokens == 0, where  # 0: a pipeline stage without MoE layers
            else:
                for case, (ours, theirs) in stats.items():
                    print(f"{where} {case}: ours {ours} transformers {theirs}")
                    assert sorted(ours) == sorted(theirs), where
                    for key, value in theirs.items():
                        assert abs(ours[key] - value) <= 1e-5 * abs(value), f"{where} {case} {key}"
                # the check can fail: the padding changes these numbers
                assert abs(stats["masked"][1]["moe_aux_loss"] - stats["unmasked"][1]["moe_aux_loss"]) > 1e-3, where
            if "--ep" in flags and "--pp" not in flags:  # --moe-dispatcher allgather against the all-to-all
                print(
                    f"{where}: allgather max_abs_diff={row['allgather_max_abs_diff']:.2e} "
                    f"grad rel diff={row['dispatch_max_grad_rel_diff']:.2e} over {row['dispatch_grad_params']} params"
                )
                assert row["alltoall_dispatchers"] == ["MoEAlltoAllTokenDispatcher"], where
                assert row["allgather_dispatchers"] == ["DeviceSortDispatcher"], where
                assert row["allgather_max_abs_diff"] <= TOLERANCE, where
                assert row["allgather_loop_max_abs_diff"] <= TOLERANCE, where  # megatron's per-expert loop
                assert row["dispatch_grad_names_equal"] and row["dispatch_max_grad_rel_diff"] <= 1e-5, where
        if name.startswith("deepseek"):
            assert any(row["routing_statistics"]["unmasked"][1] > 0 for row in ranks), name


def _config(name, **changes):
    from tests.tiny_models import MOE_CONFIGS

    arch, kwargs = MOE_CONFIGS[name]
    return dict(kwargs, architectures=[arch], **changes)


def test_router_settings_map_exactly():
    from common.model.bridge import parse_hf_config, transformer_config

    qwen3 = parse_hf_config(_config("qwen3_moe"))
    assert qwen3.moe.moe_layers == [True, False, True, True]
    config = transformer_config(qwen3, moe_aux_loss_coef=0.01)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 32)
    assert config.moe_router_pre_softmax is False  # renormalised top-k == softmax over the top-k logits
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    assert config.moe_layer_freq == [1, 0, 1, 1]
    qwen2 = parse_hf_config(_config("qwen2_moe"))
    config = transformer_config(qwen2)
    assert config.moe_router_pre_softmax is True and config.moe_aux_loss_coeff == 0.001  # the HF config's
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (48, True)
    assert qwen2.moe.moe_layers == [False, True, False, True] and qwen2.qkv_bias
    # the default dispatcher: all-gather with every expert local, all-to-all at EP or expert TP > 1
    assert [
        transformer_config(qwen2, ep=ep, etp=etp).moe_token_dispatcher_type
        for ep, etp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))
    ] == ["allgather", "alltoall", "alltoall", "alltoall", "alltoall"]
    off = transformer_config(qwen2, moe_aux_loss_coef=0.0)
    assert off.moe_router_load_balancing_type == "none"
    z = parse_hf_config(_config("mixtral", router_z_loss_coef=0.001))
    assert transformer_config(z).moe_z_loss_coeff == 0.001


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
        (dict(num_experts_per_tok=1), "norm_topk_prob"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(sliding_window=64), "sliding_window"),
    ],
)
def test_unrepresentable_moe_configs_are_refused(changes, message):
    from common.model.bridge import parse_hf_config
    from common.model.unsupported import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config("mixtral", **changes))


def test_expert_layouts_that_do_not_divide_are_refused():
    from common.model.bridge import check_parallel_layout, parse_hf_config

    spec = parse_hf_config(_config("qwen2_moe"))
    with pytest.raises(ValueError, match="--ep 3 must divide the number of experts"):
        check_parallel_layout(spec, ep=3)
    with pytest.raises(ValueError, match="--etp 3 must divide"):
        check_parallel_layout(spec, etp=3)
    dense = parse_hf_config(
        dict(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
        )
    )
    with pytest.raises(ValueError, match="need a Mixture-of-Experts model"):
        check_parallel_layout(dense, ep=2)


def test_device_sorted_dispatch_equals_megatrons(tmp_path):
    """At EP=1 common/model/moe.py sorts tokens by expert on the device (no host waits) and
    common/model/moe_router.py routes them (the functions compiled on a GPU); the loss, every gradient
    and the logged aux losses equal megatron's all-gather dispatcher's and routing's bit for bit
    (fp32, same weights, a padded tail), for Qwen3-MoE (softmax top-k, load-balancing loss) and
    DeepSeek-V3 (sigmoid, grouped routing, router bias, shared experts, sequence aux loss)."""
    for r in run_batch_worker(tmp_path, "dispatch", ("qwen3_moe", "deepseek_v3")):
        print(r)
        assert r["ours_aux"] == r["megatron_aux"] and r["ours_aux"], r  # each layer's logged loss
        if r["model"] == "qwen3_moe":  # (the tiny DeepSeek-V3's aux-loss coefficient is 0)
            assert any(v > 0 for values in r["ours_aux"].values() for v in values), r
        assert r["ours_dispatchers"] == ["DeviceSortDispatcher"] and r["megatron_dispatchers"] == [
            "MoEAllGatherTokenDispatcher"
        ]
        assert r["moe_layers"] >= 2 and r["experts_with_grads"] >= 8 * 2 * 2, r
        assert r["loss_diff"] == 0.0 and r["max_grad_diff"] == 0.0, r


def test_moe_kernels_compiled_equal_eager():
    """The two functions of common/model/moe.py that inductor compiles on a GPU, compiled here on a
    CPU, against their eager code and float64: gather_rows_sum (the combine and the
    permutation's backward: each token's kept rows summed, the others, which hold NaN here as
    the never-written tail may, leave no trace) and swiglu_weighted with its gradients."""
    from common.model.moe import gather_rows_sum
    from common.model.moe_experts import swiglu_weighted
    from common.rl.fused import compile_fn

    gen = torch.Generator().manual_seed(0)
    tokens, k, hidden = 6, 4, 16
    rows = torch.randn(tokens * k, hidden, generator=gen)
    order = torch.randperm(tokens * k, generator=gen).view(tokens, k)
    keep = torch.rand(tokens, k, generator=gen) > 0.3
    rows[order[~keep]] = float("nan")
    expected = torch.stack(
        [
            sum(
                (rows[i].double() for i, kept in zip(order[t], keep[t]) if kept),
                torch.zeros(hidden, dtype=torch.float64),
            )
            for t in range(tokens)
        ]
    )
    compiled = compile_fn(gather_rows_sum.eager)
    for fn in (gather_rows_sum, compiled):
        assert (fn(rows, order, keep).double() - expected).abs().max() < 1e-6
        assert (fn(rows.bfloat16(), order, keep).double() - expected).abs().max() < 0.05

    h = torch.randn(10, 2 * hidden, generator=gen, requires_grad=True)
    probs = torch.rand(10, generator=gen, requires_grad=True)
    weights = torch.randn(10, hidden, generator=gen)
    results = []
    for fn in (swiglu_weighted, compile_fn(swiglu_weighted.eager)):
        out = fn(h, probs)
        results.append((out, *torch.autograd.grad((out * weights).sum(), (h, probs))))
    gate, up = h.double().chunk(2, dim=-1)
    assert (results[0][0].double() - torch.nn.functional.silu(gate) * up * probs.double()[:, None]).abs().max() < 1e-6
    for eager, comp in zip(*results):
        assert (eager - comp).abs().max() < 1e-5


def test_permuted_rows_compiled_equal_by_hand():
    """common/model/moe.py permuted_rows (DeviceSortDispatcher's bookkeeping, compiled on a GPU), eager
    and compiled here on a CPU, against the rows written out by hand: this rank's (expert, token)
    pairs expert-major with tokens ascending (or this rank's experts last first: descending),
    then the other ranks' (the tail, picks past the end), each token's rows in ascending order
    (descending: reversed, so this rank's rows are in expert order), at EP=1 and as either rank
    of EP=2."""
    from common.model.moe import permuted_rows
    from common.rl.fused import compile_fn

    gen = torch.Generator().manual_seed(0)
    tokens, experts, topk = 12, 8, 2
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map.scatter_(1, torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices, True)
    compiled = compile_fn(permuted_rows.eager)
    for first, count, descending in ((0, 8, False), (0, 4, False), (4, 4, False), (0, 8, True), (4, 4, True)):
        rolled = routing_map.roll(-first, dims=1)
        groups = [*(reversed(range(count)) if descending else range(count)), *range(count, experts)]
        pairs = [(e, t) for e in groups for t in range(tokens) if rolled[t, e]]
        mine = sum(1 for e, _ in pairs if e < count)
        picks = [e * tokens + t if i < mine else tokens * experts for i, (e, t) in enumerate(pairs)]
        token = [t for _, t in pairs]
        rows_of = [[i for i, (_, t) in enumerate(pairs) if t == u][:: -1 if descending else 1] for u in range(tokens)]
        keep = [[i < mine for i in rows] for rows in rows_of]
        order = [[i if i < mine else 0 for i in rows] for rows in rows_of]
        case = (first, count, descending)
        for fn in (permuted_rows, compiled):
            got = fn(routing_map, first, count, topk, descending)
            assert got[0].tolist() == picks and got[1].tolist() == token, case
            assert got[2].tolist() == order and got[3].tolist() == keep, case
            assert got[4].tolist() == [int(rolled[:, e].sum()) for e in groups[:count]], case


def test_router_functions_compiled_equal_eager():
    """common/model/moe_router.py's three functions that inductor compiles on a GPU (megatron's own
    routing code inside), compiled here on a CPU, against their eager run: softmax top-k, and
    sigmoid with a router bias and grouped top-k (DeepSeek-V3), with and without padding."""
    from common.model.moe_router import aux_loss_scores, load_balancing_loss, topk_routing
    from common.rl.fused import compile_fn

    gen = torch.Generator().manual_seed(0)
    tokens, experts, topk = 20, 8, 2
    logits = torch.randn(tokens, experts, generator=gen, requires_grad=True)
    bias = torch.randn(experts, generator=gen) * 0.1
    padding = torch.zeros(tokens, dtype=torch.bool)
    padding[15:] = True
    weights = torch.randn(tokens, experts, generator=gen)
    cases = [(None, topk, False, None, None, None, "softmax"), (bias, topk, False, 4, 2, 2.5, "sigmoid")]
    for fns in (
        (topk_routing, aux_loss_scores, load_balancing_loss),
        tuple(compile_fn(f.eager) for f in (topk_routing, aux_loss_scores, load_balancing_loss)),
    ):
        results = []
        for args in cases:
            for mask in (None, padding):
                probs, routing_map = fns[0](logits, *args)
                aux_map, scores = fns[1](logits, mask, topk, args[-1])
                loss, valid = fns[2](scores, aux_map, topk, experts, 0.01, mask is not None)
                (grad,) = torch.autograd.grad((probs * weights).sum() + loss, logits)
                results.append((probs, routing_map, aux_map, scores, loss, valid, grad))
        if fns[0] is topk_routing:
            eager = results
            assert all(
                r[1].sum() == tokens * topk and r[5] == (tokens if i % 2 == 0 else 15) for i, r in enumerate(results)
            )
    for ours, ref in zip(results, eager):
        for a, b in zip(ours, ref):
            assert torch.equal(a, b) if a.dtype == torch.bool else (a - b).abs().max() < 1e-6


def test_grpo_learns_with_the_embedded_moe_at_ep2(tmp_path):
    """train_grpo.py --embedded-model moe at EP=2 (gloo; megatron's all-to-all dispatcher) with
    the rollout's routes replayed (--routing-replay rollout): the embedded task is learned
    (greedy validation), and the expert-load and aux-loss metrics are logged. The CPU engine's
    routes reach the trainer's passes token for token (the saved rollouts hold them): at the
    weights the engine sampled with, the trainer's own top-k is the replayed one (misaligned
    routes would differ on most (token, layer) pairs)."""
    from tests.conftest import read_metrics

    run_torchrun(
        "train_grpo.py",
        2,
        "--embedded-model",
        "moe",
        "--ep",
        2,
        "--routing-replay",
        "rollout",
        "--kl-coef",
        0,  # no reference pass: -20% time
        "--steps",
        50,
        "--eval-every",
        25,
        "--log-samples-every",
        0,
        "--out",
        tmp_path,
        "--save-rollouts",
        tmp_path / "rollouts",
    )
    rows = read_metrics(tmp_path)
    evals = {m["step"]: m["eval_accuracy"] for m in rows if "eval_accuracy" in m}
    print(f"eval accuracy {evals}; last moe_load_max {rows[-1]['moe_load_max']:.2f} aux {rows[-1]['moe_aux_loss']:.3f}")
    print("route_mismatch", [m["route_mismatch"] for m in rows][:5], rows[-1]["route_mismatch_update"])
    assert evals[49] >= evals[0] + 0.5
    for m in rows:  # 8 experts, top-2: 1.0 is balanced, 4.0 is one expert taking every token
        assert 1.0 <= m["moe_load_mean"] <= m["moe_load_max"] <= 4.0
        assert 0.5 < m["moe_aux_loss"] < 8.0  # 2 layers, each ~1 when balanced
        assert m["route_mismatch"] <= 0.01 and 0.0 <= m["route_mismatch_update"] <= 1.0
    saved = torch.load(tmp_path / "rollouts" / "step_000000.pt", weights_only=False)["samples"]
    assert all(s.routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2) for s in saved)


def test_ppo_runs_with_the_embedded_moe_at_ep2(tmp_path):
    """train_ppo.py's actor and critic share the MoE body at EP=2: both log their expert load,
    and both replay the old-logprob pass's routes (--routing-replay old) through the padding.
    With --pack and --micro-batch-tokens the two ranks' pass counts and lengths depend on their
    samples. The all-to-all needs equal counts (else it hangs); --moe-dispatcher allgather
    needs each pass to hold as many tokens on both ranks (unequal sizes crash or, on gloo,
    return garbage), which the scripts' micro-batches pad to: its first step must equal the
    all-to-all's (same rollouts, same math). Without the load-balancing loss: it is computed
    per pass over all its tokens, padding included, so the extra padding changes it (and the
    expert loads, which count the padding too)."""
    from tests.conftest import read_metrics

    runs = {}
    for dispatcher in ("alltoall", "allgather"):
        out = tmp_path / dispatcher
        run_torchrun(
            "train_ppo.py",
            2,
            "--embedded-model",
            "moe",
            "--ep",
            2,
            "--moe-dispatcher",
            dispatcher,
            "--steps",
            1,
            "--prompts-per-step",
            8,
            "--samples-per-prompt",
            4,
            "--micro-batch-size",
            4,
            "--mini-batch-size",
            16,
            "--eval-every",
            0,
            "--pack",
            "--micro-batch-tokens",
            48,
            "--max-new-tokens",
            12,
            "--moe-aux-loss-coef",
            0,
            "--routing-replay",
            "old",
            "--log-samples-every",
            0,
            "--out",
            out,
            timeout=400,
        )
        runs[dispatcher] = rows = read_metrics(out)
        assert len(rows) == 1
        for m in rows:
            assert 1.0 <= m["moe_load_max"] <= 4.0 and 1.0 <= m["critic_moe_load_max"] <= 4.0
            assert m["value_loss"] == m["value_loss"]  # finite: the guard would have stopped the run
            # --routing-replay old: the critic's values pass (its body the actor's before any update)
            # replays the actor's old-pass routes, its own choice; the updates replay them too
            assert m["critic_route_mismatch"] <= 0.01 and 0.0 <= m["route_mismatch_update"] < 0.5
    first, second = runs["alltoall"][0], runs["allgather"][0]
    compared = ("policy_loss", "ppo_kl", "entropy", "grad_norm", "critic_grad_norm", "response_len_mean")
    print({k: (first[k], second[k]) for k in compared})
    for k in compared:
        assert abs(first[k] - second[k]) <= 1e-5 * abs(first[k]), k


def test_training_checkpoint_of_ep1_resumes_at_ep2(tmp_path):
    """A training checkpoint written by one process (all experts local) resumed at EP=2 on two
    processes (each rank holds 4 of the 8 experts, the dense part data-parallel) continues the
    uninterrupted run: same losses, grad norms and final weights (tests/checkpoint_worker.py,
    qwen2_moe: shared expert, dense and MoE layers)."""
    from tests.checkpoint_worker import TOTAL_STEPS
    from tests.test_train_checkpoint import WORKER, load, rel_diff, weights_rel_diff, worker_args
    from tests.tiny_models import save_tiny_hf_model

    save_tiny_hf_model("qwen2_moe", str(tmp_path / "hf"))
    (tmp_path / "out").mkdir()
    root = tmp_path / "root"
    run_script(WORKER, *worker_args(tmp_path, [{"name": "ref", "saves": [{"step": 3, "root": root}]}]))
    run_torchrun(WORKER, 2, "--ep", 2, *worker_args(tmp_path, [{"name": "ep2", "resume": root}]))
    # and at EP=1 on two processes: experts data-parallel (their gradients averaged over both)
    run_torchrun(WORKER, 2, *worker_args(tmp_path, [{"name": "dp2", "resume": root}]))
    ref = load(tmp_path, "ref")
    for name in ("ep2", "dp2"):
        result = load(tmp_path, name)
        diffs = [
            rel_diff(result, ref, "losses"),
            rel_diff(result, ref, "grad_norms"),
            weights_rel_diff(tmp_path, name, "ref"),
        ]
        print(f"{name}: losses, grad norms, weights rel diff {diffs}")
        assert result["extra"]["step"] == 3 and len(result["losses"]) == TOTAL_STEPS - 3
        assert max(diffs) <= 1e-5, name
    # megatron's RNG tracker: restored at the same TP/EP coordinates (dp2), kept as seeded at EP=2
    saved_tracker, ep2 = ref["rng_after_save"][0][1], load(tmp_path, "ep2")
    assert [fp[1] for fp in load(tmp_path, "dp2")["rng_after_load"]] == [saved_tracker] * 2
    assert [fp[1] for fp in ep2["rng_after_load"]] == [fp[1] for fp in ep2["rng_before_load"]], (
        "a tracker saved at EP=1 was restored at EP=2"
    )


def test_convert_and_merge_round_trip(tiny_moe_models_dir, tmp_path, capsys):
    """convert_hf_to_mcore.py (--verify against transformers) then merge_to_hf.py, in this
    process: the per-expert HF tensors come back bit-exact for all three families, and the
    merged directory gives transformers' logits exactly."""
    from transformers import AutoModelForCausalLM

    import convert_hf_to_mcore
    import merge_to_hf
    from tests.test_convert import assert_bit_exact, hf_tensors, max_abs_diff

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for name in MOE_CONFIGS:
        hf_dir, ckpt, out = tiny_moe_models_dir / name, tmp_path / f"{name}-mcore", tmp_path / f"{name}-hf"
        assert (
            convert_hf_to_mcore.main([str(a) for a in ("--hf", hf_dir, "--out", ckpt, "--dtype", "fp32", "--verify")])
            == 0
        ), name
        assert max_abs_diff(capsys.readouterr().out) <= 1e-5, name
        assert merge_to_hf.main([str(a) for a in ("--ckpt", ckpt, "--out", out, "--max-shard-size", "300KB")]) == 0
        capsys.readouterr()
        assert_bit_exact(hf_tensors(hf_dir), hf_tensors(out))
        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids).logits
            merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        assert torch.equal(reference, merged), name


def test_convert_verify_and_merge_at_tp2_ep2(tiny_moe_models_dir, tmp_path):
    """Two writers; the checkpoint --verify'd at TP=2 + EP=2 (+SP) and merged back at EP=2 by
    two processes: bit-exact per-expert tensors (qwen2_moe: shared expert, dense layers)."""
    from tests.test_convert import assert_bit_exact, hf_tensors, max_abs_diff

    hf_dir = tiny_moe_models_dir / "qwen2_moe"
    proc = run_torchrun(
        "convert_hf_to_mcore.py",
        2,
        "--hf",
        hf_dir,
        "--out",
        tmp_path / "ckpt",
        "--dtype",
        "fp32",
        "--verify",
        "--tp",
        2,
        "--ep",
        2,
    )
    assert max_abs_diff(proc.stdout) <= 1e-5
    run_torchrun("merge_to_hf.py", 2, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--ep", 2)
    assert_bit_exact(hf_tensors(hf_dir), hf_tensors(tmp_path / "hf"))


def test_padding_mask_on_a_later_pipeline_stage_is_its_tp_ranks_part(monkeypatch):
    """moe_padding_mask: True on the padding; megatron splits it over TP (sequence parallelism)
    with the embedding, so a stage without one gets its TP rank's part of the sequence here; a
    dense model, or a pass without `valid`, gets none."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu

    from common.model.moe import moe_padding_mask

    valid = torch.arange(16).expand(2, 16) < torch.tensor([[16], [5]])
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(mpu, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        for pre_process, expected in ((True, ~valid), (False, ~valid[:, rank * 8 : (rank + 1) * 8])):
            moe = SimpleNamespace(
                config=SimpleNamespace(num_moe_experts=4, sequence_parallel=True), pre_process=pre_process
            )
            assert torch.equal(moe_padding_mask(moe, valid), expected)
            assert moe_padding_mask(moe, None) is None
    dense = SimpleNamespace(config=SimpleNamespace(num_moe_experts=None, sequence_parallel=True), pre_process=False)
    assert moe_padding_mask(dense, valid) is None
