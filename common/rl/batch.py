"""From rollout samples to megatron micro-batches (common/train/schedule.py runs megatron's schedule over them).

  gather_samples(local)            every rank gets the global list (rollout replicas differ)
  pack_sequences(samples, ...)     prompt+response, right-padded, with the response mask
  length_multiples(tp, cp)         the row / sample length multiples SP and CP need
  micro_batches(batch, rows, ...)  a rank's rows -> micro-batches of similar lengths, padding cut
  packed_micro_batches(...)        ... or samples back to back in one row per pass (no padding)
  scatter_tokens(store, mb, x)     a pass's per-token output back into the (N, T) layout
  context_parallel_slice(mb, ...)  a CP rank's chunks of every sequence, padded or packed
                                   (common/train/schedule.py run_micro_batches applies it)

Sequence layout (one row per sample, right-padded to a common length T):

    tokens    p0 p1 p2 r0 r1 r2 <eos> pad pad
    position   0  1  2  3  4  5   6    7   8
    target    p1 p2 r0 r1 r2 eos  x    x   x      (token t+1: what logits[t] predicts)
    mask       0  0  1  1  1  1   0    0   0      (1 where the target is a response token)

Right padding means real tokens never attend to padding, so the plain causal mask is
exact; padded positions are excluded by the mask. Per-token tensors (logprobs, advantages,
masks) are all aligned on this "target" axis, shape (B, T). MoE routing replay adds
routes (B, T, M, k) on the "tokens" axis (the experts token t went to in each of M MoE
layers, -1 where none was recorded), cut, packed and sliced like the (B, T) tensors.
"""

import torch
import torch.distributed as dist


