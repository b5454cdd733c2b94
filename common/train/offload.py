"""Moving the trainer's state off the GPU to host memory and back (common/train/colocation.py: when).

On one GPU the trainer (Megatron params, fp32 grad buffers, Adam state) and vLLM (weights,
KV cache) take turns. During the rollout the trainer's state is not used, so it moves to
pinned host memory, and vLLM's KV cache gets the room; after the rollout vLLM sleeps
(level 2, common/rollout/vllm_engine.py) and the trainer's state comes back.

How: every tensor involved keeps its identity, only its *storage* is emptied
(`untyped_storage().resize_(0)`) after a copy to a pinned host buffer, and re-grown and
filled on reload. Views into a storage stay valid through this, which matters because
megatron is made of views: DDP maps each param.data and param.main_grad into one flat
buffer per dtype, the distributed optimizer keeps views of those buffers, and the
optimizer's param_groups hold the main params. (megatron-core 0.16.1 has its own
offload_to_cpu methods; from reading its code, not measured: the optimizer's replaces `p.data`
with a new unpinned CPU tensor, so copies go through pageable memory, and for an fp32 model
the distributed optimizer's main-param shards stop being views of the model's buffer.)

Contents that are dead between steps are freed, not copied: gradient buffers (zeroed before
each optimizer step anyway, and zeroed again on reload) and the optimizer's main-param
grads (set to None, as optimizer.zero_grad() does).

Host memory: one pinned block per rank (common/train/host_pool.py), sized by arithmetic at
start-up and carved into one exact piece per storage: the tensors that exist, plus the Adam
moments that the first optimizer step will create (each of its main param's shape and dtype;
nothing is created to measure them). Pinning costs seconds per 10 GB, so it is done once
(allocate()) and the pieces are reused every step. A background checkpoint save borrows the
same pieces (SharedHostBuffers): it copies the state into them instead of into a second
copy, and the next offload, finding them already equal to the GPU's, skips those copies.
"""

import contextlib

import torch

from common.train.host_pool import HostPool
from common.train.setup import adam_state_to_come, torch_adams


