"""The memory plan (common/model/sizes.py, common/run/memory_plan.py, common/run/memory_check.py) against
ground truth.

    .venv/bin/python -m pytest -q tests/test_memory_plan.py

- parameters per rank: the plan's count equals the numel of the chunks build_model makes, for
  every tiny family (dense, MoE, MLA, Qwen3.5 and its MoE; the critic's value head) at TP=1 (TP=2, PP=2 and VPP:
  tests/test_model_parity.py, on the ranks of its torchrun launches);
- activations: the formula within 10% of the bytes autograd saves during one forward (fp32, CPU,
  saved_tensors_hooks) for Qwen2, Qwen3-MoE and DeepSeek-V3, with and without recompute; the
  update's tensors on a GPU within 3% of the peaks bench/train.py measured on H100/H200s;
- every item and phase of a 2-layer model at TP=2, DP=2 counted by hand, and its pinned host
  memory in common/run/host_memory.py's form;
- --dry-run of both scripts on a Qwen2-7B config.json alone: the plan in seconds, exit 0; a
  plan that cannot fit exits 2 with one line; the derived --gpu-memory-utilization reaches the
  engine, which is started and put to sleep before the trainer's state is built.
"""

import json
import re
import sys
import time

import pytest

from common.model import sizes as S
from common.model.bridge import parse_hf_config
from common.run import memory_plan as M
from tests.conftest import run_script
from tests.tiny_models import ARCH_CONFIGS, GDN_CONFIGS, GPTOSS_CONFIGS, MOE_CONFIGS

TINY = {**ARCH_CONFIGS, **MOE_CONFIGS, **GDN_CONFIGS, **GPTOSS_CONFIGS}


def tiny_spec(name):
    arch, config = TINY[name]
    return parse_hf_config(dict(config, architectures=[arch]))


@pytest.fixture(scope="module")
def world_of_one():
    from common.run.dist import destroy_distributed, init_distributed

    init_distributed()
    yield
    destroy_distributed()


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameter_count_is_what_build_model_makes(name, world_of_one):
    from common.model.critic import build_critic
    from common.model.gpt import build_model

    spec = tiny_spec(name)
    layers = range(spec.num_layers)
    policy = sum(p.numel() for chunk in build_model(spec) for p in chunk.parameters())
    critic = sum(p.numel() for chunk in build_critic(spec) for p in chunk.parameters())
    assert S.count_parameters(spec, layers).total == policy
    assert S.count_parameters(spec, layers, value_head=True).total == critic
    if spec.moe is not None:  # the routed experts apart (their optimizer shards over expert-DP)
        experts = sum(
            p.numel() for chunk in build_model(spec) for n, p in chunk.named_parameters() if ".local_experts." in n
        )
        assert S.count_parameters(spec, layers).experts == experts
    # --lora-rank: the adapters add_lora gives every attention and MLP linear (MLA's, shared experts') of it
    from common.model.lora import adapter_bytes, add_lora

    chunks = build_model(spec)
    add_lora(chunks, rank=4, alpha=8.0, targets=("attention", "mlp"))
    assert S.count_lora_parameters(spec, layers, rank=4, targets=("attention", "mlp")) == adapter_bytes(chunks)[0]


def saved_bytes_per_token(spec, tokens, recompute, modules):
    """Bytes autograd saves for the backward in one forward of the DDP-wrapped model (each storage
    once; parameters and DDP's buffers, of which the experts' stacked weights are views, left out),
    per token. The CPU's math attention of DeepSeek-V3's MLA keeps (heads, T, T) probabilities a
    GPU's flash kernel does not: those are left out too (the formula has no per-token term for them)."""
    import torch

    from common.model.bridge import recompute_config
    from common.model.gpt import build_model
    from common.train.setup import setup_training

    chunks = build_model(spec, init_weights=True, **recompute_config(recompute, modules, 1))
    (model,), _, _ = setup_training(chunks, lr=1e-3)
    model.train()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for buffer in list(model.buffers) + list(model.expert_parallel_buffers):
        skip |= {t.untyped_storage().data_ptr() for t in (buffer.param_data, buffer.grad_data) if t is not None}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        square = t.dim() >= 3 and t.shape[-1] == t.shape[-2] == tokens  # (.., T, T)
        if storage.data_ptr() not in skip and not square:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, spec.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, torch.arange(tokens)[None], None)
    return sum(saved.values()) / tokens


