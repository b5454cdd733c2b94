"""DeepSeek-V3 (multi-latent attention + sigmoid group-limited routing): what tests/test_moe.py
does not already cover for it.

    .venv/bin/python -m pytest -q tests/test_deepseek.py

The tiny DeepSeek-V3s of tests/tiny_models.py (MOE_CONFIGS "deepseek_v3": q LoRA, YaRN,
4 expert groups, an odd layer count; "deepseek_v3_small": no q LoRA, plain RoPE, one group)
are also in test_moe.py's runs: logits vs transformers at 1 rank, EP=2, TP=2+EP=2+SP,
TP=2+ETP=2+SP and PP=2+EP=2 (measured 1.8e-7 to 4.9e-7; dropping the score-correction bias
gives 0.56), bit-exact export, and convert_hf_to_mcore.py --verify / merge_to_hf.py round
trips. tests/test_long_sequences.py packs it at EP=2. Here: the config fields that cannot be
represented, the bias kept fp32 through a bf16 export, GRPO learning at EP=2, and CP=2+EP=2.
"""

import pytest
import torch

from tests.conftest import read_metrics, run_script, run_scripts, run_torchrun
from tests.tiny_models import MOE_CONFIGS


def _config(name="deepseek_v3", **changes):
    arch, kwargs = MOE_CONFIGS[name]
    return dict(kwargs, architectures=[arch], **changes)


def test_the_config_maps_to_megatron():
    from common.model.bridge import parse_hf_config, transformer_config

    spec = parse_hf_config(_config())
    assert spec.moe.moe_layers == [False, True, True]  # first_k_dense_replace=1
    config = transformer_config(spec)
    assert (
        config.q_lora_rank,
        config.kv_lora_rank,
        config.qk_head_dim,
        config.qk_pos_emb_head_dim,
        config.v_head_dim,
    ) == (32, 24, 16, 8, 16)
    assert (
        config.rope_type,
        config.rotary_scaling_factor,
        config.original_max_position_embeddings,
        config.mscale,
        config.mscale_all_dim,
    ) == ("yarn", 4.0, 64, 1.0, 1.0)
    assert (
        config.moe_router_score_function,
        config.moe_router_enable_expert_bias,
        config.moe_router_num_groups,
        config.moe_router_group_topk,
        config.moe_router_topk_scaling_factor,
    ) == ("sigmoid", True, 4, 2, 2.5)
    assert config.moe_router_bias_update_rate == 0.0 and config.moe_aux_loss_coeff == 0.0
    assert config.moe_shared_expert_intermediate_size == 32 and not config.moe_shared_expert_gate
    small = transformer_config(parse_hf_config(_config("deepseek_v3_small")))
    assert small.q_lora_rank is None and small.rope_type == "rope" and small.moe_router_num_groups is None


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_interleave=False), "rope_interleave"),
        (dict(num_experts_per_tok=3), "num_experts_per_tok"),  # megatron's group score needs topk = 2 * topk_group
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(n_shared_experts=0), "n_shared_experts"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 0.707,
                    "rope_theta": 1e4,
                }
            ),
            "mscale",
        ),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    ],
)
def test_unrepresentable_deepseek_configs_are_refused(changes, message):
    from common.model.bridge import parse_hf_config
    from common.model.unsupported import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**changes))


def test_tensor_parallel_must_divide_the_latent_projections():
    from common.model.bridge import check_parallel_layout, parse_hf_config

    spec = parse_hf_config(_config(kv_lora_rank=25))  # 25 + 8 rows of kv_a_proj_with_mqa
    with pytest.raises(ValueError, match="kv_lora_rank"):
        check_parallel_layout(spec, tp=2)
    # the shared rope key's rows count too: 24 + 10 rows do not split over TP=4, though the
    # latent's 24 do (and every other dimension does: with the 8 rope rows of the tiny model it is fine)
    check_parallel_layout(parse_hf_config(_config()), tp=4)
    with pytest.raises(ValueError, match=r"--tp 4 must divide kv_lora_rank \+ qk_rope_head_dim = 34"):
        check_parallel_layout(parse_hf_config(_config(qk_rope_head_dim=10)), tp=4)