def _full_bytes_view(storage, device):
    """A uint8 tensor over a whole storage (so one copy moves every element, whatever the
    views into it are)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _storage_key(tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()


class Offloader:
    """Moves the storages of a fixed set of tensors to host memory and back, in place.

        off = Offloader.of_model(chunks)       # or .of_optimizer(optimizer, chunks)
        off.allocate(pool)  # once: a host buffer for every storage, carved from the pool (default: its own)
        off.offload()   # GPU memory of those tensors is released (torch.cuda.empty_cache())
        off.reload()    # same tensors, same values, back on the GPU
        off.reload(stream=side); ...; off.wait()   # the copies overlapping other work (see reload)

    The tensor set is collected at each offload() (Adam creates its state at the first step):
    each storage has a key that stays the same when torch replaces the tensor (an Adam moment is
    keyed by its parameter and name), and its host buffer is the one allocate() carved for that
    key. Tensors already on the CPU are left alone unless include_cpu (tests: the mechanics then
    run on a CPU machine too, copying to ordinary host memory).
    """

    def __init__(self, collect, include_cpu=False, optimizer=None):
        # () -> [(key, tensor or None, keep, like)]: tensor None is one Adam has not created yet,
        # which will have the shape, dtype and device of `like` (its parameter)
        self._collect = collect
        self._include_cpu = include_cpu
        self.optimizer = optimizer  # the megatron optimizer whose state this holds (of_optimizer)
        self.pool = None  # the HostPool the host buffers come from (allocate())
        self._host = {}  # key -> host buffer, reused across steps
        self._moved = []  # (tensor, nbytes, host buffer or None) while offloaded
        self._pending = None  # CUDA event of a reload's copies on a side stream, until wait()
        self._clean = set()  # keys whose host buffer holds what the device holds (a save copied it there)
        self._lent = set()  # keys whose host buffer a checkpoint writer may still be reading ...
        self._readers = []  # ... until these return (each waits for one save's file writes)
        self.nbytes = 0  # bytes released by the last offload()
        self.kept = 0  # of those, bytes kept in host memory (the rest was freed: gradients)
        self.copied = 0  # of those, bytes copied (the others were in their host buffer already)

    @classmethod
    def of_model(cls, chunks, include_cpu=False):
        """Parameters of model chunks (DDP-wrapped or plain), with DDP's grad buffers freed."""
        return cls(lambda: _model_tensors(chunks), include_cpu)

    @classmethod
    def of_optimizer(cls, optimizer, chunks, include_cpu=False):
        """A megatron optimizer's main params and state (counted before Adam's first step creates it),
        plus the DDP grad buffers of `chunks` (freed: dead between steps)."""
        return cls(lambda: _optimizer_tensors(optimizer, chunks), include_cpu, optimizer)

    @property
    def offloaded(self):
        return bool(self._moved)

    def _entries(self):
        """(key, tensor or None, keep, nbytes) of the collected set, one per storage (views share
        one), skipping empty storages (and CPU ones unless include_cpu)."""
        seen = set()
        for key, tensor, keep, like in self._collect():
            if like.device.type == "cpu" and not self._include_cpu:
                continue
            if tensor is None:  # what Adam's first step will create (zeros_like its parameter)
                yield key, None, keep, like.numel() * like.element_size()
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or _storage_key(tensor) in seen:
                continue
            seen.add(_storage_key(tensor))
            yield key, tensor, keep, storage.nbytes()

    def planned(self):
        """[(key, nbytes)] of the host buffers this set needs, Adam's state to come included. Call it
        while the tensors are on the device."""
        return [(key, nbytes) for key, _, keep, nbytes in self._entries() if keep]

    def host_bytes(self):
        """Bytes of host memory allocate() takes for this tensor set (alignment included)."""
        return HostPool.size_for(nbytes for _, nbytes in self.planned())

    def allocate(self, pool=None):
        """Carve a host buffer for every planned storage out of `pool` (default: a pool of this
        set's own, pinned on a GPU). Pinning host memory costs seconds per 10 GB (measured at
        1.5B: the first two steps' offloads took 6.5-6.8 s, later ones 0.40 s): call this once at
        start-up, so that no step pays for it. Creates no tensor on the device."""
        planned = self.planned()
        self.pool = pool or HostPool(HostPool.size_for(n for _, n in planned), pin=torch.cuda.is_available())
        for key, nbytes in planned:
            self._host_buffer(key, nbytes)

    def _host_buffer(self, key, nbytes):
        host = self._host.get(key)
        if host is None or host.numel() != nbytes:  # a new storage, or a tensor replaced by another size
            host = self.pool.take(nbytes)
            self._host[key] = self.pool.extra(nbytes) if host is None else host
            self._clean.discard(key)
        return self._host[key]

    def _wait_for_readers(self):
        """Block until no checkpoint writer reads the host buffers any more (they are written next)."""
        for wait in self._readers:
            wait()
        self._readers, self._lent = [], set()

    @torch.no_grad()
    def offload(self):
        self.wait()
        if self._moved:
            return
        if self.pool is None:
            self.allocate()
        if self.optimizer is not None:
            self.optimizer.zero_grad()  # main-param grads (fp32 copies of the last step's) are dead: free them
        moved, copied = [], 0
        for key, tensor, keep, nbytes in self._entries():
            if tensor is None:
                continue
            host = None
            if keep:
                host = self._host_buffer(key, nbytes)
                if key not in self._clean:  # a save left what the device holds there: nothing to copy
                    if key in self._lent:
                        self._wait_for_readers()
                    host.copy_(_full_bytes_view(tensor.untyped_storage(), tensor.device), non_blocking=True)
                    copied += nbytes
            moved.append((tensor, nbytes, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the memory is freed
        for tensor, _, _ in moved:
            tensor.untyped_storage().resize_(0)
        self._moved, self._clean = moved, set()  # reloaded, the device may change again
        self.nbytes = sum(n for _, n, _ in moved)
        self.kept = sum(n for _, n, host in moved if host is not None)
        self.copied = copied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give it back to the driver: vLLM allocates outside torch

    @torch.no_grad()
    def reload(self, stream=None):
        """Every tensor back, with its values (freed-only contents zeroed).

        stream: a CUDA stream for the host-to-device copies, which then run while the caller
        goes on (the step's logprob passes and forward/backward, on the current stream): the
        storages are allocated and the zeroing done on the current stream now, the copies
        queued behind them on `stream`, and nothing may read the copied tensors before wait().
        Without it the copies are waited for here."""
        copies = []
        for tensor, nbytes, host in self._moved:
            storage = tensor.untyped_storage()
            storage.resize_(nbytes)  # allocated on the current stream (the one that uses it later)
            view = _full_bytes_view(storage, tensor.device)
            if host is None:
                view.zero_()
            else:
                copies.append((view, host))
        side = stream if stream is not None and any(view.is_cuda for view, _ in copies) else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the memory is ours on that stream only from here
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for view, host in copies:
                view.copy_(host, non_blocking=True)
        if side is not None:
            self._pending = torch.cuda.Event()
            self._pending.record(side)
        elif self._moved and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._moved = []

    def wait(self):
        """Block until the copies of a reload(stream=...) have landed (no-op otherwise). The
        host waits, not only the current stream: a timer around this sees what was not hidden."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    # --- lending the host buffers to a checkpoint save (SharedHostBuffers) ---
    def resident_buffers(self):
        """{storage key: (key, host buffer)} of the kept storages now on the device that have a
        host buffer of their size."""
        found = {}
        for key, tensor, keep, nbytes in self._entries():
            host = self._host.get(key)
            if tensor is not None and keep and host is not None and host.numel() == nbytes:
                found[_storage_key(tensor)] = key, host
        return found

    def lend(self, keys, written):
        """A save copied these storages into their host buffers (the copies have landed) and its
        writer reads them until written() returns: the next offload need not copy them (unless the
        device changes first: changed()), a later copy into them waits for written()."""
        self._clean |= set(keys)
        self._lent |= set(keys)
        self._readers.append(written)

    def changed(self):
        """The device's tensors may have changed (an optimizer step, a load): the next offload copies all."""
        self._clean = set()


class SharedHostBuffers:
    """The offload's host buffers, lent to background checkpoint saves (common/train/checkpoint_io.py
    HostStaging), so that a save needs no second host copy of the state.

    At a save (end of step N: every tensor on the GPU, the host buffers idle) each tensor of the
    checkpoint that lies in a storage an Offloader holds a buffer for is staged by copying that
    whole storage into its buffer (once per save) and handing the writer a host tensor over the
    tensor's bytes there. The buffers then hold what the GPU holds, so the next offload (step
    N+1's rollout) skips those copies; any optimizer step or optimizer load in between (hooks
    on the torch Adams) makes it copy everything again. The offload after that (step N+2)
    writes into the buffers, so it first waits for this rank's file writes of the save (no
    communication: the save's writer threads are joined; a save normally takes less than a step).
    Model parameters changed outside an optimizer step between a save and the next offload are
    not detected: the scripts save at the end of a step, after which nothing changes them."""

    def __init__(self, offloaders, optimizers=(), include_cpu=False):
        self.offloaders = list(offloaders)
        self.include_cpu = include_cpu  # CPU tensors are staged like GPU ones (tests)
        self._found, self._copied, self._unlent = None, set(), {}
        for optimizer in optimizers:
            for adam in torch_adams(optimizer):
                adam.register_step_pre_hook(lambda *_: self.changed())
                adam.register_load_state_dict_pre_hook(lambda *_: self.changed())

    def changed(self):
        for off in self.offloaders:
            off.changed()

    def held_storages(self):
        """Storage keys (device, data_ptr) of the tensors now on the device whose storage the offload
        keeps in a host buffer."""
        return {
            _storage_key(t) for off in self.offloaders for _, t, keep, _ in off._entries() if keep and t is not None
        }

    def holds_state_of(self, optimizer):
        """Whether the offload keeps this optimizer's state (Adam's moments, also those to come)."""
        return any(off.optimizer is optimizer for off in self.offloaders)

    def begin(self):
        """A save starts (the previous one's files are written)."""
        self._found, self._copied, self._unlent = None, set(), {}
        for off in self.offloaders:
            off._wait_for_readers()  # returns at once: the previous save is written

    def _find(self):
        """{storage key: (Offloader, key, host buffer)} of what is on the device now. Looked up anew
        for each stage(): a save before Adam's first step creates its state in between (each model's
        save: ensure_adam_state), into storages with buffers carved for them."""
        if self._found is None:
            self._found = {
                storage: (off, key, host)
                for off in self.offloaders
                for storage, (key, host) in off.resident_buffers().items()
            }
        return self._found

    def copy_of(self, tensor):
        """A host tensor over exactly this tensor's bytes in its storage's host buffer, the storage
        copied there (non_blocking) if not yet in this save; None where the offload holds no buffer
        for it or the tensor is not contiguous."""
        found = self._find().get(_storage_key(tensor))
        if found is None or not tensor.is_contiguous():
            return None
        off, key, host = found
        if (off, key) not in self._copied:  # the storage's first tensor in this save
            if key in off._lent:
                off._wait_for_readers()
            host.copy_(_full_bytes_view(tensor.untyped_storage(), tensor.device), non_blocking=True)
            self._copied.add((off, key))
            self._unlent.setdefault(off, set()).add(key)
        start, nbytes = tensor.storage_offset() * tensor.element_size(), tensor.numel() * tensor.element_size()
        return torch.from_numpy(host.numpy()[start : start + nbytes]).view(tensor.dtype).view(tensor.shape)

    def lend(self, written):
        """The copies of copy_of since the last lend() have landed; their writer reads them until
        written() returns."""
        for off, keys in self._unlent.items():
            off.lend(keys, written)
        self._found, self._unlent = None, {}


def _ddp_buffers(chunk):
    """megatron DDP's flat param/grad buffers of one chunk (none for a plain module, whose
    `buffers` is nn.Module's method, not DDP's list)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(chunk, DistributedDataParallel):
        return []
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def _model_tensors(chunks):
    """(key, tensor, keep, like) of model chunks: params (views of DDP's param buffer with the
    distributed optimizer) kept, DDP's grad buffers freed."""
    tensors = []
    for chunk in chunks:
        for buffer in _ddp_buffers(chunk):
            if buffer.param_data is not None:  # distributed optimizer: params are views of it
                tensors.append((id(buffer.param_data), buffer.param_data, True, buffer.param_data))
            tensors.append((id(buffer.grad_data), buffer.grad_data, False, buffer.grad_data))
        tensors += [(id(p), p, True, p) for p in chunk.parameters()]  # deduplicated by storage in _entries()
    return tensors


def _optimizer_tensors(optimizer, chunks):
    """(key, tensor or None, keep, like) of a megatron optimizer: DDP's grad buffers (freed), the
    main params, and Adam's state, keyed by (parameter, name): torch replaces those tensors on a
    load. Before Adam's first step its moments are listed as None with their parameter (zeros_like
    it, as that step creates them): counted, not created."""
    tensors = [
        (id(buffer.grad_data), buffer.grad_data, False, buffer.grad_data)
        for chunk in chunks
        for buffer in _ddp_buffers(chunk)
    ]
    # For an fp32 model the main params ARE the model's params (or views of its DDP buffer):
    # those storages belong to the model's Offloader, or the weight sync that runs after the
    # optimizer's offload would read freed memory.
    model_storages = {t.untyped_storage().data_ptr() for _, t, _, _ in _model_tensors(chunks)}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)  # the torch.optim.Adam megatron wraps
        if inner is None:
            continue
        for group in inner.param_groups:
            # main params: fp32 copies for a bf16 model, else the model's own (skipped)
            tensors += [
                (id(p), p, True, p) for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages
            ]
        for param, state in inner.state.items():
            tensors += [
                (("state", id(param), name), v, True, v)
                for name, v in state.items()
                if torch.is_tensor(v) and v.dim() > 0  # not the step counters (scalars)
            ]
    tensors += [(("state", id(param), name), None, True, param) for param, name in adam_state_to_come(optimizer)]
    return tensors