def gather_samples(local_samples, group=None):
    """All-gather Python objects (e.g. rollout Samples) in rank order. All ranks call this."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(local_samples)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(local_samples), group=group)
    return [s for part in parts for s in part]


def pack_sequences(samples, pad_id, length=None, length_multiple=8, routes=False):
    """Right-pad prompt+response of each sample into (B, T) tensors.

    Returns dict(tokens, positions, targets, mask, rollout_logprobs, rollout_mask, valid), all
    (B, T), plus response_len (B,). valid is True on the sample's own tokens (prompt and
    response), False on the padding: an MoE model's load-balancing loss, z-loss, expert-load
    counts and router-bias updates leave the padding out (schedule.run_micro_batches passes it to
    megatron as padding_mask). A sample whose engine returned no logprobs (NaN, see
    RolloutEngine.generate's logprob_samples) has rollout_logprobs 0 and rollout_mask 0;
    elsewhere rollout_mask == mask. An agentic episode's Sample.response_mask
    (common/rollout/episodes.py) zeroes its observations' tokens in mask (so in the loss, KL,
    entropy, the critic's values and rollout_mask) and response_len counts the model's tokens
    only. T is `length` if given, else the longest sequence rounded up to length_multiple
    (sequence parallelism needs T % tp == 0; the pipeline needs one T for all micro-batches
    of a step).
    routes: also routes (B, T, M, k) int16 from each sample's Sample.routes (routing replay,
    common/model/routing_replay.py): the experts of the tokens the engine ran, -1 elsewhere
    (the last token, the padding); ValueError if a sample has none.
    """
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if length is None:
        length = -(-max(lengths) // length_multiple) * length_multiple
    batch = len(samples)
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, length)
    valid = torch.arange(length).expand(batch, length) < torch.tensor(lengths)[:, None]
    rollout_logprobs = torch.zeros(batch, length)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        # logits at position t predict token t+1: response token j sits at p+j, predicted at p+j-1
        model_tokens = getattr(s, "response_mask", None)  # None: every response token is the model's
        mask[i, p - 1 : p + r - 1] = 1.0 if model_tokens is None else torch.tensor(model_tokens, dtype=torch.float)
        rollout_logprobs[i, p - 1 : p + r - 1] = torch.tensor(s.response_logprobs, dtype=torch.float)
    targets = torch.roll(tokens, shifts=-1, dims=1)
    positions = torch.arange(length).expand(batch, length)
    rollout_mask = mask * torch.isfinite(rollout_logprobs)
    packed = dict(
        tokens=tokens,
        positions=positions,
        targets=targets,
        mask=mask,
        rollout_logprobs=rollout_logprobs.nan_to_num(0.0),
        rollout_mask=rollout_mask,
        valid=valid,
        response_len=mask.sum(1),
    )
    if routes:
        packed["routes"] = _pack_routes(samples, length)
    return packed


def _pack_routes(samples, length):
    """(B, T, M, k) int16: each sample's routes (tokens it ran, M, k) from position 0, -1 after."""
    missing = [i for i, s in enumerate(samples) if getattr(s, "routes", None) is None]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(samples)} samples carry no MoE routes (e.g. sample {missing[0]}): routing replay "
            "needs an engine that returns them (--routing-replay rollout), or rollouts saved by such a run"
        )
    first = samples[0].routes
    packed = torch.full((len(samples), length, *first.shape[1:]), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        packed[i, : len(s.routes)] = s.routes
    return packed


def split_micro_batches(batch: dict, micro_batch_size):
    """dict of (B, ...) tensors -> list of dicts of (micro_batch_size, ...) tensors."""
    size = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


def length_multiples(tp, cp):
    """(row, sample) length multiples of a pass at tensor parallel size tp and context parallel
    size cp: sequence parallelism splits a (CP rank's part of a) row over TP, CP cuts a row into
    2*cp chunks (so rows are multiples of 8 * tp * 2cp), and a packed pass under CP cuts EVERY
    sample into 2*cp chunks (megatron's THD + CP layout), so each sample is padded to 2*cp."""
    chunks = 2 * cp if cp > 1 else 1
    return 8 * tp * chunks, chunks


def micro_batches(
    batch: dict,
    rows,
    micro_batch_size,
    length_multiple=8,
    same_length=False,
    max_tokens=0,
    pack=False,
    same_count_group=None,
    sample_multiple=1,
    same_tokens=False,
):
    """Rows `rows` of a packed batch -> micro-batches with as little padding as possible.

    The rows are ordered by length (stable), so each micro-batch holds sequences of similar
    length, and every (B, T) tensor of a micro-batch is cut after its longest row's last
    predicted position, rounded up to length_multiple (sequence parallelism needs T % tp == 0).
    Cutting right padding changes no valid position's output (causal attention), and the
    losses use global normalisers (rl.aggregate_loss), so neither the grouping nor the cut
    changes the math: it only skips the padding's FLOPs (a GRPO batch whose responses run from
    a few tokens to --max-new-tokens would otherwise compute everything at the longest).
    micro_batch_size: rows per micro-batch (the last one may hold fewer).
    max_tokens > 0: instead, as many rows as fit in max_tokens padded tokens (rows x cut length;
      at least one row): short samples go many to a pass, long ones few. Each forward pass
      costs a fixed launch overhead on top of its FLOPs (measured: Qwen2-1.5B on an H200 took
      the same time per micro-batch of 16 rows at 160 and at 320 tokens), so fewer, fuller
      passes are faster; and the activation memory of a pass is bounded by the budget, not by
      the longest response. The number of micro-batches then varies: scale the loss by
      len(result), not by a count computed beforehand.
    same_length: cut every micro-batch at the longest of them all (megatron's pipeline
    schedules exchange activations of one shape: PP > 1 or VPP).
    pack: packed_micro_batches instead, passes of up to max_tokens tokens (0: micro_batch_size
      full-width rows' worth, the most a padded pass could hold); sample_multiple is its
      per-sample padding (2 * cp under context parallelism).
    same_count_group: a process group whose ranks must run as many micro-batches as each
      other (their passes meet in collectives: the all-to-all of expert parallelism). With
      --micro-batch-tokens or packing the count depends on the lengths, so every rank takes
      the group's largest and splits its biggest passes to get there.
    same_tokens: with same_count_group, pass i also has the same shape on every rank of the group
      (the largest of their passes i: padded passes get empty rows, mask 0 and row N, and the
      group's longest cut; packed ones a longer tail): the all-gather token dispatcher at EP > 1
      gathers equal token counts. Passes are ordered by size on every rank (largest first when
      packed, shortest first when padded), so the padding is what the ranks' lengths differ by.
    """
    mask = batch["mask"]
    width = mask.shape[1]
    group = same_count_group if same_tokens else None
    if pack:
        return packed_micro_batches(
            batch,
            rows,
            max_tokens or micro_batch_size * width,
            length_multiple,
            same_length,
            same_count_group,
            sample_multiple,
            same_tokens,
        )
    # position after each row's last predicted token (0 for a row with none)
    ends = torch.where(mask.any(1), width - mask.flip(1).argmax(1), 0)  # (N,)
    rows = rows[torch.argsort(ends[rows], stable=True)]

    def cut_of(end):  # the length a micro-batch whose longest row ends at `end` is cut to
        return min(width, max(length_multiple, -(-int(end) // length_multiple) * length_multiple))

    longest_cut = cut_of(ends[rows].max()) if len(rows) else width
    groups = []  # lists of positions in `rows`, ascending length
    for i in range(len(rows)):
        cut = longest_cut if same_length else cut_of(ends[rows[i]])  # rows ascend: row i is the group's longest
        joins = bool(groups) and (
            (len(groups[-1]) + 1) * cut <= max_tokens if max_tokens > 0 else len(groups[-1]) < micro_batch_size
        )
        if joins:
            groups[-1].append(i)
        else:
            groups.append([i])
    if max_tokens > 0 or group is not None:
        groups = _split_to(
            groups, _largest_count(len(groups), same_count_group), lambda g: len(g) * cut_of(ends[rows[g[-1]]])
        )
    picks = [rows[g[0] : g[-1] + 1] for g in groups]
    cuts = [longest_cut if same_length else cut_of(ends[picked].max()) for picked in picks]
    sizes = _largest([len(p) for p in picks] + cuts, group)  # (rows, cut) of each pass, the group's largest
    result = []
    for i, (picked, cut) in enumerate(zip(picks, cuts)):
        cut, extra = (sizes[len(picks) + i], sizes[i] - len(picked)) if group is not None else (cut, 0)
        result.append(
            {
                k: _extend(
                    (v[picked, :cut] if v.dim() >= 2 and v.shape[1] == width else v[picked]),
                    extra,
                    len(mask) if k == "row" else _fill(k),
                )
                for k, v in batch.items()
            }
        )
    return result


def _fill(key):
    """What a position without a token of its own holds: routes -1 (the router's own choice), else 0."""
    return -1 if key == "routes" else 0


def _extend(value, extra, fill):
    """value with `extra` more rows of `fill` (empty rows of a padded pass: mask 0, row N)."""
    return torch.cat([value, value.new_full((extra, *value.shape[1:]), fill)]) if extra else value


def _largest(values, group):
    """The element-wise largest of the ranks' integer lists in `group` (all of them call this,
    with lists of one length)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    value = torch.tensor(values, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.tolist()


def _largest_count(count, group):
    """The largest of the ranks' micro-batch counts in `group` (all of them call this)."""
    return _largest([count], group)[0]


def _split_to(groups, count, size_of):
    """Split the biggest groups (size_of) of two or more into halves until there are `count`
    (each group keeps its order). A rank holds at least `count` rows, so this ends."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        biggest = max((g for g in groups if len(g) > 1), key=size_of)
        index = groups.index(biggest)
        groups[index : index + 1] = [biggest[: len(biggest) // 2], biggest[len(biggest) // 2 :]]
    return groups


def packed_micro_batches(
    batch: dict,
    rows,
    max_tokens,
    length_multiple=8,
    same_length=False,
    same_count_group=None,
    sample_multiple=1,
    same_tokens=False,
):
    """Rows `rows` of a padded batch -> micro-batches of ONE row each, holding whole samples
    back to back with no padding between them ("sequence packing", megatron's THD format):

        tokens   a0 a1 a2 a3 b0 b1 c0 c1 c2 pad      (samples a, b, c of one pass)
        positions 0  1  2  3  0  1  0  1  2  0        (RoPE restarts in every sample)
        seq       0  0  0  0  1  1  2  2  2  3        (sample of each token; the tail is its own)
        cu_seqlens [0, 4, 6, 9, 10], max_seqlen 4     (attention stays inside each sample)

    A sample keeps its prompt and response up to its last predicted position (what the
    padded layout's cut keeps). Samples go into passes first-fit by decreasing length, so a
    pass holds up to max_tokens tokens (a longer sample gets a pass of its own); each pass is
    then padded at its end to length_multiple (sequence parallelism needs T % tp == 0), or
    with same_length to the longest pass (megatron's pipeline schedules need one shape).
    sample_multiple > 1: every sample is padded at its own end to a multiple of it, inside
    its segment (context parallelism: megatron's THD + CP convention cuts EVERY sample into
    2 * cp chunks, context_parallel_slice; padding after a sample's last token changes none
    of its outputs, attention being causal). Its budget counts the padded lengths.
    Every (N, T, ...) tensor of `batch` is gathered into this layout (0 at the tail and at the
    samples' padding; routes -1), (N,) tensors become one entry per sample (k,), and src_row / src_col
    say where each token came from (padding: row N, a spare row for scatter_tokens). The math
    of every per-token term is unchanged; per-sequence terms (rl.aggregate_loss's seq modes,
    GSPO) take `seq`. same_count_group, same_tokens: as micro_batches'."""
    mask = batch["mask"]
    num_rows, width = mask.shape
    # tokens a sample needs: up to its last predicted position (at least one, so that a sample
    # with nothing to predict still has its place and every pass has a token)
    ends = torch.where(mask.any(1), width - mask.flip(1).argmax(1), 1).clamp(min=1)
    sizes = -(-ends // sample_multiple) * sample_multiple  # (N,) the place each sample takes in a pass
    bins, loads = [], []
    for r in rows[torch.argsort(sizes[rows], descending=True, stable=True)].tolist():
        n = int(sizes[r])
        fit = next((b for b, load in enumerate(loads) if load + n <= max_tokens), None)
        if fit is None:
            bins.append([r])
            loads.append(n)
        else:
            bins[fit].append(r)
            loads[fit] += n

    def load_of(members):
        return sum(int(sizes[r]) for r in members)

    bins = _split_to(bins, _largest_count(len(bins), same_count_group), load_of)
    if same_tokens:  # pass i of every rank the i-th largest: padded to the largest of them
        bins.sort(key=load_of, reverse=True)
    loads = [load_of(b) for b in bins]
    rounded = [-(-load // length_multiple) * length_multiple for load in loads]
    pass_lengths = [max(rounded)] * len(bins) if same_length else rounded
    if same_tokens:
        pass_lengths = _largest(pass_lengths, same_count_group)
    result = []
    for members, load, length in zip(bins, loads, pass_lengths):
        lengths = [int(sizes[r]) for r in members] + ([length - load] if length > load else [])
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        starts = torch.tensor([0] + lengths).cumsum(0)
        positions = torch.arange(length) - starts[seg]
        own_end = torch.cat([ends[members], torch.zeros(1, dtype=ends.dtype)])  # (k + 1,), the tail: 0
        real = positions < own_end[seg]  # a sample's own tokens, not its padding nor the tail
        src_row = torch.where(real, torch.tensor(members + [num_rows])[seg], num_rows)
        src_col = torch.where(real, positions, 0)
        mb = {}
        for key, value in batch.items():
            if value.dim() >= 2 and value.shape[:2] == mask.shape:
                gathered = value[src_row.clamp(max=num_rows - 1), src_col]  # (length, ...)
                keep = real.view(-1, *[1] * (value.dim() - 2))
                mb[key] = torch.where(keep, gathered, torch.tensor(_fill(key), dtype=value.dtype))[None]  # (1, length)
            elif value.dim() >= 1 and value.shape[0] == num_rows:
                mb[key] = value[members]
        mb.update(
            positions=positions[None],
            seq=seg[None],
            src_row=src_row[None],
            src_col=src_col[None],
            cu_seqlens=starts.to(torch.int32),
            max_seqlen=max(lengths),
        )
        result.append(mb)
    return result


def scatter_tokens(store, mb, values):
    """A pass's per-token values (b, T_mb) into store (N + 1, T), at the positions its tokens
    came from: rows mb["row"] of a padded micro-batch, or src_row/src_col of a packed one
    (whose tail lands in the spare last row). No host sync."""
    if "src_row" in mb:
        store[mb["src_row"], mb["src_col"]] = values
    else:
        store[mb["row"], : values.shape[1]] = values


def context_parallel_slice(mb, cp_size, cp_rank):
    """This context-parallel rank's part of a micro-batch. Padded rows: the T positions cut into
    2 * cp_size chunks, rank r keeping chunks r and 2*cp_size - 1 - r (megatron's layout: each
    rank gets as much causal-attention work as the others; common/model/attention.py attends over
    the other ranks' keys and values). Adds src_row / src_col (where each kept token sits in
    the padded batch, for scatter_tokens) and seq_counts (b,), the valid tokens of each whole
    row (rl.aggregate_loss's per-sequence mean needs the full count, not this rank's).
    Packed rows: the same cut applied to EVERY sample of the row (thd_context_parallel_layout);
    cu_seqlens and max_seqlen stay the whole row's (megatron's THD + CP convention: the rank's
    own boundaries are cu_seqlens // cp), and seq_counts holds each sample's valid tokens."""
    if "cu_seqlens" in mb:
        return _packed_context_parallel_slice(mb, cp_size, cp_rank)
    b, width = mb["tokens"].shape
    chunk = width // (2 * cp_size)
    if chunk * 2 * cp_size != width:
        raise ValueError(f"context parallelism needs the micro-batch length ({width}) divisible by 2 * cp")
    cols = torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
            torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk),
        ]
    )
    local = {
        k: (v[:, cols] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == width else v) for k, v in mb.items()
    }
    local.update(
        src_row=mb["row"][:, None].expand(b, len(cols)), src_col=cols.expand(b, len(cols)), seq_counts=mb["mask"].sum(1)
    )
    return local


def thd_context_parallel_layout(cu_seqlens, cp_size, cp_rank, length):
    """Megatron's THD + CP layout: each sample s of a packed row (n_s = cu_seqlens[s+1] -
    cu_seqlens[s] tokens, a multiple of 2 * cp) is cut into 2 * cp chunks of n_s / (2 cp), and
    CP rank r keeps chunks r and 2cp-1-r of every sample, sample after sample, so its own row
    of `length` (the whole row's / cp) tokens has the boundaries cu_seqlens // cp. E.g.
        cu_seqlens [0, 8, 12] (samples of 8 and 4), cp 2: chunks of 2 and 1 tokens
        rank 0: sample 0 at positions 0 1 6 7, then sample 1 at 0 3
        rank 1: sample 0 at positions 2 3 4 5, then sample 1 at 1 2
    Returns (sample (length,), position inside that sample (length,)) of each of the rank's
    tokens, int64 on cu_seqlens' device. All from cu_seqlens, no host sync (the attention
    calls this for its own queries and for every rank's keys)."""
    cu = cu_seqlens.long()
    local_cu = cu // cp_size
    index = torch.arange(length, device=cu.device)
    sample = torch.searchsorted(local_cu, index, right=True) - 1
    offset = index - local_cu[sample]  # in [0, 2 * chunk): the first chunk, then the mirrored one
    chunk = (cu[sample + 1] - cu[sample]) // (2 * cp_size)
    position = torch.where(offset < chunk, cp_rank * chunk + offset, (2 * cp_size - 2 - cp_rank) * chunk + offset)
    return sample, position


def _packed_context_parallel_slice(mb, cp_size, cp_rank):
    """context_parallel_slice of one packed row (1, T) (packed_micro_batches)."""
    cu = mb["cu_seqlens"].long()
    width = mb["tokens"].shape[1]
    if ((cu[1:] - cu[:-1]) % (2 * cp_size)).any():
        raise ValueError(
            "context parallelism with packed rows needs every sample's length divisible by 2 * cp: "
            "pack with sample_multiple=2 * cp"
        )
    sample, position = thd_context_parallel_layout(cu, cp_size, cp_rank, width // cp_size)
    cols = cu[sample] + position  # (T/cp,) where each of this rank's tokens sits in the whole row
    local = {
        k: (v[:, cols] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == width else v) for k, v in mb.items()
    }
    # each sample's valid tokens in the whole row, indexed by sample id as rl.sequence_sums' result is
    # (one entry per local token; a row has fewer samples than that)
    local["seq_counts"] = torch.zeros(len(cols), dtype=mb["mask"].dtype).index_add_(0, mb["seq"][0], mb["mask"][0])
    return local


def packed_seq_params(mb):
    """megatron's PackedSeqParams of a packed micro-batch (None for a padded one)."""
    if "cu_seqlens" not in mb:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb["cu_seqlens"],
        cu_seqlens_kv=mb["cu_seqlens"],
        max_seqlen_q=mb["max_seqlen"],
        max_seqlen_kv=mb["max_seqlen"],
    )
