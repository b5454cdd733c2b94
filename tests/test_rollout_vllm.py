"""CPU tests of common/rollout/vllm_engine.py: the parts that do not need vLLM itself.

    .venv/bin/python -m pytest -q tests/test_rollout_vllm.py

vLLM exists only on GPU machines, so here a small stand-in module named `vllm` replays the
shapes of vLLM 0.26's API that VLLMEngine relies on (LLM.generate returning, per request,
outputs[0].token_ids / finish_reason / FlatLogprobs with the sampled token first; the
in-process model handle; sleep / wake_up). It checks our glue, not vLLM:
replica arithmetic, eos ids (none: ignore_eos), prompt-major order, one request and seed per
sample, logprob extraction, the sleep/wake/sync state machine, that a failing weight load
still drains the producer (whose collectives every rank must finish), and agentic turns as one
request each (llm_engine.add_request / step) or, lock-step, in waves; at rollout TP 2 a wave group per
replica; a vision-language checkpoint started language_model_only. Agreement with the real vLLM is
tests/gpu/test_vllm_agreement.py.
"""

import json
import os
import sys
import types

import pytest
import torch

from common.rollout.engine import rollout_replica
from common.rollout.vllm_engine import eos_token_ids_of, replica_share


def test_rollout_replica_and_share():
    assert [rollout_replica(r, 2, world_size=4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [rollout_replica(r, 1, world_size=2) for r in range(2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="divide"):
        rollout_replica(0, 3, world_size=4)
    items = list(range(11))
    shares = [replica_share(items, r, 3) for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [replica_share([7], r, 2) for r in range(2)] == [[7], []]


def test_eos_token_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert eos_token_ids_of(str(tmp_path)) == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert eos_token_ids_of(str(tmp_path)) == [7, 5]  # generation_config wins, as in HF


# ---------------------------------------------------------------------------------------
# A stand-in for the few vLLM 0.26 objects VLLMEngine touches
class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(2))
        self.b = torch.nn.Parameter(torch.zeros(3))
        self.fail_after = None

    def load_weights(self, weights):  # like vLLM: lazy, returns the names it set
        loaded = set()
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                raise KeyError(name)
            getattr(self, name).data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.requests = kwargs, [], []
        self.model = FakeModel()
        runner = types.SimpleNamespace(get_model=lambda: self.model)
        worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))
        core = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=core))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm):
        """Response of request i: tokens [seed % 97, 2] (2 = eos) with logprobs -0.5, -0.25,
        stored as FlatLogprobs would be with logprobs=0 (one entry per position)."""
        self.requests.append((prompts, params))
        outs = []
        for p in params:
            tokens = [p.seed % 97, 2]
            flat = types.SimpleNamespace(
                start_indices=[0, 1], end_indices=[1, 2], token_ids=tokens, logprobs=[-0.5, -0.25]
            )
            done = types.SimpleNamespace(token_ids=tokens, logprobs=flat, finish_reason="stop")
            if self.kwargs.get("enable_return_routed_experts"):
                done.routed_experts = fake_routed_experts(len(prompts[len(outs)]["prompt_token_ids"]) + len(tokens) - 1)
            outs.append(types.SimpleNamespace(outputs=[done]))
        return outs


def fake_routed_experts(tokens, moe_layers=(True, False, True, True), topk=2, experts=8):
    """vLLM's routed_experts for `tokens` tokens: (tokens, num_hidden_layers, k) int32, token t's
    experts in MoE layer l (t + l) % E, (t + l + 1) % E at the layer's decoder index, dense
    layers never written (zeros)."""
    import numpy as np

    ids = np.zeros((tokens, len(moe_layers), topk), dtype=np.int32)
    for t in range(tokens):
        for layer, moe in enumerate(moe_layers):
            if moe:
                ids[t, layer] = [(t + layer + j) % experts for j in range(topk)]
    return ids


@pytest.fixture
def engine(monkeypatch, tmp_path):
    from common.run.dist import init_distributed

    # recorded as unset, so what init_distributed and the engine export is removed afterwards
    # (a leaked MASTER_PORT would send later tests' subprocesses to a port in use)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_USE_FLASHINFER_SAMPLER", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    init_distributed()
    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "max_position_embeddings": 256}))
    from common.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(str(tmp_path), rollout_tp=1, max_model_len=1025)


