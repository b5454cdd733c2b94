"""The memory choreography of a colocated step, and its measurement.

Colocation     what goes to host memory and back around the rollout, the reference's pass and
               the update (the mechanism: common/train/offload.py Offloader)
PhaseMemory    peak GPU memory per phase (mem_*_gb), Timer seconds per phase (*_s)
"""

import contextlib
import threading
import time

import torch

from common.train.host_pool import HostPool
from common.train.offload import Offloader, SharedHostBuffers


class Colocation:
    """The memory choreography of one step with the rollout engine on the trainer's GPUs.

        colo = Colocation(engine, policy, [(optimizer, policy)], weights=lambda: export_hf_weights(...),
                          idle=[critic], frozen=[reference], params=True, optimizer_state=True)
        check_host_memory({"offload buffers": colo.host_bytes(), ...})   # arithmetic: nothing made yet
        colo.allocate()                               # once: the pinned pool, frozen models moved into it
        writer = CheckpointWriter(models, shared=colo.host_buffers)      # saves borrow the same buffers
        with colo.rollout(timer, memory):             # trainer state out, weights synced, KV cache in
            samples = engine.generate(...)
        # (after the block: the engine asleep, the policy back)
        with colo.frozen_model(reference): ...        # back for its logprob pass only
        colo.reload_idle(); colo.reload_optimizers(timer)   # copies overlap the passes up to...
        schedule.train_step(..., before_step=lambda: colo.wait_optimizers(timer))  # ...the optimizer step
        colo.turn(critic_optimizer, timer); ...; colo.turn(optimizer, timer)   # PPO: one optimizer at a time

    params: the models' parameters (and DDP grad buffers) go to host memory while unused: the
    policy once its weights are in the engine, idle models (PPO's critic) from the rollout
    until reload_idle(), frozen models (reference) but for frozen_model() blocks (from allocate()).
    optimizer_state: Adam's state and the main params/grads from the rollout until
    reload_optimizers(), whose copies run on a side stream while the forward/backward passes
    run (on a GPU) until wait_optimizers(), called before the first optimizer step. The memory
    is the same as reloading and waiting: the forward/backward ran with the optimizer state on
    the device before this overlap too (measured at 7B: ~0.9 s of PCIe copies per step hidden).
    All their host buffers are pieces of one pinned pool (common/train/host_pool.py); those of
    the checkpointed state are lent to the checkpoint staging (host_buffers: SharedHostBuffers).
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
        self.pool = None  # allocate()'s HostPool
        # what a checkpoint holds of the offloaded state: the optimizers' and the trained models' buffers
        self.host_buffers = SharedHostBuffers(self._kept(), [opt for opt, _ in optimizers], include_cpu)

    def _kept(self):  # the Offloaders of the trained state whose host buffers allocate() makes
        return (self.optimizers if self.optimizer_state else []) + ([self.policy, *self.idle] if self.params else [])

    def _pooled(self):  # ... and of the frozen models, offloaded from allocate() on
        return self._kept() + (list(self.frozen.values()) if self.params else [])

    def host_bytes(self):
        """Host memory allocate() pins on this rank: the exact sum of its buffers, Adam's moments to
        come included (0 on a CPU machine: nothing is moved there). Creates nothing."""
        return sum(off.host_bytes() for off in self._pooled())

    def allocate(self):
        """The pinned pool now, every host buffer carved from it, and the frozen models moved there
        (the first steps would pay seconds for the pinning). Creates no tensor on the device: Adam's
        state appears at its first step, into buffers made for it now. Once: later calls do nothing."""
        if self.pool is not None:
            return
        self.pool = HostPool(self.host_bytes(), pin=torch.cuda.is_available())
        for off in self._pooled():
            off.allocate(self.pool)
        if self.params:
            for off in self.frozen.values():
                off.offload()  # needed only for their own passes

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
                self._settle()  # (a sync sent behind reads the parameters; --rollout-gpus offloads none by default)
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

    def turn(self, optimizer, timer):
        """Two trained models (PPO's policy and critic) update in turn: only `optimizer`'s state is on
        the GPU from here, the other optimizers' (main weights, Adam, gradients freed) go to host
        memory, and `optimizer`'s copies start back as reload_optimizers' do (wait_optimizers()
        before its step). A state a checkpoint save just staged moves without a copy (its host
        buffers hold it). Without the optimizer offload everything stays where it is."""
        if not self.optimizer_state:
            return
        with timer("offload"):
            for off in self.optimizers:
                if off.optimizer is not optimizer:
                    off.offload()
        with timer("reload"):
            for off in self.optimizers:
                if off.optimizer is optimizer and off.offloaded:
                    off.reload(stream=self._copies)

    def wait_optimizers(self, timer):
        """Block until reload_optimizers' copies have landed; the wait (the part of the copies
        the passes did not hide) is timed into reload_s. Also (the scripts call this before each
        optimizer step) until a weight sync sent behind has read the parameters (engines on GPUs
        of their own: common/rollout/remote.py), timed into sync_wait_sec (a part of train_s, not a
        phase of its own: not stacked in the plot)."""
        with timer("reload"):
            for off in self.optimizers:
                off.wait()
        tick = time.time()
        if self._settle():
            timer.times["sync_wait_sec"] = timer.times.get("sync_wait_sec", 0.0) + time.time() - tick

    def _settle(self):
        """Wait for a weight sync sent behind (RemoteEngine with behind: common/rollout/remote.py) -> whether the
        engine sends so."""
        if not getattr(self.engine, "behind", False):
            return False
        self.engine.settle()
        return True


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
