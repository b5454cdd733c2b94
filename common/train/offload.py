"""GPU memory between the phases of a colocated step: offload to host memory and back, measure.

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

The pinned host buffers are allocated once, at start-up (allocate()), and reused every step
(pinning GBs each step would cost more than the copy). Host memory needed: the bytes moved
(see .nbytes).
"""

import contextlib
import threading
import time

import torch


def _full_bytes_view(storage, device):
    """A uint8 tensor over a whole storage (so one copy moves every element, whatever the
    views into it are)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class Offloader:
    """Moves the storages of a fixed set of tensors to host memory and back, in place.

        off = Offloader.of_model(chunks)       # or .of_optimizer(optimizer, chunks)
        off.allocate()  # once: pinned host buffers for every tensor
        off.offload()   # GPU memory of those tensors is released (torch.cuda.empty_cache())
        off.reload()    # same tensors, same values, back on the GPU
        off.reload(stream=side); ...; off.wait()   # the copies overlapping other work (see reload)

    The tensor set is collected at each offload() (Adam creates its state at the first step).
    Tensors already on the CPU are left alone unless include_cpu (tests: the mechanics then
    run on a CPU machine too, copying to ordinary host memory).
    """

    def __init__(self, collect, include_cpu=False):
        self._collect = collect  # () -> list of (tensor, keep_contents)
        self._include_cpu = include_cpu
        self._host = {}  # id(tensor) -> host buffer, reused across steps
        self._moved = []  # (tensor, nbytes, host buffer or None) while offloaded
        self._pending = None  # CUDA event of a reload's copies on a side stream, until wait()
        self.nbytes = 0  # bytes released by the last offload()

    @classmethod
    def of_model(cls, chunks, include_cpu=False):
        """Parameters of model chunks (DDP-wrapped or plain), with DDP's grad buffers freed."""
        return cls(lambda: _model_tensors(chunks), include_cpu)

    @classmethod
    def of_optimizer(cls, optimizer, chunks, include_cpu=False):
        """A megatron optimizer's main params and state (created if Adam has not stepped yet),
        plus the DDP grad buffers of `chunks` (freed: dead between steps)."""
        return cls(lambda: _optimizer_tensors(optimizer, chunks), include_cpu)

    @property
    def offloaded(self):
        return bool(self._moved)

    def _tensors(self):
        """(tensor, keep) of the collected set, one per storage, skipping empty storages (and
        CPU ones unless include_cpu)."""
        seen = set()
        for tensor, keep in self._collect():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or (tensor.device.type == "cpu" and not self._include_cpu):
                continue
            key = (tensor.device, storage.data_ptr())
            if key not in seen:  # several tensors (views) share one storage
                seen.add(key)
                yield tensor, keep

    def _host_buffer(self, tensor):
        host = self._host.get(id(tensor))
        nbytes = tensor.untyped_storage().nbytes()
        if host is None or host.numel() != nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=tensor.device.type == "cuda")
            self._host[id(tensor)] = host
        return host

    def host_bytes(self):
        """Bytes of host memory allocate() pins (or has pinned) for this tensor set."""
        return sum(tensor.untyped_storage().nbytes() for tensor, keep in self._tensors() if keep)

    def allocate(self):
        """Create every host buffer now. Pinning host memory costs seconds per 10 GB (measured
        at 1.5B: the first two steps' offloads took 6.5-6.8 s, later ones 0.40 s): call this
        once at start-up (after a resume, which may replace tensors), so that no step pays
        for it. An optimizer's Offloader creates Adam's state first."""
        for tensor, keep in self._tensors():
            if keep:
                self._host_buffer(tensor)

    @torch.no_grad()
    def offload(self):
        self.wait()
        if self._moved:
            return
        moved = []
        for tensor, keep in self._tensors():
            storage = tensor.untyped_storage()
            host = None
            if keep:
                host = self._host_buffer(tensor)
                host.copy_(_full_bytes_view(storage, tensor.device), non_blocking=True)
            moved.append((tensor, storage.nbytes(), host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the memory is freed
        for tensor, _, _ in moved:
            tensor.untyped_storage().resize_(0)
        self._moved = moved
        self.nbytes = sum(n for _, n, _ in moved)
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


class Colocation:
    """The memory choreography of one step with the rollout engine on the trainer's GPUs.

        colo = Colocation(engine, policy, [(optimizer, policy)], weights=lambda: export_hf_weights(...),
                          idle=[critic], frozen=[reference], params=True, optimizer_state=True)
        colo.allocate()                               # once: pinned host buffers for all of it
        with colo.rollout(timer, memory):             # trainer state out, weights synced, KV cache in
            samples = engine.generate(...)
        # (after the block: the engine asleep, the policy back)
        with colo.frozen_model(reference): ...        # back for its logprob pass only
        colo.reload_idle(); colo.reload_optimizers(timer)   # copies overlap the passes up to...
        schedule.train_step(..., before_step=lambda: colo.wait_optimizers(timer))  # ...the optimizer step

    params: the models' parameters (and DDP grad buffers) go to host memory while unused: the
    policy once its weights are in the engine, idle models (PPO's critic) from the rollout
    until reload_idle(), frozen models (reference) but for frozen_model() blocks.
    optimizer_state: Adam's state and the main params/grads from the rollout until
    reload_optimizers(), whose copies run on a side stream while the forward/backward passes
    run (on a GPU) until wait_optimizers(), called before the first optimizer step. The memory
    is the same as reloading and waiting: the forward/backward ran with the optimizer state on
    the device before this overlap too (measured at 7B: ~0.9 s of PCIe copies per step hidden).
    Phases are timed into timer's offload_s / wake_s / sync_s / sleep_s /
    reload_s, peak memory into memory's mem_sync_gb / mem_rollout_gb. include_cpu: as
    Offloader's (tests on a CPU machine).
    """

    def __init__(
        self,
        engine,
        policy,
        optimizers,
        *,
        weights,
        idle=(),
        frozen=(),
        params=True,
        optimizer_state=True,
        include_cpu=False,
    ):
        self.engine, self.weights = engine, weights
        self.params, self.optimizer_state = params, optimizer_state
        self.policy = Offloader.of_model(policy, include_cpu)
        self.idle = [Offloader.of_model(m, include_cpu) for m in idle]
        self.frozen = {id(m): Offloader.of_model(m, include_cpu) for m in frozen if m is not None}
        self.optimizers = [Offloader.of_optimizer(opt, chunks, include_cpu) for opt, chunks in optimizers]
        self._copies = torch.cuda.Stream() if torch.cuda.is_available() else None  # reload_optimizers' side stream
        if params:
            for off in self.frozen.values():
                off.offload()  # needed only for their own passes

    def _pinned(self):  # the Offloaders whose host buffers allocate() makes
        return (self.optimizers if self.optimizer_state else []) + ([self.policy, *self.idle] if self.params else [])

    def host_bytes(self):
        """Host memory allocate() pins on this rank (0 on a CPU machine: nothing is moved there)."""
        return sum(off.host_bytes() for off in self._pinned())

    def allocate(self):
        """Every pinned host buffer now (Adam's state included): the first steps would pay seconds for them."""
        for off in self._pinned():
            off.allocate()

    @contextlib.contextmanager
    def rollout(self, timer, memory):
        """Around the rollout: the weight sync into a woken engine, then its KV cache; after the
        block the engine sleeps (level 2: weights and KV cache freed, nothing copied) and the
        policy's parameters come back. An exception in the block leaves everything as it is."""
        memory.start()
        with timer("offload"):
            for off in (self.optimizers if self.optimizer_state else []) + (self.idle if self.params else []):
                off.offload()  # Adam state, grads and idle models wait until their turn
        with timer("wake"):
            self.engine.wake_weights()  # weights first: the KV cache is not needed while syncing
        with timer("sync"):
            self.engine.update_weights(self.weights())
        with timer("offload"):
            if self.params:
                self.policy.offload()  # its weights now live in the engine
        with timer("wake"):
            self.engine.wake_kv_cache()
        memory.end("sync")
        yield
        memory.end("rollout")
        with timer("sleep"):
            self.engine.sleep()
        with timer("reload"):
            self.policy.reload()

    @contextlib.contextmanager
    def frozen_model(self, model):
        """A frozen model (the reference; the reward model keeps its own Offloader) on the GPU for
        the block, offloaded after it when params is on."""
        off = self.frozen[id(model)]
        off.reload()
        yield
        if self.params:
            off.offload()

    def reload_idle(self):
        for off in self.idle:
            off.reload()

    def reload_optimizers(self, timer):
        """Start bringing the optimizers' state back (the copies overlap what follows, on a GPU);
        wait_optimizers() before any optimizer reads it."""
        with timer("reload"):
            for off in self.optimizers:
                off.reload(stream=self._copies)

    def wait_optimizers(self, timer):
        """Block until reload_optimizers' copies have landed; the wait (the part of the copies
        the passes did not hide) is timed into reload_s."""
        with timer("reload"):
            for off in self.optimizers:
                off.wait()


def _ddp_buffers(chunk):
    """megatron DDP's flat param/grad buffers of one chunk (none for a plain module, whose
    `buffers` is nn.Module's method, not DDP's list)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(chunk, DistributedDataParallel):
        return []
    return list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def _model_tensors(chunks):
    tensors = []
    for chunk in chunks:
        for buffer in _ddp_buffers(chunk):
            if buffer.param_data is not None:  # distributed optimizer: params are views of it
                tensors.append((buffer.param_data, True))
            tensors.append((buffer.grad_data, False))
        tensors += [(p, True) for p in chunk.parameters()]  # deduplicated by storage in offload()
    return tensors


def _optimizer_tensors(optimizer, chunks):
    from common.train.setup import ensure_adam_state

    # Adam's state appears at its first step; created now (zeros, as that step would make them)
    # it is allocated and moved like the rest from the start
    ensure_adam_state(optimizer)
    optimizer.zero_grad()  # main-param grads (fp32 copies of the last step's) are dead: free them
    tensors = [(buffer.grad_data, False) for chunk in chunks for buffer in _ddp_buffers(chunk)]
    # For an fp32 model the main params ARE the model's params (or views of its DDP buffer):
    # those storages belong to the model's Offloader, or the weight sync that runs after the
    # optimizer's offload would read freed memory.
    model_storages = {t.untyped_storage().data_ptr() for t, _ in _model_tensors(chunks)}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)  # the torch.optim.Adam megatron wraps
        if inner is None:
            continue
        for group in inner.param_groups:
            # main params: fp32 copies for a bf16 model, else the model's own (skipped)
            tensors += [(p, True) for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages]
        for state in inner.state.values():
            tensors += [(v, True) for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensors


# ---------------------------------------------------------------------------------------
# Measuring: what the metrics call mem_*_gb
# ---------------------------------------------------------------------------------------
def gpu_used_gb(device=None):
    """Device memory in use by everything on this GPU (torch, vLLM's own allocator, NCCL,
    other processes), in GB; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 1e9


class PhaseMemory:
    """Peak device memory per phase of a step, for the metrics: end(name) records
    mem_{name}_gb, the most GPU memory in use (gpu_used_gb: Megatron, vLLM, NCCL, caches) since
    the previous start()/end(), sampled every interval_s by a background thread.

    Why not torch.cuda.max_memory_allocated: vLLM's sleep-mode allocator hands out its weight
    and KV-cache tensors through torch, and they stay "allocated" for torch while vLLM sleeps
    with the physical memory released (measured on an H200: a 44 GB torch peak in a phase where
    the device had 12 GB in use). A phase shorter than interval_s may be missed by the sampler;
    the value at end() is always included. Does nothing without CUDA (metrics then absent).
    """

    def __init__(self, interval_s=0.005):
        self.enabled = torch.cuda.is_available()
        self.metrics = {}
        self._peak = 0.0
        if self.enabled:
            self._device = torch.cuda.current_device()
            self._lock = threading.Lock()
            threading.Thread(target=self._poll, args=(interval_s,), daemon=True).start()

    def _poll(self, interval_s):
        torch.cuda.set_device(self._device)
        while True:
            used = gpu_used_gb(self._device)
            with self._lock:
                self._peak = max(self._peak, used)
            time.sleep(interval_s)

    def start(self):
        if self.enabled:
            with self._lock:
                self._peak = gpu_used_gb(self._device)

    def end(self, name):
        if self.enabled:
            now = gpu_used_gb(self._device)
            with self._lock:
                self.metrics[f"mem_{name}_gb"] = max(self._peak, now)
                self._peak = now


class Timer:
    """times["x_s"] += seconds of the with-block; `with timer("sync"):`."""

    def __init__(self, times):
        self.times = times

    def __call__(self, name):
        return _Tick(self.times, f"{name}_s")


class _Tick:
    def __init__(self, times, key):
        self.times, self.key = times, key

    def __enter__(self):
        self.t0 = time.time()

    def __exit__(self, *exc):
        self.times[self.key] = self.times.get(self.key, 0.0) + time.time() - self.t0