def test_engine_arguments(engine):
    kw = engine.llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs"  # temperature applied, see the docstring
    assert kw["skip_tokenizer_init"] and kw["enable_sleep_mode"] and kw["load_format"] == "dummy"
    assert engine.eos_token_ids == [2] and (engine.replica, engine.num_replicas) == (0, 1)
    # asked 1025 (train_grpo.py's default budget), but the model has 256 positions: vLLM
    # refuses more than that (the embedded model on a GPU failed to start before the cap)
    assert kw["max_model_len"] == 256


def test_generate_and_weights_state_machine(engine):
    prompts = [[1, 2, 3], [4, 5]]
    with pytest.raises(AssertionError, match="update_weights first"):  # dummy weights
        engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    engine.update_weights([("a", torch.ones(2)), ("b", torch.full((3,), 2.0))])
    assert engine.llm.model.b.tolist() == [2.0, 2.0, 2.0]
    assert engine.llm.calls == [("reset_prefix_cache",)]  # awake: reset right away

    samples = engine.generate(prompts, n=2, temperature=0.0, top_p=1.0, max_tokens=4, seed=0)  # greedy, n > 1
    requests, params = engine.llm.requests[-1]
    assert [r["prompt_token_ids"] for r in requests] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert all(p.n == 1 and p.logprobs == 0 and p.stop_token_ids == [2] and not p.ignore_eos for p in params)
    seeds = [p.seed for p in params]
    assert len(set(seeds)) == 4  # one seed per sample
    assert [s.prompt_ids for s in samples] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert samples[0].response_ids == [seeds[0] % 97, 2] and samples[0].response_logprobs == [-0.5, -0.25]
    assert samples[0].finish_reason == "stop"
    engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    assert [p.seed for p in engine.llm.requests[-1][1]] == seeds  # same seed: same draws
    engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=1)
    assert set(p.seed for p in engine.llm.requests[-1][1]).isdisjoint(seeds)
    engine.replica = 1  # another replica draws differently
    engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    assert set(p.seed for p in engine.llm.requests[-1][1]).isdisjoint(seeds)

    # the loop's step: sleep, wake weights, sync, wake KV cache
    engine.llm.calls.clear()
    engine.sleep()
    engine.sleep()  # idempotent
    with pytest.raises(AssertionError, match="asleep"):
        engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    with pytest.raises(AssertionError, match="wake_weights"):
        engine.update_weights([])
    engine.wake_weights()
    engine.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))])
    engine.wake_kv_cache()
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]
    engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    engine.sleep()
    engine.wake()  # woken but not synced:
    with pytest.raises(AssertionError, match="update_weights first"):  # level-2 weights are gone
        engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)


def test_failed_load_still_drains_the_producer(engine):
    pulled = []

    def producer():  # stands for export_hf_weights: each item = collectives
        for name in ("a", "b", "a", "b"):
            pulled.append(name)
            yield name, torch.ones(2 if name == "a" else 3)

    engine.llm.model.fail_after = 1
    with pytest.raises(KeyError):
        engine.update_weights(producer())
    assert len(pulled) == 4
    engine.llm.model.fail_after = None
    with pytest.raises(RuntimeError, match="not written"):  # a parameter the sync missed
        engine.update_weights([("a", torch.ones(2))])


class FakeMoEModel(torch.nn.Module):
    """vLLM's layout of one MoE layer: model.layers.0.mlp.experts.{w13_weight (E, 2 I/tp, H),
    w2_weight (E, H, I/tp)} (fused experts, [gate; up]) beside an ordinary parameter."""

    def __init__(self, experts=3, hidden=4, inter=6, tp=1):
        super().__init__()
        fused = torch.nn.Module()
        fused.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * inter // tp, hidden))
        fused.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, inter // tp))
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = fused
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
        self.norm = torch.nn.Parameter(torch.zeros(hidden))
        self.seen = []

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            self.seen.append(name)
            if name == "norm":
                self.norm.data.copy_(tensor)
                loaded.add(name)
        return loaded


