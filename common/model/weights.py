"""HF weights out of the model chunks common/model/gpt.py builds (the weight sync, merge_to_hf.py).

  export_hf_weights(chunks, spec, ...)    generator of (hf_name, full tensor): TP shards are
                                          all-gathered and PP stages broadcast, in flat buckets
                                          (or, local_reads=..., each rank's own TP pieces)
The way in (HF -> megatron, sharded) is common/model/weights_load.py; the name/shape mapping itself lives
in common/model/bridge.py.
"""

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from common.model.bridge import HFModelSpec, expected_hf_shape, hf_from_shards, param_rule
from common.model.bridge_gptoss import fused_expert_tensors
from common.model.bridge_moe import expert_index, global_expert_name
from common.model.chunks import named_global_tensors
from common.model.lora import MergedTensors, is_adapter


# ---------------------------------------------------------------------------------------
# megatron -> HF (export generator)
# ---------------------------------------------------------------------------------------
class ExpertBlock(NamedTuple):
    """Routed experts first .. first + n - 1 of one layer, stacked: fc1 (n, 2I, H) holds each
    expert's [gate; up], fc2 (n, H, I) its down projection (views of the export's buffers or
    of the parameters; never write into them). hf() gives the same as (hf_name, tensor)
    pairs, as export_hf_weights yields them without expert_blocks."""

    prefix: str  # the layer's HF experts module, e.g. model.layers.3.mlp.experts
    first: int
    fc1: torch.Tensor
    fc2: torch.Tensor
    projections: tuple  # HF names of (gate, up, down), e.g. ("gate_proj", "up_proj", "down_proj")

    def hf(self):
        inter = self.fc1.shape[1] // 2
        gate, up, down = self.projections
        for i in range(self.fc1.shape[0]):
            e = f"{self.prefix}.{self.first + i}"
            yield f"{e}.{gate}.weight", self.fc1[i, :inter]
            yield f"{e}.{up}.weight", self.fc1[i, inter:]
            yield f"{e}.{down}.weight", self.fc2[i]


class LocalShard(NamedTuple):
    """This TP rank's piece full[start:start + n] along `dim` of the full HF tensor of shape
    full_shape (export_hf_weights(local_reads=...); a view of a parameter or a copy: never
    write into it)."""

    tensor: torch.Tensor
    dim: int
    start: int
    full_shape: tuple

    @property
    def stop(self):
        return self.start + self.tensor.shape[self.dim]


UNBOXED_KINDS = ("gdn_in", "gdn_conv")  # a TP rank holds a slice of each of q, k, v of one HF tensor


def _local_pieces(kind, hf_names, shard, spec, tp_rank):
    """One TP rank's megatron shard as pieces of its HF tensors (shard_from_hf inverted for
    one rank): [(hf_name, LocalShard)], or [(hf_name, shard)] where the shard is the full tensor."""
    full = lambda name: expected_hf_shape(name, spec)  # noqa: E731
    if kind == "replicated":
        return [(hf_names[0], shard)]
    if kind == "vocab":  # the padded rows past the vocabulary are no HF rows
        rows = shard.shape[0]
        real = max(0, min(rows, spec.vocab_size - tp_rank * rows))
        return [(hf_names[0], LocalShard(shard[:real], 0, tp_rank * rows, full(hf_names[0])))]
    dim = 1 if kind == "row" else 0  # the shard's pieces are the HF tensors of a one-rank model
    return [
        (name, LocalShard(part, dim, tp_rank * part.shape[dim], full(name)))
        for name, part in hf_from_shards(kind, hf_names, [shard], spec)
    ]


_LOCAL_DECISIONS = weakref.WeakKeyDictionary()  # local_reads -> (the export plan, names exported as pieces)


