"""Learn once how a weight loader writes HF tensors into a model's parameters, then repeat
those writes directly (the weight sync into vLLM, common/rollout/vllm_engine.py).

Why: vLLM's `model.load_weights` spends ~90 us of Python per tensor (name
mapping, its fused-layout and TP-shard arithmetic, a loader per parameter class). For
Qwen2-7B's 339 tensors that is ~30 ms of host time per sync, 4x the 8 ms a device copy of the
15 GB takes. The layout arithmetic gives the same answer at every sync, so:

    plan = WritePlan(model)                    # parameters by storage
    with plan.record(tensors) as stream:       # first sync: the real loader, its writes noted
        model.load_weights(stream)
    for name, tensor in tensors:               # later syncs
        plan.replay(name, tensor) or <through load_weights>

Recording runs the loader under a TorchDispatchMode that sees every aten op. A write into a
parameter (found by its storage) is noted for the HF tensor being loaded at that moment (the
stream's current one) when it is
  copy_  from a view of that tensor's storage inside its extent: (destination view,
         source view relative to the tensor), replayed as the same two views and a copy_;
  fill_ / zero_ with a scalar (vLLM zeroes the padded vocabulary rows): replayed as is.
Any other write into a parameter (an op that computes, a source that is a converted copy)
makes that name not replayable: it goes through the loader at every sync, which is always
correct. A tensor is replayed only with the shape, strides and dtype it had when recorded.

Pieces (the sync at Megatron TP = vLLM TP, common/model/weights.py LocalShard): where every
recorded read of a tensor lies inside full[start:stop] along one dim, `reads_within` says so
and `replay_piece` repeats the writes from that piece alone, so a rank's own TP shard is
written without gathering the full tensor.

Assumes the loader finishes each tensor before it pulls the next from the stream (vLLM's
loaders do: `for name, w in weights:` ...); a write whose source is not the current tensor
is not replayable, so a loader that buffers tensors falls back to itself instead of being
replayed wrongly. Views are rebuilt from the parameter objects (as_strided), so they stay
valid when vLLM's sleep/wake frees and re-maps the memory behind them.
"""

import contextlib

import torch

# _disable_current_modes: private but long-standing (torch >= 2.0; used by torch.compile)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
_IGNORED = object()  # WritePlan.record: the stream's current item is not a tensor (not recorded)
_FILLS = (aten.fill_.Scalar, aten.zero_.default)


def _view(t):  # (size, stride, storage offset): enough to rebuild t from its storage
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _within(src, tensor):
    """src only reads elements of the contiguous `tensor` (same storage, inside its extent)."""
    if src.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr() or src.numel() == 0:
        return False
    lo = src.storage_offset()
    if any(s < 0 for s in src.stride()):
        return False
    hi = lo + sum((n - 1) * s for n, s in zip(src.shape, src.stride()))
    return tensor.storage_offset() <= lo and hi < tensor.storage_offset() + tensor.numel()