class FakeVLModel(torch.nn.Module):
    """vLLM's vision-language Qwen3.5: the text model as language_model.*, its loader taking the
    checkpoint's names (model.language_model.*)."""

    def __init__(self):
        super().__init__()
        self.language_model = FakeMoEModel()

    def load_weights(self, weights):
        self.language_model.seen.extend(name for name, _ in weights)
        if "model.language_model.norm" in self.language_model.seen:
            self.language_model.norm.data.fill_(1.0)
        return {"language_model.norm"}


def test_a_vision_language_model_gets_the_checkpoints_names(engine, monkeypatch):
    """A vision-language Qwen3.5 (vLLM builds the whole model): the text model's tensors reach vLLM's
    loader under model.language_model., routed experts straight into language_model.model.*'s w13/w2."""
    dist_module = types.ModuleType("vllm.distributed")
    dist_module.get_tensor_model_parallel_rank = lambda: 0
    dist_module.get_tensor_model_parallel_world_size = lambda: 1
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist_module)
    model = engine.llm.model = FakeVLModel()
    engine._vision_language = True  # (what a config.json with text_config sets)
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    experts = "model.layers.0.mlp.experts.1"
    ckpt = [(f"{experts}.gate_proj.weight", gate), (f"{experts}.up_proj.weight", up)]
    engine.update_weights(ckpt + [(f"{experts}.down_proj.weight", down), ("model.norm", torch.ones(4))])
    assert model.language_model.seen == ["model.language_model.norm"]
    fused = model.language_model.model.layers[0].mlp.experts
    assert torch.equal(fused.w13_weight[1], torch.cat([gate, up])) and torch.equal(fused.w2_weight[1], down)


@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_experts_are_copied_into_vllms_fused_parameters(engine, monkeypatch, tp_rank, tp_size):
    """Routed experts' checkpoint tensors go straight into w13/w2 (this vLLM TP rank's slice of
    the intermediate dimension), everything else through load_weights; the sync check counts
    the fused parameters as written; the second sync replays the first. A tensor of an
    unexpected shape is left to load_weights."""
    dist_module = types.ModuleType("vllm.distributed")
    dist_module.get_tensor_model_parallel_rank = lambda: tp_rank
    dist_module.get_tensor_model_parallel_world_size = lambda: tp_size
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist_module)
    model = engine.llm.model = FakeMoEModel(tp=tp_size)
    torch.manual_seed(0)
    ckpt = {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.randn(*((4, 6) if p == "down" else (6, 4)))
        for e in range(3)
        for p in ("gate", "up", "down")
    }
    engine.update_weights(list(ckpt.items()) + [("norm", torch.ones(4))])
    assert model.seen == ["norm"] and torch.equal(model.norm, torch.ones(4))
    rows = slice(tp_rank * 6 // tp_size, (tp_rank + 1) * 6 // tp_size)

    def check_experts(ckpt):
        for e in range(3):
            gate, up, down = (ckpt[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            assert torch.equal(model.model.layers[0].mlp.experts.w13_weight[e], torch.cat([gate[rows], up[rows]]))
            assert torch.equal(model.model.layers[0].mlp.experts.w2_weight[e], down[:, rows])

    check_experts(ckpt)
    # the next sync replays the first one's writes (common/rollout/weight_replay.py): no loader call
    model.seen.clear()
    ckpt = {name: torch.randn_like(t) for name, t in ckpt.items()}
    engine.update_weights(list(ckpt.items()) + [("norm", torch.full((4,), 3.0))])
    assert model.seen == [] and torch.equal(model.norm, torch.full((4,), 3.0))
    check_experts(ckpt)
    with pytest.raises(RuntimeError, match="not written"):  # the wrongly shaped expert reached load_weights
        engine.update_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(5, 4))])
    assert model.seen == ["model.layers.0.mlp.experts.0.gate_proj.weight"]