def _local_names(local, plan, spec, local_reads, device):
    """The megatron names (routed experts aside) whose HF pieces on this rank hold all the
    consumer reads of them (local_reads.reads_within), on every rank: agreed by one all_reduce
    per local_reads object and plan, then remembered."""
    from megatron.core import parallel_state as mpu

    known = _LOCAL_DECISIONS.get(local_reads)
    if known is not None and known[0] == plan:
        return known[1]
    tp_rank = mpu.get_tensor_model_parallel_rank()
    names = [entry[1] for entry in plan if not entry[3]]
    fits = []
    for name in names:
        kind, hf_names = param_rule(name, spec)
        pieces = _local_pieces(kind, hf_names, torch.empty(local[name].shape, device="meta"), spec, tp_rank)
        fits.append(
            kind not in UNBOXED_KINDS  # a rank's shard is no box of its HF tensor: gathered instead
            and all(
                not isinstance(p, LocalShard) or local_reads.reads_within(n, p.dim, p.start, p.stop, p.full_shape)
                for n, p in pieces
            )
        )
    agreed = torch.tensor(fits, dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    chosen = {name for name, ok in zip(names, agreed.tolist()) if ok}
    _LOCAL_DECISIONS[local_reads] = (plan, chosen)
    return chosen


def _expert_pairs(bucket):
    """Runs of consecutive (fc1, fc2) entries of consecutive local experts of one layer in a
    bucket (megatron's SequentialMLP order: expert j's fc1, its fc2, expert j+1's ...), all of
    one shape. Yields ("run", [entry index of each fc1]) or ("single", entry index)."""

    def parse(name):  # (layer, local expert, is fc1) of a routed expert's projection, else None
        j = expert_index(name)
        if j is None or not name.endswith(("linear_fc1.weight", "linear_fc2.weight")):
            return None
        return name[: name.index(".experts.")], j, name.endswith("linear_fc1.weight")

    parsed = [parse(entry[1]) for entry in bucket]  # each name once (the checks below ask again and again)
    info = parsed.__getitem__

    def pair_at(i):  # expert j's fc1 at i, its fc2 at i + 1
        a, b = (info(i), info(i + 1)) if i + 1 < len(bucket) else (None, None)
        return a is not None and b is not None and a[2] and not b[2] and a[:2] == b[:2]

    def continues(run, i):  # the next expert of the run's layer, with the run's shapes
        first, last = info(run[0]), info(run[-1])
        return (
            info(i)[0] == first[0]
            and info(i)[1] == last[1] + 1
            and bucket[i][2] == bucket[run[0]][2]
            and bucket[i + 1][2] == bucket[run[0] + 1][2]
        )

    i = 0
    while i < len(bucket):
        run = []
        while pair_at(i) and (not run or continues(run, i)):
            run.append(i)
            i += 2
        if run:
            yield "run", run
        else:
            yield "single", i
            i += 1


def _export_plan(chunks, spec, tp_size):
    """This rank's exported parameters, and the ordered plan of every PP stage's ones.

    Each plan entry: (owner pp rank, global name, local shard shape, is a routed expert, stays
    fp32). Routed experts keep their local index j here (every EP rank has the same entries;
    the export gathers them over EP). With tied embeddings only the first stage's embedding is
    exported (the last stage's copy is the same). fp32 buffers (the router's score-correction
    bias) stay fp32: rounded to bf16 it would change which experts are chosen."""
    from megatron.core import parallel_state as mpu

    local = []
    for chunk in chunks:
        for name, param in named_global_tensors(chunk, global_experts=False):
            if (name == "output_layer.weight" and spec.tie_word_embeddings) or is_adapter(name):
                continue  # (LoRA's factors: exported inside their merged weights, MergedTensors)
            local.append((name, param))
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    mine = [
        (name, tuple(p.shape), expert_index(name) is not None, not isinstance(p, torch.nn.Parameter))
        for name, p in local
    ]
    if pp_size > 1:
        per_stage = [None] * pp_size
        dist.all_gather_object(per_stage, mine, group=mpu.get_pipeline_model_parallel_group())
    else:
        per_stage = [mine]
    plan = [(stage, *entry) for stage, entries in enumerate(per_stage) for entry in entries]
    return MergedTensors(dict(local), chunks), plan  # LoRA: W + scale * B A where W is read


def export_hf_weights(
    chunks, spec: HFModelSpec, dtype=torch.bfloat16, bucket_mb=512, expert_blocks=False, local_reads=None
):
    """Yield (hf_name, full tensor in `dtype`) for every tensor of the HF checkpoint.

    local_reads (at TP > 1 without PP; the vLLM sync passes engine.local_reads): an object
    whose reads_within(hf_name, dim, start, stop, full_shape) says that the consumer, on this
    rank, reads no more of that HF tensor than full[start:stop] along dim. Where it says so for
    every piece of a parameter on every rank, the parameter is not gathered: the pairs are
    (hf_name, LocalShard) of this rank's own pieces (replicated ones: the full tensor itself).
    At Megatron TP = vLLM TP the ranks hold the very shards vLLM's ranks read (the
    all-gather was 88% of the 7B sync at TP=2).

    expert_blocks (without expert TP): routed experts come as (HF experts module,
    ExpertBlock) items, a layer's experts stacked (one item per run of experts in a bucket
    instead of three tensors per expert: Qwen3-30B-A3B has 18,432), for a consumer that copies
    them in a few kernels (VLLMEngine); ExpertBlock.hf() gives the per-expert tensors.

    All ranks call this and must consume the generator to the end (it runs collectives):
    TP shards are all-gathered in flat buckets of <= bucket_mb of full tensors (routed
    experts: over the expert-TP group, then over the EP group, so every rank holds every
    expert), then the owning PP stage broadcasts each bucket to the other stages, so every
    rank receives every tensor. Peak extra memory ~ 2 buckets, never the whole model.
    Yielded tensors may be views into a bucket buffer or, where nothing is gathered (one
    rank per TP/EP group and one stage), of the model's own parameters: copy them to keep
    them, never write into them.
    gpt-oss: a layer's experts come as its fused HF tensors (copies), without expert_blocks or local_reads.
    """
    if spec.gptoss is not None:  # a layer's experts are one fused HF tensor each (common/model/bridge_gptoss.py)
        parts = _export_hf_weights(chunks, spec, dtype, bucket_mb, expert_blocks=False, local_reads=None)
        yield from fused_expert_tensors(parts, spec)
        return
    yield from _export_hf_weights(chunks, spec, dtype, bucket_mb, expert_blocks, local_reads)


def _export_hf_weights(chunks, spec, dtype, bucket_mb, expert_blocks, local_reads):
    from megatron.core import parallel_state as mpu

    tp_size = mpu.get_tensor_model_parallel_world_size()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    ep_size, etp_size = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    pp_group = mpu.get_pipeline_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    local, plan = _export_plan(chunks, spec, tp_size)
    if local_reads is not None and tp_size > 1 and pp_size == 1:
        pieces = _local_names(local, plan, spec, local_reads, device)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        for _, name, _, _, fp32 in (entry for entry in plan if entry[1] in pieces):
            want, tensor = torch.float32 if fp32 else dtype, local[name].detach()
            yield from _local_pieces(
                *param_rule(name, spec), tensor if tensor.dtype == want else tensor.to(want), spec, tp_rank
            )
        plan = [entry for entry in plan if entry[1] not in pieces]

    def layout(expert):  # (copies over EP, shards per copy, the shards' group)
        if expert:
            return ep_size, etp_size, mpu.get_expert_tensor_parallel_group()
        return 1, tp_size, mpu.get_tensor_model_parallel_group()

    # Consecutive entries of one owner stage and kind, up to bucket_mb of full (gathered) bytes.
    limit = bucket_mb * 2**20 // dtype.itemsize
    buckets, current, current_numel = [], [], 0

    def bucket_key(entry):  # what one bucket shares: owner stage, routed expert or not, fp32 or not
        return entry[0], entry[3], entry[4]

    for entry in plan:
        copies, width, _ = layout(entry[3])
        numel = torch.Size(entry[2]).numel() * copies * width
        if current and (bucket_key(entry) != bucket_key(current[0]) or current_numel + numel > limit):
            buckets.append(current)
            current, current_numel = [], 0
        current.append(entry)
        current_numel += numel
    if current:
        buckets.append(current)

    def hf_tensors(name, shards, expert, copy):  # one megatron tensor's full shards -> its HF tensors
        if expert:  # local expert j of EP rank `copy`
            name = global_expert_name(name, copy, ep_size, spec.moe.num_experts)
        kind, hf_names = param_rule(name, spec)
        return hf_from_shards(kind, hf_names, shards, spec)

    def block(name, copy, fc1, fc2):  # (HF experts module, ExpertBlock) from expert j's fc1 name
        fc1_name = global_expert_name(name, copy, ep_size, spec.moe.num_experts)
        (gate_name, up_name), (down_name,) = (
            param_rule(n, spec)[1] for n in (fc1_name, fc1_name.replace("linear_fc1", "linear_fc2"))
        )
        prefix, first, gate, _ = gate_name.rsplit(".", 3)  # model.layers.L.mlp.experts, e, gate_proj, weight
        projections = (gate, up_name.rsplit(".", 2)[1], down_name.rsplit(".", 2)[1])
        return prefix, ExpertBlock(prefix, int(first), fc1, fc2, projections)

    def stacked(tensors):  # one (n, ...) tensor: a strided view where the parameters are evenly spaced
        t0 = tensors[0]
        step = (tensors[1].data_ptr() - t0.data_ptr()) // t0.element_size() if len(tensors) > 1 else t0.numel()
        if step >= t0.numel() and all(
            t.is_contiguous()
            and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
            and t.data_ptr() == t0.data_ptr() + i * step * t0.element_size()
            for i, t in enumerate(tensors)
        ):
            return t0.as_strided((len(tensors), *t0.shape), (step, *t0.stride()))
        return torch.stack(tensors)

    blocks = expert_blocks and spec.moe is not None
    for bucket in buckets:
        owner, expert, fp32 = bucket_key(bucket[0])
        copies, width, shard_group = layout(expert)
        kind_dtype = torch.float32 if fp32 else dtype
        if copies == width == pp_size == 1:  # nothing to gather or send: the parameters themselves
            # (no flat bucket: at 7B on one GPU its concatenation was 2/3 of the sync)
            def own(i):
                tensor = local[bucket[i][1]].detach()
                return tensor if tensor.dtype == kind_dtype else tensor.to(kind_dtype)

            for what, where in (
                _expert_pairs(bucket) if blocks and expert else (("single", i) for i in range(len(bucket)))
            ):
                if what == "single":
                    yield from hf_tensors(bucket[where][1], [own(where)], expert, 0)
                else:
                    yield block(
                        bucket[where[0]][1], 0, stacked([own(i) for i in where]), stacked([own(i + 1) for i in where])
                    )
            continue
        local_numel = sum(torch.Size(entry[2]).numel() for entry in bucket)
        gathered = torch.empty(copies, width, local_numel, dtype=kind_dtype, device=device)  # (ep, tp, bucket/tp)
        if pp_rank == owner:
            flat = torch.cat([local[entry[1]].detach().reshape(-1).to(kind_dtype) for entry in bucket])
            shards = gathered[0] if copies == 1 else torch.empty(width, local_numel, dtype=kind_dtype, device=device)
            if width > 1:
                dist.all_gather_into_tensor(shards.view(-1), flat, group=shard_group)
            else:
                shards[0].copy_(flat)
            if copies > 1:  # every EP rank's experts: (ep, etp, n)
                dist.all_gather_into_tensor(
                    gathered.view(-1), shards.view(-1), group=mpu.get_expert_model_parallel_group()
                )
            del flat, shards
        if pp_size > 1:
            dist.broadcast(gathered, src=dist.get_global_rank(pp_group, owner), group=pp_group)
        offsets = [0]
        for entry in bucket:
            offsets.append(offsets[-1] + torch.Size(entry[2]).numel())
        pieces = (
            list(_expert_pairs(bucket))
            if blocks and expert and width == 1
            else [("single", i) for i in range(len(bucket))]
        )  # the same for every EP rank's copy
        for copy in range(copies):
            for what, where in pieces:
                if what == "single":
                    _, name, shape, *_ = bucket[where]
                    numel = torch.Size(shape).numel()
                    shards = [
                        gathered[copy, r, offsets[where] : offsets[where] + numel].view(shape) for r in range(width)
                    ]
                    yield from hf_tensors(name, shards, expert, copy)
                    continue
                flat = gathered[copy, 0]
                shape1, shape2 = bucket[where[0]][2], bucket[where[0] + 1][2]
                pair = offsets[where[0] + 2] - offsets[where[0]]  # one expert's fc1 + fc2 elements
                fc1 = flat.as_strided(
                    (len(where), *shape1), (pair, shape1[1], 1), flat.storage_offset() + offsets[where[0]]
                )
                fc2 = flat.as_strided(
                    (len(where), *shape2), (pair, shape2[1], 1), flat.storage_offset() + offsets[where[0] + 1]
                )
                yield block(bucket[where[0]][1], copy, fc1, fc2)
        del gathered