def test_bf16_export_keeps_the_router_bias_in_fp32(tiny_moe_models_dir, tmp_path):
    """merge_to_hf.py --dtype bf16: every weight in bf16, the score-correction bias fp32 and
    bit-equal (rounded to bf16 it would change which experts are chosen). The config says one
    multi-token-prediction layer, as DeepSeek-V3's: the note names it (layer 3 after the 3 decoder
    layers) and the output's config.json has none."""
    import json
    import shutil

    from tests.test_convert import hf_tensors

    hf_dir = tmp_path / "deepseek_v3"
    shutil.copytree(tiny_moe_models_dir / "deepseek_v3", hf_dir)
    config = json.load(open(hf_dir / "config.json"))
    json.dump(dict(config, num_nextn_predict_layers=1), open(hf_dir / "config.json", "w"))
    run_script("convert_hf_to_mcore.py", "--hf", hf_dir, "--out", tmp_path / "ckpt", "--dtype", "fp32")
    proc = run_script("merge_to_hf.py", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf", "--dtype", "bf16")
    assert "note: the 1 multi-token-prediction layer(s) of the source (model.layers.3.*) are not" in proc.stdout
    assert json.load(open(tmp_path / "hf" / "config.json"))["num_nextn_predict_layers"] == 0
    original, merged = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(merged)
    for name, tensor in merged.items():
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, original[name].bfloat16()), name


def test_grpo_learns_with_the_embedded_deepseek_at_ep2(tmp_path):
    """train_grpo.py --embedded-model deepseek at EP=2 (gloo, all-to-all): the embedded task is
    being learned (measured with the reference model: greedy validation accuracy 0.0 -> 0.3 and
    mean reward of steps 0-9 0.007 -> steps 40-49 0.29; without it, --kl-coef 0 as here to save
    its pass: accuracy 0.0 -> 0.5), the trainer's logprobs equal the CPU engine's (transformers)
    and the expert load is logged."""
    run_torchrun(
        "train_grpo.py",
        2,
        "--embedded-model",
        "deepseek",
        "--ep",
        2,
        "--steps",
        50,
        "--eval-every",
        25,
        "--kl-coef",
        0,
        "--log-samples-every",
        0,
        "--out",
        tmp_path,
    )  # no reference pass: -20% time
    rows = read_metrics(tmp_path)
    evals = {m["step"]: m["eval_accuracy"] for m in rows if "eval_accuracy" in m}
    print(f"eval accuracy {evals}; first logprob_mismatch {rows[0]['logprob_mismatch']:.1e}")
    reward = [m["reward_mean"] for m in rows]
    assert evals[49] >= evals[0] + 0.2 and sum(reward[40:]) / 10 >= sum(reward[:10]) / 10 + 0.15
    assert rows[0]["logprob_mismatch"] < 1e-5
    for m in rows:  # 8 experts, top-4: 1.0 is balanced, 2.0 is four experts taking every token
        assert 1.0 <= m["moe_load_mean"] <= m["moe_load_max"] <= 2.0


def test_deepseek_at_cp2_ep2_matches_transformers(tmp_path):
    """Context parallelism with multi-latent attention (megatron rotates each CP rank's chunks,
    SDPAttention all-gathers keys and values) and the experts' all-to-all across the two CP
    ranks: the trainer's logprobs agree with transformers' on 16-token responses. With the
    engine's routes replayed (--routing-replay rollout: the experts transformers chose after the
    score-correction bias and the group limit, sliced for each CP rank): the trainer's own
    choice at the same weights is the replayed one."""
    run_torchrun(
        "train_grpo.py",
        2,
        "--embedded-model",
        "deepseek",
        "--cp",
        2,
        "--ep",
        2,
        "--routing-replay",
        "rollout",
        "--steps",
        1,
        "--max-new-tokens",
        16,
        "--eval-every",
        0,
        "--log-samples-every",
        0,
        "--out",
        tmp_path,
    )
    (row,) = read_metrics(tmp_path)
    print("logprob_mismatch", row["logprob_mismatch"], "response_len_mean", row["response_len_mean"])
    print("route_mismatch", row["route_mismatch"], row["route_mismatch_update"])
    assert row["response_len_mean"] > 8 and row["logprob_mismatch"] < 1e-5  # measured 1.0e-7
    assert row["route_mismatch"] <= 0.01


# the released DeepSeek-V3 config.json (transformers-4 style rope_scaling, 1 MTP layer)
DEEPSEEK_V3_671B = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=10000,
    num_nextn_predict_layers=1,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)


def test_the_released_config_parses_with_its_active_size():
    """DeepSeek-V3 reports 37B activated parameters per token; the FLOPs count (2 per matmul
    weight: attention, the 3 dense MLPs, router + 8 experts + the shared expert of 58 MoE
    layers, the LM head; no embedding lookup) gives 36.6B."""
    from common.model.bridge import parse_hf_config
    from common.model.flops import forward_flops_per_token

    spec = parse_hf_config(DEEPSEEK_V3_671B)
    assert spec.mla.rope["rope_type"] == "yarn" and spec.mla.rope["rotary_scaling_factor"] == 40.0
    assert sum(spec.moe.moe_layers) == 58
    active = forward_flops_per_token(spec, 1) / 2
    assert 36.0e9 < active < 37.5e9, active