def test_no_eos_ids_ignore_eos(engine, tmp_path):
    """eos_token_ids=[] (bench/rollout.py: identical work on both sides): no stop token and
    vLLM's ignore_eos, which keeps vLLM from adding the generation config's eos (2 here)."""
    from common.rollout.vllm_engine import VLLMEngine

    no_eos = VLLMEngine(str(tmp_path), rollout_tp=1, eos_token_ids=[])
    assert no_eos.eos_token_ids == []
    no_eos.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))])
    no_eos.generate([[1, 2, 3]], n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    params = no_eos.llm.requests[-1][1]
    assert len(params) == 2 and all(p.stop_token_ids == [] and p.ignore_eos for p in params)


def test_routes_of_an_moe_model(engine, tmp_path):
    """return_routes (--routing-replay rollout): vLLM started with enable_return_routed_experts,
    each sample's routes the MoE layers' ids of routed_experts, one row per token vLLM ran
    (prompt + response - 1); an engine started without it refuses to return routes."""
    from common.rollout.vllm_engine import VLLMEngine
    from tests.tiny_models import MOE_CONFIGS

    arch, config = MOE_CONFIGS["qwen3_moe"]  # 4 layers, layer 1 dense; 8 experts, top-2
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(dict(config, architectures=[arch], eos_token_id=2)))
    with_routes = VLLMEngine(str(moe_dir), rollout_tp=1, return_routes=True)
    assert with_routes.llm.kwargs["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine.llm.kwargs  # off unless asked: it costs vLLM time
    with_routes.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))])
    samples = with_routes.generate(
        [[1, 2, 3], [4, 5]], n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0, return_routes=True
    )
    for s in samples:
        ran = len(s.prompt_ids) + len(s.response_ids) - 1
        expected = torch.as_tensor(fake_routed_experts(ran))[:, [0, 2, 3]].to(torch.int16)
        assert s.routes.dtype == torch.int16 and torch.equal(s.routes, expected)
    engine.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))])
    with pytest.raises(AssertionError, match="return_routes=True"):
        engine.generate([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=0, return_routes=True)


@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (1, 2)])
def test_stacked_experts_are_copied_like_single_ones(engine, monkeypatch, tp_rank, tp_size):
    """Routed experts as ExpertBlocks (export_hf_weights(expert_blocks=True): a layer's experts
    stacked) land in w13 / w2 exactly as the same experts sent one tensor at a time; a block for
    a module without fused parameters goes to load_weights as per-expert tensors; the first
    sync's recording neither records nor breaks on a block, and the second sync replays the rest."""
    from common.model.weights import ExpertBlock

    dist_module = types.ModuleType("vllm.distributed")
    dist_module.get_tensor_model_parallel_rank = lambda: tp_rank
    dist_module.get_tensor_model_parallel_world_size = lambda: tp_size
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist_module)
    torch.manual_seed(0)
    fc1, fc2 = torch.randn(3, 12, 4), torch.randn(3, 4, 6)  # 3 experts: [gate; up] (2 x 6, 4), down (4, 6)
    names = ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.0.mlp.experts"

    def sync(items):
        engine.update_weights(items + [("norm", torch.ones(4))])
        experts = engine.llm.model.model.layers[0].mlp.experts
        return experts.w13_weight.detach().clone(), experts.w2_weight.detach().clone()

    engine.llm.model = FakeMoEModel(tp=tp_size)
    single = sync(list(ExpertBlock(prefix, 0, fc1, fc2, names).hf()))
    engine.llm.model, engine._fused_cache, engine._write_plan = FakeMoEModel(tp=tp_size), {}, None
    # experts 0 and 1..2 in two blocks, as when a layer's experts span two export buckets
    blocks = [
        (prefix, ExpertBlock(prefix, 0, fc1[:1], fc2[:1], names)),
        (prefix, ExpertBlock(prefix, 1, fc1[1:], fc2[1:], names)),
    ]
    stacked = sync(blocks)
    assert engine.llm.model.seen == ["norm"] and not engine._write_plan.broken
    assert all(torch.equal(a, b) for a, b in zip(single, stacked))
    rows = slice(tp_rank * 6 // tp_size, (tp_rank + 1) * 6 // tp_size)
    assert torch.equal(stacked[0][2], torch.cat([fc1[2, :6][rows], fc1[2, 6:][rows]]))
    engine.llm.model.seen.clear()
    sync(blocks)  # second sync: the norm replayed, the blocks copied
    assert engine.llm.model.seen == []
    # no fused parameters under that module: the block's experts go to load_weights one by one
    other = "model.layers.1.mlp.experts"
    with pytest.raises(RuntimeError):  # FakeMoEModel's loader ignores them: reported as not written
        engine.update_weights([(other, ExpertBlock(other, 0, fc1, fc2, names))])
    assert engine.llm.model.seen == [f"{other}.{e}.{p}.weight" for e in range(3) for p in names]


class FakeRequestEngine:
    """vLLM's LLMEngine as VLLMEngine.add_turn / finished_turns use it: add_request queues; each step()
    finishes the oldest request (tokens [65, 2], 2 = eos), FINAL_ONLY outputs of finished requests only."""

    def __init__(self, engine_core):
        self.engine_core, self.added, self.queue = engine_core, [], []

    def add_request(self, request_id, prompt, params):
        assert prompt["type"] == "token"  # vLLM 0.26 takes a typed input as is (a raw prompt is preprocessed)
        self.added.append((request_id, prompt["prompt_token_ids"], params))
        self.queue.append(request_id)

    def step(self):
        if not self.queue:
            return []
        request_id = self.queue.pop(0)
        flat = types.SimpleNamespace(start_indices=[0, 1], token_ids=[65, 2], logprobs=[-0.5, -0.25])
        done = types.SimpleNamespace(token_ids=[65, 2], logprobs=flat, finish_reason="stop")
        return [types.SimpleNamespace(request_id=request_id, finished=True, outputs=[done])]


def test_agentic_turns_request_by_request(engine, monkeypatch):
    """Episodes (common/rollout/episodes.py) on VLLMEngine at rollout TP 1: each turn is one request of
    the episode's ids so far with the sampled token's logprob; at TP > 1 (or lockstep_turns) turns
    run in waves through generate."""
    from common.env.base import Environment, Step
    from common.env.chat import ChatCodec
    from common.rollout.episodes import run_episodes
    from common.run.embedded import build_tokenizer

    monkeypatch.setitem(
        sys.modules,
        "vllm.sampling_params",
        types.SimpleNamespace(RequestOutputKind=types.SimpleNamespace(FINAL_ONLY=2)),
    )
    engine.llm.llm_engine = FakeRequestEngine(engine.llm.llm_engine.engine_core)
    engine.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))])

    class TwoTurns(Environment):
        def step(self, text):
            self.turns = getattr(self, "turns", 0) + 1
            return Step(done=self.turns == 2, reward=1.0, observation=[{"role": "user", "content": "again"}])

    codec = ChatCodec(build_tokenizer())
    kwargs = dict(n=1, temperature=1.0, top_p=1.0, max_tokens=8, max_turns=4, max_episode_tokens=200, seed=3)
    samples = run_episodes(engine, codec, TwoTurns, [{"prompt": "a"}, {"prompt": "b"}], step_timeout_s=5, **kwargs)
    added = engine.llm.llm_engine.added
    assert len(added) == 4 and len({request_id for request_id, _, _ in added}) == 4
    assert all(
        p.logprobs == 0 and p.output_kind == 2 and p.max_tokens == 8 and p.stop_token_ids == [2] for *_, p in added
    )
    # vLLM copies each request's params shallowly (skip_clone): none shares the engine's list of stop ids
    assert all(p.skip_clone and p.stop_token_ids is not engine.eos_token_ids for *_, p in added)
    for s in samples:
        assert s.episode["turns"] == 2 and s.response_logprobs[:2] == [-0.5, -0.25]
        turn2 = s.response_mask.index(1, 2)  # the second turn's first token
        assert (s.prompt_ids + s.response_ids[:turn2]) in [prompt for _, prompt, _ in added]
    engine.lockstep_turns = True  # the lock-step baseline: waves through llm.generate, no request of its own
    before = len(engine.llm.requests)
    run_episodes(engine, codec, TwoTurns, [{"prompt": "a"}], step_timeout_s=5, **kwargs)
    assert len(added) == 4 and len(engine.llm.requests) == before + 2