class WritePlan:
    """The recorded writes of a loader into `model`'s parameters, by HF tensor name."""

    def __init__(self, model):
        self._params = {}  # storage pointer -> (name, parameter)
        for name, p in model.named_parameters(remove_duplicate=False):
            self._params.setdefault(p.untyped_storage().data_ptr(), (name, p))
        self.steps = {}  # HF name -> [(destination view, "copy", source view or None: all) or (.., "fill", value)]
        self.signature = {}  # HF name -> (torch.Size, stride tuple, dtype) of the recorded tensor
        self.written = {}  # HF name -> names of the parameters its steps write
        self.unreplayable = set()
        self.broken = False  # a write outside any tensor was seen: replay nothing
        self._pieces = {}  # (HF name, dim, start, stop, full shape) -> (piece shape, steps indexing it) or None

    @contextlib.contextmanager
    def record(self, named_tensors):
        """Yield a stream of named_tensors to hand to the loader; writes into parameters made
        while the loader handles a tensor are recorded for that tensor's name."""
        recorder = _Recorder(self)

        def stream():
            source = iter(named_tensors)
            while True:
                recorder.current = None
                with _disable_current_modes():  # the producer (its collectives) runs unrecorded
                    item = next(source, None)
                if item is None:
                    return
                name, tensor = item
                if not isinstance(tensor, torch.Tensor):  # e.g. an ExpertBlock the caller copies itself:
                    recorder.current = _IGNORED  # its writes are neither recorded nor a break
                    yield name, tensor
                    continue
                recorder.current = item
                self.signature[name] = (tensor.shape, tensor.stride(), tensor.dtype)
                self.steps.setdefault(name, [])  # a tensor the loader writes nowhere replays as nothing
                if not tensor.is_contiguous():
                    self.unreplayable.add(name)
                yield name, tensor

        with recorder:
            yield stream()
        for name in self.unreplayable:
            self.steps.pop(name, None)

    def replay(self, name, tensor):
        """Write `tensor` as the recorded loader would; False (nothing written) when `name`
        was not recorded replayably or `tensor` differs in shape, strides or dtype.
        Host time matters here (~400 calls per sync at 7B): the destination views were made
        once, and a source that is the whole tensor is used as is."""
        steps = None if self.broken or not isinstance(tensor, torch.Tensor) else self.steps.get(name)
        if steps is None:
            return False
        shape, stride, dtype = self.signature[name]
        if tensor.shape != shape or tensor.dtype != dtype or tensor.stride() != stride:
            return False
        for dst, kind, arg in steps:
            if kind == "fill":
                dst.fill_(arg)
            elif arg is None:  # the whole tensor
                dst.copy_(tensor)
            else:
                src_size, src_stride, src_offset = arg
                dst.copy_(tensor.as_strided(src_size, src_stride, tensor.storage_offset() + src_offset))
        return True

    def reads_within(self, name, dim, start, stop, shape):
        """Whether the recorded writes of `name` (a full tensor of `shape`) read only from
        full[start:stop] along `dim`, so that replay_piece can write from that piece alone."""
        key = (name, dim, start, stop, tuple(shape))
        if key not in self._pieces:
            self._pieces[key] = self._piece_steps(name, dim, start, stop, tuple(shape))
        return self._pieces[key] is not None

    def _piece_steps(self, name, dim, start, stop, shape):
        steps = None if self.broken else self.steps.get(name)
        if steps is None or self.signature[name][0] != shape or self.signature[name][1] != _contiguous(shape):
            return None
        piece_steps = []
        for dst, kind, arg in steps:
            if kind == "fill":
                piece_steps.append((dst, kind, arg))
                continue
            box = _box(*(arg or (shape, _contiguous(shape), 0)), shape)  # [lo, hi) per dim of the full tensor
            if box is None or box[dim][0] < start or box[dim][1] > stop:
                return None
            piece_steps.append(
                (
                    dst,
                    kind,
                    tuple(
                        slice(lo - start, hi - start) if d == dim else slice(lo, hi) for d, (lo, hi) in enumerate(box)
                    ),
                )
            )
        return shape[:dim] + (stop - start,) + shape[dim + 1 :], piece_steps

    def replay_piece(self, name, piece):
        """Write piece (a common.weights.LocalShard: full[start:stop] along dim) as the
        recorded loader would write those elements of the full tensor; False (nothing
        written) unless reads_within said yes for that piece and its shape and dtype match."""
        found = self._pieces.get((name, piece.dim, piece.start, piece.stop, tuple(piece.full_shape)))
        if found is None or tuple(piece.tensor.shape) != found[0] or piece.tensor.dtype != self.signature[name][2]:
            return False
        for dst, kind, arg in found[1]:
            if kind == "fill":
                dst.fill_(arg)
            else:
                dst.copy_(piece.tensor[arg])
        return True

    def _note(self, current, func, args, only_dst):
        """An aten op of the loader that writes into a parameter, while it handles `current`
        ((name, tensor), or None between tensors). only_dst: the op's first argument is the
        one tensor it writes into a parameter."""
        if current is _IGNORED:
            return
        if current is None:  # a write nothing can be attributed to: the loader must always run
            self.broken = True
            return
        name, tensor = current
        if name in self.unreplayable:
            return
        dst = args[0]
        owner = self._params[dst.untyped_storage().data_ptr()] if only_dst else None
        # the destination as a view of the parameter made now (it stays valid: vLLM's sleep
        # and wake keep each parameter's tensor and address); the source relative to `tensor`
        view = None if owner is None else owner[1].data.as_strided(*_view(dst))
        if owner is not None and func is aten.copy_.default and _within(args[1], tensor):
            src_size, src_stride, src_offset = _view(args[1])
            whole = (src_size, src_stride, src_offset) == _view(tensor)
            step = (view, "copy", None if whole else (src_size, src_stride, src_offset - tensor.storage_offset()))
        elif owner is not None and func in _FILLS:
            step = (view, "fill", args[1] if func is aten.fill_.Scalar else 0)
        else:
            self.unreplayable.add(name)
            return
        self.steps[name].append(step)
        self.written.setdefault(name, set()).add(owner[0])


def _contiguous(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _box(size, stride, offset, shape):
    """The view (size, stride, offset) of a contiguous tensor of `shape` as [(lo, hi)] per
    dim, or None when it is not a box of it (a transposed or a skipping view)."""
    full = _contiguous(shape)
    if len(size) != len(shape) or any(n > 1 and s != f for n, s, f in zip(size, stride, full)):
        return None
    lows = [offset // f % n for f, n in zip(full, shape)]
    if sum(lo * f for lo, f in zip(lows, full)) != offset or any(lo + n > m for lo, n, m in zip(lows, size, shape)):
        return None
    return [(lo, lo + n) for lo, n in zip(lows, size)]


class _Recorder(TorchDispatchMode):
    """Runs every op and hands those that write into a parameter to WritePlan._note."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan
        self.current = None  # (name, tensor) the loader is handling

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.is_mutable:
            values = dict(zip((a.name for a in schema.arguments), args), **kwargs)
            hits = [
                a.name
                for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write and self._is_param(values.get(a.name))
            ]
            if hits:
                self.plan._note(self.current, func, args, only_dst=hits == [schema.arguments[0].name] and bool(args))
        return out

    def _is_param(self, value):
        return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.plan._params