@pytest.mark.parametrize(
    "name, recompute, modules",
    [
        ("qwen2", "none", ()),
        ("qwen2", "selective", ("core_attn", "mlp")),
        ("qwen2", "full", ()),
        ("qwen3_moe", "none", ()),
        ("qwen3_moe", "selective", ("moe",)),
        ("deepseek_v3", "none", ()),
        ("deepseek_v3", "selective", ("core_attn", "shared_experts")),
    ],
)
def test_activation_formula_matches_what_autograd_saves(name, recompute, modules, world_of_one):
    spec, tokens = tiny_spec(name), 96
    measured = saved_bytes_per_token(spec, tokens, recompute, modules)
    saved, _ = S.stage_activation_bytes(
        spec, range(spec.num_layers), dtype_bytes=4, device="cpu", recompute=recompute, recompute_modules=modules
    )
    h = spec.hidden_size
    saved += 3 * h * 4 + 4 + 8  # beyond the layers: the final norm, the output layer's input, the token ids
    print(f"{name} {recompute}: measured {measured:.0f} B/token, formula {saved:.0f}")
    assert abs(saved / measured - 1) < 0.1
    if recompute == "none":  # a recompute that saves nothing would pass the 10% too: it must save
        assert measured > 1.5 * saved_bytes_per_token(spec, tokens, "full", ())


# Peak torch.cuda.max_memory_allocated of bench/train.py's step (GiB; docs/performance.md, H200s and
# one H100, 2026-11-21..27): Qwen2 shapes, rows of 4096 or 16384 tokens, the distributed optimizer,
# no reference. (shape, layout, tokens per micro-batch, recompute, measured GiB)
MEASURED_UPDATE_PEAKS = [
    ("qwen2-1.5b", dict(world=1, tp=1), 4 * 4096, "none", 68.2),
    ("qwen2-1.5b", dict(world=1, tp=1), 2 * 4096, "none", 47.1),
    ("qwen2-1.5b", dict(world=1, tp=1), 16384, "selective", 45.2),
    ("qwen2-1.5b", dict(world=1, tp=1), 16384, "full", 36.9),
    ("qwen2-7b", dict(world=2, tp=2), 2 * 4096, "none", 87.4),
    ("qwen2-7b", dict(world=4, tp=4), 4096, "none", 39.6),
    ("qwen2-7b", dict(world=2, tp=2), 16384, "none", 110.8),
    ("qwen2-7b", dict(world=2, tp=2), 16384, "full", 72.2),
]


@pytest.mark.parametrize("shape, layout, tokens, recompute, measured", MEASURED_UPDATE_PEAKS)
def test_update_tensors_match_the_measured_gpu_peaks(shape, layout, tokens, recompute, measured):
    """The GPU formula (bf16, fused norms and SwiGLU, compiled RoPE; weights, fp32 gradients, the
    sharded optimizer, the activations and the logits with their gradient) against the peak
    allocations measured on GPUs: within 3%. (The plan adds the allocator's slack and the fixed
    overhead on top: memory that max_memory_allocated does not see.)"""
    from bench.harness import SHAPES

    plan = M.plan_memory(
        parse_hf_config(SHAPES[shape]),
        **layout,
        engine=None,
        update_tokens=tokens,
        logprob_tokens=tokens,
        recompute=recompute,
        recompute_modules=("core_attn", "mlp"),
        offload_params=False,
        offload_optimizer=False,
        gpu_bytes=141e9,
    )
    tensors = sum(item.device.get("update", 0) for item in plan.shown.items if item.torch) / 2**30
    print(f"{shape} {layout} {tokens} {recompute}: plan {tensors:.1f} GiB, measured {measured}")
    assert abs(tensors / measured - 1) < 0.03