def test_vision_language_checkpoint_starts_language_model_only(engine, tmp_path):
    """A vision-language config.json (Qwen3.5 as released): vLLM is asked for the language model alone
    (no vision tower, no image processor, which a tokenizer-less engine could not build)."""
    from common.rollout.vllm_engine import VLLMEngine

    text = {"eos_token_id": 2, "max_position_embeddings": 256}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text, "vision_config": {}}
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config))
    vl = VLLMEngine(str(tmp_path / "vl"), rollout_tp=1, max_model_len=64)
    assert vl.llm.kwargs["language_model_only"] and vl._vision_language
    assert "language_model_only" not in engine.llm.kwargs  # a text checkpoint: vLLM's defaults


def test_rollout_tp2_makes_each_replica_a_wave_group(engine, tmp_path, monkeypatch):
    """At --rollout-tp 2 in a world of 4: every rank creates both replicas' gloo groups in the same order,
    and keeps its own replica's with its first rank as the wave leader (agentic waves: RolloutEngine)."""
    import torch.distributed as dist

    from common.rollout.vllm_engine import VLLMEngine

    made = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None: made.append((ranks, backend)) or len(made))
    tp2 = VLLMEngine(str(tmp_path), rollout_tp=2, max_model_len=64)
    assert made == [([0, 1], "gloo"), ([2, 3], "gloo")]
    assert (tp2.replica, tp2.wave_group, tp2.wave_leader, tp2.wave_follower) == (1, 2, 2, True)
    assert engine.wave_group is None and not engine.wave_follower  # rollout TP 1: no followers