def test_fp8_checkpoints_are_refused_with_the_way_out():
    from common.model.bridge import parse_hf_config
    from common.model.unsupported import UnsupportedModelError

    fp8 = dict(DEEPSEEK_V3_671B, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedModelError, match="fp8_cast_bf16"):
        parse_hf_config(fp8)


def test_grpo_on_uneven_pipeline_stages_matches_transformers(tiny_moe_models_dir, tmp_path):
    """The 3-layer tiny DeepSeek-V3 at --pp 2 (stages of 2 + 1 layers, chosen automatically)
    and EP=2: two GRPO steps run, and the trainer's logprobs of the first step's samples equal
    the CPU engine's (transformers) on the same weights. With --routing-replay old each stage
    records its MoE layers' routes in the old-logprob pass, all four ranks' are gathered, and the
    first update, replaying them, computes the old pass's logprobs."""
    run_torchrun(
        "train_grpo.py",
        4,
        "--model",
        tiny_moe_models_dir / "deepseek_v3",
        "--pp",
        2,
        "--ep",
        2,
        "--routing-replay",
        "old",
        "--steps",
        2,
        "--max-new-tokens",
        8,
        "--eval-every",
        0,
        "--log-samples-every",
        0,
        "--out",
        tmp_path,
    )
    rows = read_metrics(tmp_path)
    print("logprob_mismatch", [m["logprob_mismatch"] for m in rows], rows[0]["first_update_logprob_err"])
    assert len(rows) == 2 and rows[0]["logprob_mismatch"] < 1e-5
    assert rows[0]["first_update_logprob_err"] < 1e-5 and "route_mismatch_update" in rows[0]


def test_router_bias_update_is_off_by_default_and_synced_when_on(tmp_path):
    """--moe-router-bias-update-rate: megatron's aux-loss-free balancing moves every expert's
    score-correction bias by +-rate (0 where the expert has exactly the mean load) after each
    optimizer step. Off (0) by default: the bias after the first step equals the loaded one bit
    for bit; at 0.01 every entry moved by 0 or 0.01 and some did, and the rollout engine's
    logprobs of step 1 still equal the trainer's (the changed bias was synced). One update per
    step here (a mini-batch of the whole rollout batch, one epoch)."""
    from tests.test_convert import hf_tensors

    rates = (0.0, 0.01)
    outs = {rate: tmp_path / f"rate{rate}" for rate in rates}
    run_scripts(
        *[
            (
                "train_grpo.py",
                "--embedded-model",
                "deepseek",
                "--steps",
                2,
                "--save-every",
                1,
                "--eval-every",
                0,
                "--prompts-per-step",
                8,
                "--samples-per-prompt",
                4,
                "--mini-batch-size",
                32,
                "--ppo-epochs",
                1,
                "--log-samples-every",
                0,
                "--moe-router-bias-update-rate",
                rate,
                "--out",
                outs[rate],
            )
            for rate in rates
        ]
    )
    run_scripts(
        *[
            (
                "merge_to_hf.py",
                "--ckpt",
                outs[rate] / "checkpoints" / "step_000001",
                "--out",
                outs[rate] / "hf",
                "--dtype",
                "fp32",
            )
            for rate in rates
        ]
    )
    changes = {}
    for rate, out in outs.items():
        before, after = hf_tensors(out / "embedded_model"), hf_tensors(out / "hf")
        bias = [name for name in after if name.endswith("e_score_correction_bias")]
        changes[rate] = torch.cat([(after[n] - before[n]).flatten() for n in bias])
        metrics = read_metrics(out)
        assert metrics[1]["logprob_mismatch"] < 1e-5, rate
        # a save each step: what it waited for the previous one is part of the loop's save time
        assert all(0 <= m["save_wait_sec"] <= m["save_s"] for m in metrics) and metrics[0]["save_wait_sec"] < 0.5
    print("bias change after one update at 0.01:", changes[0.01].tolist())
    assert torch.equal(changes[0.0], torch.zeros_like(changes[0.0]))
    moved = changes[0.01].abs()
    assert torch.all((moved < 1e-6) | ((moved - 0.01).abs() < 1e-6)) and moved.max() > 0


def test_router_bias_update_needs_a_model_with_a_bias(tmp_path):
    proc = run_script(
        "train_grpo.py",
        "--embedded-model",
        "moe",
        "--moe-router-bias-update-rate",
        0.001,
        "--out",
        tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "score-correction bias" in proc.stderr
