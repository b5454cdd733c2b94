"""common/rollout/weight_replay.py: a loader's writes recorded once and replayed give the parameters
the loader itself gives, and what cannot be replayed is left to the loader.

    .venv/bin/python -m pytest -q tests/test_weight_replay.py

The stand-in loader below writes the way vLLM's do (a fused qkv / gate_up parameter filled
slice by slice with narrow + copy_, a padded vocabulary zero-filled past its end, a row slice
of a tensor for a TP rank, `param.data.copy_` for the rest); the real vLLM loaders are checked
the same way on a GPU (tests/gpu/test_vllm_agreement.py, "replay").
"""

import torch

from common.model.weights import LocalShard
from common.rollout.weight_replay import WritePlan

H, Q, KV, I, V, V_PAD = 8, 8, 4, 12, 10, 16


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.empty(Q + 2 * KV, H))
        self.gate_up = torch.nn.Parameter(torch.empty(2 * I // 2, H))  # this "rank"'s half of I, twice
        self.embed = torch.nn.Parameter(torch.empty(V_PAD, H))
        self.norm = torch.nn.Parameter(torch.empty(H))


def hf_tensors(seed, flat=False):
    """The HF tensors, each its own storage or (flat) views into one buffer at other offsets,
    as export_hf_weights yields them (views of a bucket or of the model's parameters)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (Q, H), "k": (KV, H), "v": (KV, H), "gate": (I, H), "up": (I, H), "embed": (V, H), "norm": (H,)}
    tensors = [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]
    if flat:
        buffer = torch.cat([torch.zeros(3)] + [t.reshape(-1) for _, t in tensors])
        offset, views = 3, []
        for name, t in tensors:
            views.append((name, buffer[offset : offset + t.numel()].view(t.shape)))
            offset += t.numel()
        tensors = views
    return tensors


def loader(model, weights, buffered=False, converting=False):
    """vLLM-like: q/k/v into their rows of qkv, TP rank 1 of 2 of gate/up into gate_up, the
    vocabulary copied and its padding zeroed, the norm through param.data."""
    weights = list(weights) if buffered else weights
    offsets = {"q": 0, "k": Q, "v": Q + KV}
    for name, w in weights:
        if name in offsets:
            model.qkv.data.narrow(0, offsets[name], w.shape[0]).copy_(w.clone() if converting else w)
        elif name in ("gate", "up"):
            half = I // 2
            model.gate_up.data.narrow(0, 0 if name == "gate" else half, half).copy_(w.narrow(0, half, half))
        elif name == "embed":
            model.embed.data[:V].copy_(w)
            model.embed.data[V:].fill_(0)
        else:
            model.norm.data.copy_(w)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def replay_all(plan, tensors):
    return [name for name, t in tensors if not plan.replay(name, t)]


def test_replay_equals_the_loader():
    recorded, expected = Model(), Model()
    plan = WritePlan(recorded)
    with plan.record(hf_tensors(0, flat=True)) as stream:
        loader(recorded, stream)
    assert not plan.broken and not plan.unreplayable
    assert plan.written["q"] == {"qkv"} and plan.written["embed"] == {"embed"}
    torch.nn.init.normal_(recorded.embed)  # garbage, as after vLLM's level-2 sleep
    torch.nn.init.normal_(recorded.qkv)
    new = hf_tensors(1)
    assert replay_all(plan, new) == []
    loader(expected, new)
    for name, value in params(expected).items():
        assert torch.equal(params(recorded)[name], value), name
    assert torch.equal(recorded.embed[V:], torch.zeros(V_PAD - V, H))


def test_what_cannot_be_replayed_goes_to_the_loader():
    # a converted copy as the source (here for q, k, v): not replayable, the others are
    model = Model()
    plan = WritePlan(model)
    with plan.record(hf_tensors(0)) as stream:
        loader(model, stream, converting=True)
    assert plan.unreplayable == {"q", "k", "v"}
    assert replay_all(plan, hf_tensors(1)) == ["q", "k", "v"]
    # a loader that buffers the stream writes after it ended: nothing is replayed
    model = Model()
    plan = WritePlan(model)
    with plan.record(hf_tensors(0)) as stream:
        loader(model, stream, buffered=True)
    assert plan.broken and len(replay_all(plan, hf_tensors(1))) == 7
    # another shape, strides or dtype than recorded: not replayed
    plan = WritePlan(model)
    with plan.record(hf_tensors(0)) as stream:
        loader(model, stream)
    norm = torch.randn(H)
    assert not plan.replay("norm", norm.double()) and not plan.replay("embed", torch.randn(V, 2 * H)[:, ::2])
    assert plan.replay("norm", norm) and torch.equal(model.norm.detach(), norm)


def test_a_non_contiguous_source_is_left_to_the_loader():
    model = Model()
    plan = WritePlan(model)
    tensors = [(n, t.t().contiguous().t()) if n == "embed" else (n, t) for n, t in hf_tensors(0)]
    with plan.record(tensors) as stream:
        loader(model, stream)
    assert plan.unreplayable == {"embed"}


class RowParallel(torch.nn.Module):  # vLLM TP rank 1 of 2 of a row-parallel weight (H, I): its columns
    def __init__(self):
        super().__init__()
        self.o = torch.nn.Parameter(torch.zeros(H, I // 2))


def test_pieces_replay_as_the_loader_where_it_reads_no_more():
    """A rank's own TP piece of a tensor (export_hf_weights(local_reads=...) at Megatron TP =
    vLLM TP) is written as the loader would write the full tensor, where every recorded read
    lies inside the piece; elsewhere reads_within says no."""
    model, expected = Model(), Model()
    plan = WritePlan(model)
    with plan.record(hf_tensors(0)) as stream:
        loader(model, stream)
    half = I // 2
    assert plan.reads_within("gate", 0, half, I, (I, H)) and plan.reads_within("up", 0, half, I, (I, H))
    assert not plan.reads_within("gate", 0, 0, half, (I, H))  # rank 1 reads the other half
    assert not plan.reads_within("gate", 0, half, I, (2 * I, H))  # another full shape than recorded
    assert not plan.reads_within("q", 0, 0, Q // 2, (Q, H))  # q is read whole
    assert plan.reads_within("q", 0, 0, Q, (Q, H))
    assert plan.reads_within("embed", 0, 0, V, (V, H))  # the copy and the padding's fill
    new = dict(hf_tensors(1))
    for name in ("gate", "up"):
        assert plan.replay_piece(name, LocalShard(new[name][half:].clone(), 0, half, (I, H)))
    assert plan.replay_piece("embed", LocalShard(new["embed"].clone(), 0, 0, (V, H)))
    assert not plan.replay_piece("gate", LocalShard(new["gate"][:half].clone(), 0, 0, (I, H)))  # not asked for
    assert not plan.replay_piece("up", LocalShard(new["up"][half:].double(), 0, half, (I, H)))  # another dtype
    loader(expected, new.items())
    for name in ("gate_up", "embed"):
        assert torch.equal(params(model)[name], params(expected)[name]), name

    # a piece along dim 1 (row parallel: vLLM rank 1 takes the second half of the columns)
    row, full = RowParallel(), torch.randn(H, I)
    plan = WritePlan(row)
    with plan.record([("o", full)]) as stream:
        for _, w in stream:
            row.o.data.copy_(w.narrow(1, half, half))
    assert plan.reads_within("o", 1, half, I, (H, I)) and not plan.reads_within("o", 1, 0, half, (H, I))
    row.o.data.zero_()
    assert plan.replay_piece("o", LocalShard(full[:, half:], 1, half, (H, I)))  # a strided view of it works too
    assert torch.equal(row.o.detach(), full[:, half:])