# A 2-layer Qwen2 counted by hand at TP=2, DP=2 (world 4): vocabulary 1000 padded to 1024 (a multiple
# of 128 x tp), 512 rows per rank.
SMALL = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# per rank: embedding 512 x 64 = 32768, output layer 32768, final norm 64; per layer: 2 norms 128,
# qkv (4 + 2 + 2) x 16 = 128 rows x 64 / 2 = 4096 + bias 64, proj 64 x 64 / 2 = 2048, MLP 3 x 128 x 64 / 2
# = 12288: 18624. Total 32768 + 32768 + 64 + 2 x 18624 = 102848.
PARAMS = 102848
WEIGHTS, GRADS = PARAMS * 2, PARAMS * 4  # bf16, fp32
MAIN, ADAM = PARAMS * 4 / 2, PARAMS * 8 / 2  # sharded over DP 2
# the HF model: 2 x 64000 (embeddings, lm_head) + 64 + per layer 128 + q 4096 + 64 + k, v 2 x (2048 + 32)
# + o 4096 + MLP 24576 = 37120: 202304 parameters; the engine's bf16 shard at rollout TP 2: 202304 bytes
ENGINE = 202304
# activations per token and layer (GPU, bf16): norms 2 x (64 x 2 + 4) = 264, their outputs 2 x 128 = 256,
# qkv output (2 + 2 x 1) x 16 x 2 = 128, rotated q and k (2 + 1) x 16 x 2 = 96, attention output 64,
# log-sum-exp 2 x 4 = 8, RoPE angles 16 x 4 = 64, MLP (2 x 64 + 64) x 2 = 384: 1264; 2 layers x 1024 tokens
ACTIVATIONS = 2 * 1264 * 1024
WORKING = (2 * 64 + 3 * 128 // 2) * 2 * 2048  # forward-only: input, norm output, the MLP's fc1 + act, per token
LOGITS_FWD, LOGITS_UPDATE = 2048 * 512 * 2, 1024 * 512 * 2 * 2  # (tokens, 512 columns): bf16; + its gradient
BUCKETS = 2 * 2**20  # two 1-MB sync buckets


def small_plan(**changes):
    kwargs = dict(
        world=4,
        tp=2,
        reference=True,
        rollout_tp=2,
        engine_share=0.25,
        update_tokens=1024,
        logprob_tokens=2048,
        sync_bucket_mb=1,
        gpu_bytes=20e9,
        gpus_per_node=4,
        node_bytes=100e9,
    )
    return M.plan_memory(parse_hf_config(SMALL), **dict(kwargs, **changes))


def test_every_phase_counted_by_hand():
    plan = small_plan()
    assert S.hf_parameter_count(parse_hf_config(SMALL)) == ENGINE
    slack, fixed = M.FRAGMENTATION, M.PROCESS_OVERHEAD + M.ENGINE_RESIDENT  # 3 + 8 GB
    torch_sync = WEIGHTS + BUCKETS  # the policy read by the sync (the optimizer offloaded, grads freed)
    assert plan.total("sync") == pytest.approx(torch_sync * (1 + slack) + ENGINE + fixed, rel=1e-12)
    assert plan.total("rollout") == pytest.approx(0.25 * 20e9 + fixed, rel=1e-12)  # the engine's share, nothing else
    kv = next(i for i in plan.shown.items if i.name == "engine KV cache").device["rollout"]
    assert kv == pytest.approx(0.25 * 20e9 - ENGINE - M.ENGINE_WORKSPACE, rel=1e-12)
    assert plan.kv_tokens == int(kv // (2 * 2 * 1 * 16 * 2))  # k and v, 2 layers, 1 kv head per rank, d 16, bf16
    torch_logprob = WEIGHTS + WEIGHTS + WORKING + LOGITS_FWD  # policy, reference
    assert plan.total("logprob") == pytest.approx(torch_logprob * (1 + slack) + fixed, rel=1e-12)
    state = WEIGHTS + GRADS + MAIN + ADAM
    assert plan.total("update") == pytest.approx((state + ACTIVATIONS + LOGITS_UPDATE) * (1 + slack) + fixed, rel=1e-12)
    assert plan.total("save") == pytest.approx(state * (1 + slack) + fixed, rel=1e-12)
    # pinned per rank: the offload buffers (policy, main weights, Adam, reference); staging adds nothing
    assert plan.host_parts() == {"offload buffers": WEIGHTS + MAIN + ADAM + WEIGHTS, "checkpoint staging": 0}
    assert plan.problems() == [] and plan.host_problems() == []


# LoRA rank 8 on attention and MLP of SMALL at TP=2, per rank and layer (common/model/lora.py's sharding):
# qkv (column) A 8 x 64 + B 128/2 x 8 = 1024, proj (row) A 8 x 64/2 + B 64 x 8 = 768, fc1 (column) A 8 x 64
# + B 256/2 x 8 = 1536, fc2 (row) A 8 x 128/2 + B 64 x 8 = 1024: 4352; 2 layers
LORA = 2 * 4352


def test_engines_of_their_own_count_the_sync_buckets_where_they_are_sent():
    """--rollout-gpus (no engine beside the trainer): the first rank's flat buckets in the sync phase, or, with the
    sync sent behind the next step's passes (--sync-overlap), in every phase but the save."""
    alone, step, behind = (small_plan(engine=None, remote_sync=r) for r in (None, "step", "behind"))
    buckets = min(2 * 2**20, 2 * 2 * ENGINE) * (1 + M.FRAGMENTATION)  # two 1 MB buckets at most, bf16
    for phase in ("sync", "rollout", "logprob", "update", "save"):
        sent_behind = phase != "save"
        assert step.total(phase) - alone.total(phase) == pytest.approx(buckets * (phase == "sync"), rel=1e-9)
        assert behind.total(phase) - alone.total(phase) == pytest.approx(buckets * sent_behind, rel=1e-9)


def test_lora_counts_adapters_alone_and_no_reference():
    """--lora-rank: bf16 weights of the base and the adapters; gradients, main weights and Adam of the
    adapters only; no reference copy (the policy with its adapters off)."""
    spec = parse_hf_config(SMALL)
    assert S.count_lora_parameters(spec, range(2), rank=8, targets=("attention", "mlp"), tp=2) == LORA
    assert S.count_lora_parameters(spec, range(2), rank=8, targets=("mlp",), tp=2) == 2 * (1536 + 1024)
    plan = small_plan(lora=dict(rank=8, targets=("attention", "mlp")))
    slack, fixed = M.FRAGMENTATION, M.PROCESS_OVERHEAD + M.ENGINE_RESIDENT
    weights, grads, main, adam = WEIGHTS + 2 * LORA, 4 * LORA, 4 * LORA / 2, 8 * LORA / 2
    assert plan.total("logprob") == pytest.approx((weights + WORKING + LOGITS_FWD) * (1 + slack) + fixed, rel=1e-12)
    update = weights + grads + main + adam + ACTIVATIONS + LOGITS_UPDATE
    assert plan.total("update") == pytest.approx(update * (1 + slack) + fixed, rel=1e-12)
    assert plan.host_parts() == {"offload buffers": weights + main + adam, "checkpoint staging": 0}
    # kept on the GPU, a save stages what a LoRA checkpoint holds: the adapters and their optimizer state
    kept = small_plan(lora=dict(rank=8, targets=("attention", "mlp")), offload_params=False, offload_optimizer=False)
    assert kept.host_parts() == {"offload buffers": 0, "checkpoint staging": 2 * LORA + main + adam}


def test_without_offload_the_state_stays_and_staging_pins_it():
    plan = small_plan(offload_params=False, offload_optimizer=False, engine_share=None)
    state = WEIGHTS + GRADS + MAIN + ADAM + WEIGHTS  # + the reference
    # the engine's share derived: 95% of the GPU less what the trainer keeps and the fixed overhead, in hundredths
    residual = state * (1 + M.FRAGMENTATION) + M.PROCESS_OVERHEAD + M.ENGINE_RESIDENT
    assert plan.engine_share_derived and plan.engine_share == int((19e9 - residual) / 20e9 * 100) / 100 == 0.39
    assert plan.total("rollout") == pytest.approx(0.39 * 20e9 + residual, rel=1e-12)
    assert plan.host_parts() == {"offload buffers": 0, "checkpoint staging": WEIGHTS + MAIN + ADAM}
    # --save-any-layout at DP 2: the save gathers 12 bytes per parameter of the rank's slice
    gathered = small_plan(save_any_layout=True)
    assert gathered.shown.host_save == 12 * PARAMS and small_plan().shown.host_save == 0


def test_ppo_updates_critic_then_actor_in_turns():
    """PPO with the optimizers offloaded (train_ppo.py, common/train/colocation.py turn): a critic phase
    with only the critic's optimizer state and gradients beside the two models' weights, then the
    actor's update and the save with only the actor's; without the offload, one update with both."""
    spec = parse_hf_config(SMALL)
    plan = small_plan(critic=spec)
    assert plan.phases == M.TURN_PHASES and small_plan().phases == M.PHASES
    items = {item.name: item for item in plan.shown.items}
    cw = items["critic weights (bf16)"].device["critic"]
    cg, co = items["critic gradients (fp32)"].device, items["critic optimizer (main + Adam)"].device
    assert set(cg) == set(co) == {"critic"}  # in host memory (the optimizer) or freed (gradients) otherwise
    assert cg["critic"] == 2 * cw and co["critic"] == 3 * cw  # fp32 grads; 12 B per parameter over DP 2
    slack, fixed = 1 + M.FRAGMENTATION, M.PROCESS_OVERHEAD + M.ENGINE_RESIDENT
    critic_acts = items["critic activations (1024 tokens)"].device["critic"]
    assert critic_acts > 0 and set(items["critic activations (1024 tokens)"].device) == {"critic"}
    assert plan.total("critic") == pytest.approx(
        (WEIGHTS + cw + cg["critic"] + co["critic"] + critic_acts) * slack + fixed
    )
    state = WEIGHTS + GRADS + MAIN + ADAM
    assert plan.total("update") == pytest.approx((state + cw + ACTIVATIONS + LOGITS_UPDATE) * slack + fixed)
    assert plan.total("save") == pytest.approx((state + cw) * slack + fixed)
    assert plan.host_parts()["offload buffers"] == WEIGHTS + MAIN + ADAM + WEIGHTS + cw + co["critic"]
    together = small_plan(critic=spec, offload_optimizer=False, engine_share=0.1)  # nothing to turn
    assert together.phases == M.PHASES
    assert together.total("update") == pytest.approx(
        (state + cw + cg["critic"] + co["critic"] + ACTIVATIONS + LOGITS_UPDATE) * slack + fixed
    )


def test_host_checks_count_the_stage_that_pins_the_most():
    """Pipeline stages that differ: the GPU table shows the stage fullest on the GPU (here stage 0: 13
    layers + the embedding, 2 micro-batches in flight), but a node's host memory is checked as if each
    of its ranks pinned what the stage that pins the most does (stage 1: 15 layers + the output layer)."""
    plan = M.plan_memory(
        parse_hf_config(QWEN2_7B),
        **dict(world=8, tp=1, pp=2, first_stage_layers=13, gpu_bytes=80e9, gpus_per_node=8),
        **dict(update_tokens=8192, logprob_tokens=8192, update_micro_batches=8, engine_share=0.3),
    )
    first, last = plan.stages
    assert plan.shown is first and plan.host_stage is last and last.host > first.host
    assert plan.host_parts()["offload buffers"] == last.host
    node = 8 * (first.host + last.host) / 2  # room for the shown stage's pins on 8 ranks, not the last's
    plan.node_bytes = node
    assert plan.host_problems() == [("refuse", "pinned", 8 * last.host, node)]


def test_refusals_name_the_phase_and_the_node():
    from common.run.host_memory import host_memory_problem

    def problems(plan):
        return [(level, phase) for level, phase, _ in plan.problems()]

    # the rollout holds the engine's share and the fixed 11 GB: 0.43 x 20 + 11 = 19.6 GB of 20 is warned
    # about (> 95%), 0.46 x 20 + 11 = 20.2 GB refused; a share of 2.5 GB leaves no KV cache beside the
    # engine's workspace (and weights)
    assert problems(small_plan(engine_share=0.43)) == [("warn", "rollout")]
    assert problems(small_plan(engine_share=0.46)) == [("refuse", "rollout")]
    assert problems(small_plan(engine_share=0.125)) == [("refuse", "kv cache")]
    node = small_plan(node_bytes=3e6)  # 4 ranks x 1.03 MB pinned
    assert node.host_problems() == [("refuse", "pinned", 4 * (WEIGHTS + MAIN + ADAM + WEIGHTS), 3e6)]
    message = host_memory_problem([("node0", node.host_parts(), 3e6)] * 4)  # the start-up check's own form
    assert message.startswith("the 4 rank(s) of this job on node0 would pin 0.0 GB")


def test_pipeline_stages_and_in_flight_micro_batches():
    assert S.stage_layer_indices(6, pp=2, vpp=2) == [[0, 1, 3, 4], [2, 5]]  # megatron's uneven split 4 + 2
    assert S.stage_layer_indices(3, pp=2) == [[0, 1], [2]]
    assert S.stage_layer_indices(8, pp=4, first=1, last=1) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    # 1F1B: the first of 4 stages holds 4 micro-batches, the last 1; never more than there are
    assert [S.in_flight_micro_batches(r, 4, None, 16) for r in range(4)] == [4, 3, 2, 1]
    assert S.in_flight_micro_batches(0, 4, None, 2) == 2


QWEN2_7B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)


@pytest.fixture
def qwen2_7b(tmp_path):
    """A Qwen2-7B model directory with nothing but config.json (no weights, no tokenizer)."""
    path = tmp_path / "qwen2-7b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN2_7B))
    return path


def totals(stdout):
    row = next(line for line in stdout.splitlines() if line.startswith("total "))
    return [float(x) for x in row.split()[1:]]


def planned(**layout):
    """The printed totals (GB, per phase and pinned host) of plan_memory given the dry runs' flags by
    hand: the scripts' defaults (8 samples x (1024 + 1024) tokens per micro-batch, 4 micro-batches of
    a DP rank's 32 x 8 / 2 samples, the reference at --kl-coef 0.001) with --recompute full."""
    kwargs = dict(
        reference=True,
        rollout_tp=2,
        update_tokens=8 * 2048,
        update_micro_batches=32 * 8 // (layout["world"] // layout["tp"]) // 8,
        logprob_tokens=8 * 2048,
        recompute="full",
        recompute_modules=("core_attn",),
        gpu_bytes=80e9,
        node_bytes=500e9,
    )
    plan = M.plan_memory(parse_hf_config(QWEN2_7B), **dict(kwargs, **layout))
    return [round(plan.total(p) / 1e9, 1) for p in plan.phases] + [round(plan.shown.host / 1e9, 1)]


def totals_of(printed):
    return printed[M.PHASES.index("update")]


def test_dry_run_prints_the_plan_of_a_config_alone(qwen2_7b, tmp_path):
    common = ["--model", qwen2_7b, "--dry-run", "--gpu-memory-gb", 80, "--host-memory-gb", 500]
    tick = time.time()
    grpo = run_script(
        "train_grpo.py",
        *common,
        *("--world-size", 4, "--gpus-per-node", 4, "--tp", 2, "--rollout-tp", 2, "--recompute", "full"),
        *("--out", tmp_path / "never"),
    )
    seconds = time.time() - tick
    print(grpo.stdout)
    assert seconds < 60 and not (tmp_path / "never").exists()  # nothing built, nothing written
    assert totals(grpo.stdout) == planned(world=4, tp=2, gpus_per_node=4)
    assert totals(grpo.stdout)[3] < 80 < totals_of(planned(world=4, tp=2, gpus_per_node=4, recompute="none"))
    assert "derived: --gpu-memory-utilization 0.81" in grpo.stdout  # (0.95 x 80 - 11 GB fixed) / 80
    assert "derived: --no-save-any-layout (data parallel 2" in grpo.stdout
    assert "node: 4 rank(s) x 38.1 GB pinned = 152.3 GB" in grpo.stdout
    assert "on 8 x 80 GB GPUs (--world-size 8 --gpus-per-node 8 --gpu-memory-gb 80)" in grpo.stdout
    ppo = run_script(
        "train_ppo.py",
        *common,
        *("--world-size", 8, "--gpus-per-node", 8, "--tp", 4, "--rollout-tp", 2, "--recompute", "full"),
    )
    print(ppo.stdout)
    assert "critic optimizer (main + Adam)" in ppo.stdout
    assert totals(ppo.stdout) == planned(world=8, tp=4, gpus_per_node=8, critic=parse_hf_config(QWEN2_7B))
    assert "derived: --no-save-any-layout (data parallel 2" in ppo.stdout


def test_a_plan_that_cannot_fit_exits_2_with_one_line(qwen2_7b, tmp_path):
    def refused(*flags):
        proc = run_script(
            "train_grpo.py", "--model", qwen2_7b, "--dry-run", "--out", tmp_path / "never", *flags, check=False
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        return line

    # one 24 GB GPU: during the sync the policy's 15.2 GB beside the engine's 15.2 GB, 1.1 GB of buckets,
    # 5% slack over the policy and buckets, the fixed 11 GB: 43.4 GB
    line = refused("--gpu-memory-gb", 24)
    assert re.search(r"error: the sync phase needs 43\.4 GB on each GPU of 24\.0 GB \(policy weights 15\.2, ", line)
    assert "short by 19.4 GB; also over: rollout" in line and "no single change makes every phase fit" in line
    # 4 x 80 GB at TP 2: the update's 16384-token micro-batches (8 samples, given) do not fit; recompute
    # would, or 4096-token ones
    line = refused("--gpu-memory-gb", 80, "--world-size", 4, "--tp", 2, "--rollout-tp", 2, "--micro-batch-size", 8)
    update = planned(world=4, tp=2, gpus_per_node=1, recompute="none")[M.PHASES.index("update")]
    assert f"the update phase needs {update} GB on each GPU of 80.0 GB (activations 45." in line
    fixed = planned(world=4, tp=2, gpus_per_node=1)[M.PHASES.index("update")]
    assert f"try --recompute full ({fixed} GB), --micro-batch-tokens 4096 (" in line
    # the same with recompute fits the GPUs, but not a node of 100 GB: 4 ranks x 38.1 GB pinned
    flags = ("--world-size", 4, "--gpus-per-node", 4, "--tp", 2, "--rollout-tp", 2, "--recompute", "full")
    line = refused("--gpu-memory-gb", 80, *flags, "--host-memory-gb", 100)
    assert (
        "error: the 4 rank(s) of a node would pin 152.3 GB of host memory (offload buffers 152.3 GB) of 100.0" in line
    )


def test_engines_of_their_own_plan_the_trainer_gpus_and_advise_trainer_gpus(qwen2_7b, tmp_path):
    """--rollout-gpus: the plan is the trainer ranks' (no engine beside them), so the advice adds trainer GPUs
    (the engines' added to the launch) and leaves the engines' --rollout-tp alone; the 8-GPU line keeps the
    engines' GPUs out of the trainer's. Qwen2-7B at TP 2 on two of four 80 GB GPUs: the whole optimizer
    state stays on the trainer's GPUs (nothing is offloaded in this mode) and the update does not fit."""
    flags = ("--world-size", 4, "--gpus-per-node", 4, "--tp", 2, "--rollout-gpus", 2, "--off-policy-steps", 1)
    proc = run_script(
        "train_grpo.py",
        *("--model", qwen2_7b, "--dry-run", "--out", tmp_path / "never", "--gpu-memory-gb", 80),
        *("--host-memory-gb", 500, *flags, "--kl-coef", 0, "--micro-batch-tokens", 2048),
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "memory plan: Qwen2ForCausalLM" in proc.stdout and "world 2 (tp 2 dp 1)" in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    print(line)
    assert "error: the update phase needs 81.5 GB on each GPU of 80.0 GB (Adam moments 30.5, gradients 15.2" in line
    assert "4 trainer GPUs (a launch of 6) (57.6 GB), 4 trainer GPUs (a launch of 6) with --tp 4 (43.2 GB)" in line
    assert "--rollout-tp" not in line
    other = next(row for row in proc.stdout.splitlines() if row.startswith("on 8 x 80 GB GPUs"))
    assert "--gpu-memory-gb 80), 6 of them training (--rollout-gpus 2): " in other and other.endswith("fits")


def test_default_micro_batches_that_do_not_fit_become_a_token_budget(qwen2_7b, tmp_path):
    """The same 4 x 80 GB TP 2 plan with --micro-batch-size left to its default: instead of a refusal
    the update gets the largest power-of-two token budget that fits (4096: 16384 and 8192 do not),
    said in a "derived:" line, and the plan printed is that budget's."""
    proc = run_script(
        "train_grpo.py",
        *("--model", qwen2_7b, "--dry-run", "--out", tmp_path / "never", "--gpu-memory-gb", 80),
        *("--host-memory-gb", 500, "--world-size", 4, "--tp", 2, "--rollout-tp", 2),
    )
    assert "derived: --micro-batch-tokens 4096 (passes of --micro-batch-size 8 samples of up to 2048 tokens" in (
        proc.stdout
    )
    fits = planned(world=4, tp=2, gpus_per_node=1, recompute="none", update_tokens=4096, logprob_tokens=4096)
    assert totals(proc.stdout)[M.PHASES.index("update")] == totals_of(fits) < 80
    too_big = planned(world=4, tp=2, gpus_per_node=1, recompute="none", update_tokens=8192, logprob_tokens=8192)
    assert totals_of(too_big) > 80 * 0.95  # the next power of two up is refused (or warned) by the plan


@pytest.mark.parametrize("given,card_gb", [(None, None), ("0.3", None), (None, 40), ("0.15", 40), ("eager", None)])
def test_the_engine_starts_first_with_the_derived_share(given, card_gb, tmp_path, monkeypatch, capsys):
    """A CPU run of train_grpo.py planned for 20 GB GPUs with the vLLM engine (stood in for: it needs
    a GPU): the engine gets the share derived from the plan, (0.95 x 20 - 11 GB fixed - nothing kept
    by the trainer) / 20 = 0.40, or the one given, and is created and put to sleep before the
    policy's training state is set up. On a 40 GB card (stood in for) the plan stays the 20 GB one and
    the derived share, a fraction of the whole card for vLLM, halves (0.20); a given share is vLLM's
    own (of the card: 0.15 of 40 GB is 0.3 of the planned 20) and passes unchanged. --rollout-eager reaches
    the engine's enforce_eager (else False)."""
    import train_grpo
    from common.rollout import engines
    from common.run import memory_check
    from common.run.dist import destroy_distributed
    from common.train import setup

    events = []

    class Engine:  # what make_engine returns on a GPU, as far as the start-up uses it
        expert_blocks, local_reads = False, None

        def sleep(self):
            events.append("sleep")

    class Stop(Exception):
        pass

    def make_engine(use_vllm, hf_dir, *, rollout_tp, gpu_memory_utilization, enforce_eager, **kw):
        events.append(("engine", use_vllm, gpu_memory_utilization, enforce_eager))
        return Engine(), rollout_tp

    def setup_training(*args, **kwargs):
        events.append("training state")
        raise Stop

    monkeypatch.setattr(engines, "make_engine", make_engine)
    monkeypatch.setattr(engines, "vllm_available", lambda: True)  # preflight refuses --rollout vllm without it
    monkeypatch.setattr(setup, "setup_training", setup_training)
    monkeypatch.setattr(memory_check, "visible_gpu_bytes", lambda: card_gb and card_gb * 1e9)
    flags = ["--rollout", "vllm", "--gpu-memory-gb", "20", "--out", str(tmp_path / "run"), "--steps", "1"]
    eager = given == "eager"
    given = None if eager else given
    flags += ["--rollout-eager"] if eager else []
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", *flags, *(["--gpu-memory-utilization", given] if given else [])])
    try:
        with pytest.raises(Stop):
            train_grpo.main()
    finally:
        destroy_distributed()
    out = capsys.readouterr().out
    share = float(given) if given else 0.2 if card_gb else 0.4
    assert (f"derived: --gpu-memory-utilization {share:.2f} (" in out) == (given is None)
    assert ("the plan is for GPUs of 20.0 GB (--gpu-memory-gb) on this 40.0 GB GPU" in out) == bool(card_gb)
    assert events == [("engine", True, share, eager), "sleep", "training state"]