@pytest.mark.parametrize("eager", [False, True])
def test_make_engine_passes_enforce_eager(engine, tmp_path, eager):
    """--rollout-eager's path below the scripts: make_engine -> VLLMEngine -> vLLM's enforce_eager."""
    from common.rollout.engines import make_engine

    vllm_engine, _ = make_engine(True, str(tmp_path), max_model_len=64, enforce_eager=eager)
    assert vllm_engine.llm.kwargs["enforce_eager"] is eager


def test_a_text_qwen35_starts_vllm_as_the_vision_language_model(engine, tmp_path):
    """A text Qwen3.5 (what merge_to_hf.py writes by default; vLLM 0.26 registers only the vision-language
    Qwen3.5): vLLM is started from a vision-language config.json around its text config, language model only,
    and the sync then names the text tensors as that model's (model.language_model.*)."""
    from common.model.bridge_vl import text_config
    from common.rollout.vllm_engine import VLLMEngine
    from tests.tiny_models import make_tiny_hf_model

    text = make_tiny_hf_model("qwen3_5_moe").config.to_dict()
    (tmp_path / "q35").mkdir()
    (tmp_path / "q35" / "config.json").write_text(json.dumps(text))
    q35 = VLLMEngine(str(tmp_path / "q35"), rollout_tp=1, max_model_len=64)
    started = json.loads(open(os.path.join(q35.llm.kwargs["model"], "config.json")).read())
    assert started["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert text_config(started)[0]["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert q35._vision_language and q35.llm.kwargs["language_model_only"]
    assert engine.llm.kwargs["model"] == str(tmp_path)  # other models: their own directory


@pytest.mark.parametrize("flashinfer", [False, True])
def test_gated_delta_net_prefill_falls_back_to_triton_without_flashinfer(engine, tmp_path, monkeypatch, flashinfer):
    """Qwen3.5's gated-delta-net layers: on Hopper vLLM's "auto" picks flashinfer's prefill kernel whether or not
    flashinfer is installed (the engine then dies at its first prefill); without it the Triton kernel is asked
    for, and a user's own additional_config is kept. Models without such layers get vLLM's defaults."""
    import importlib.util

    from common.rollout.vllm_engine import VLLMEngine
    from tests.tiny_models import make_tiny_hf_model

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "flashinfer":
            return object() if flashinfer else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    (tmp_path / "q35").mkdir()
    (tmp_path / "q35" / "config.json").write_text(json.dumps(make_tiny_hf_model("qwen3_5_moe").config.to_dict()))
    q35 = VLLMEngine(str(tmp_path / "q35"), rollout_tp=1, max_model_len=64, additional_config={"other": 1})
    expected = {"other": 1} if flashinfer else {"gdn_prefill_backend": "triton", "other": 1}
    assert q35.llm.kwargs["additional_config"] == expected
    assert "additional_config" not in engine.llm.kwargs  # a model without gated-delta-net layers
