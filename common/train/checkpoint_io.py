"""The disk side of common/train/save.py: how the tensor files of a training checkpoint
are written (in the background if asked). The step-directory protocol that makes a checkpoint
appear all at once (step_N.tmp -> `complete` marker -> rename -> `latest`) and the RNG files:
common/train/checkpoint_dirs.py.

Tensor files. megatron's dist_checkpointing.save(..., async_sharded_save=True) splits a save:
  1. planning (collective: plans gathered, global metadata built; common.pt by rank 0),
     done inside the call, which returns an AsyncRequest;
  2. writing this rank's __<rank>_<i>.distcp files: no communication at all;
  3. finalize (collective): write results gathered, rank 0 writes .metadata and
     metadata.json; a write error of any rank is raised on every rank.
We run 1 and 3 on the main thread, so every collective stays in program order on every rank,
and 2 in threads of this process (or inline, for a synchronous save), from host copies.
Why threads and not megatron's own callers (AsyncCallsQueue): those fork a process per save
(which forks a writer process per file) or keep a spawned worker alive. Forking a CUDA/NCCL
process is delicate, and a spawned helper that outlives the program keeps the launcher's
stdout open (`python train_grpo.py | tee log` never ended on the GPU machine). A thread dies
with the program; the write itself (fsync'ed file I/O) runs mostly without the GIL.

megatron would still start one helper process on the first save of a process, whatever the
mode: FileSystemWriterAsync's results queue (filesystem_async._get_write_results_queue) is
served by a multiprocessing Manager in a spawned process, made for megatron's writer
processes. Here every result is put and read in this process (by our writer threads, or by
megatron's synchronous save in the main thread), so before each save in_process_results()
hands megatron a plain in-process queue in that lazily filled module-level slot. The Manager
cost ~1.4 s to start (the spawned process imports the script again) and ~0.6 s to stop per
process that saves, and its server does not watch its parent: after os._exit (the vLLM exit
path) or a kill it ran on, holding stdout (tests/test_train_checkpoint.py:
test_exit_closes_stdout). megatron makes that queue nowhere else (0.16.1: only when a save
prepares its writes), so no save of this project starts the process.
"""

import errno
import os
import queue
import shutil
import sys
import threading
import time

import torch
import torch.distributed as dist

from common.train.host_pool import HostPool


class CheckpointWriteError(RuntimeError):
    """A checkpoint's files could not be written (on any rank; raised on every rank). The step
    directory stays *.tmp and `latest` keeps pointing at the previous checkpoint. The training
    scripts stop with this message (exit code 4)."""


def device_for_collectives():
    """Where a small tensor must live for a collective on the default group (NCCL: the GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_finite(named_tensors, what):
    """Raise common.guard.NonFiniteError (a RuntimeError: the scripts end with one message and
    exit code 3) on every rank if any rank's tensor has a NaN/inf. All ranks call this.

    named_tensors: (name, tensor) of this rank (local shards). One flag per tensor is computed
    on the tensors' device and read back once; only when something is wrong are names exchanged."""
    named_tensors = [(name, t) for name, t in named_tensors if t.numel() > 0]
    if named_tensors:
        flags = torch.stack([~torch.isfinite(t).all() for _, t in named_tensors]).cpu()
        bad = [named_tensors[i][0] for i in flags.nonzero().flatten().tolist()]
    else:
        bad = []
    count = torch.tensor([len(bad)], device=device_for_collectives())
    dist.all_reduce(count)
    if count.item() == 0:
        return
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, bad)
    listed = "; ".join(
        f"rank {rank}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        for rank, names in enumerate(per_rank)
        if names
    )
    from common.train.guard import NonFiniteError

    raise NonFiniteError(
        f"refusing to write {what}: non-finite values (NaN/inf) in {count.item()} tensor(s) "
        f"({listed}). Nothing was written; the run has diverged -- resume from an "
        "earlier checkpoint (e.g. with a lower learning rate)."
    )


def live_storages(tensors):
    """data_ptr of the storage of each tensor: a staged tensor sharing one would change under
    the training loop's feet."""
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0}


class HostStaging:
    """Host memory that a background save copies this rank's GPU tensors into, reused by every
    save (a save starts after the previous one is written).

    Why not megatron's staging (preload_tensors: tensor.to("cpu", non_blocking=True) per
    tensor): torch takes that memory from its caching host allocator, which pins fresh
    memory whenever its cache has no block of the size asked for (seconds per 10 GB) and
    rounds each block up to a power of two. Here:
      - a tensor in a storage the offload keeps a host buffer for (shared: the colocation's
        SharedHostBuffers, common/train/offload.py) is copied into that buffer: the state moved
        off the GPU for the rollout is not held a second time;
      - any other GPU tensor goes into the staging's own buffer, one pinned block of exact size
        reserved at start-up (reserve(), common/train/host_pool.py), so a save's copy is a single
        D2H stream at the link's speed. A tensor beyond the reserved bytes is copied the plain
        way (pageable memory), so a too small reserve costs time only.
    include_cpu: CPU tensors of the live state are staged as GPU ones (tests on a CPU machine).
    (megatron itself clones the CPU tensors that are views into a larger storage: those are
    host copies already, never staged; GPU tensors it leaves as they are.)"""

    ALIGN = 64  # bytes: every dtype's alignment, and cache-line aligned copies

    def __init__(self, shared=None, include_cpu=False):
        self.shared = shared
        self.include_cpu = include_cpu or bool(shared is not None and shared.include_cpu)
        self.pool = HostPool(0, pin=False, align=self.ALIGN)
        self.overflow_bytes = 0  # of the current save: copied outside the buffer
        self.shared_bytes = 0  # of the current save: staged in the offload's host buffers

    @property
    def buffer(self):
        """The staging's own buffer (uint8)."""
        return self.pool.block

    @property
    def used(self):
        """Bytes of the own buffer taken by the current save's copies."""
        return self.pool.used

    def reserve(self, nbytes):
        """Make the own buffer at least nbytes (pinned when a GPU is present). Seconds per 10 GB."""
        if nbytes > self.pool.nbytes:
            self.pool = None  # free the old one first
            self.pool = HostPool(nbytes, pin=torch.cuda.is_available(), align=self.ALIGN)

    @staticmethod
    def nbytes_for(tensors, include_cpu=False):
        """Bytes reserve() needs to stage these GPU tensors (alignment included)."""
        sizes = [t.numel() * t.element_size() for t in tensors if t.is_cuda or include_cpu]
        return HostPool.size_for(sizes, align=HostStaging.ALIGN)

    def clear(self):
        """Begin a save: its copies may take the whole buffer (and the offload's) again. Only once
        the previous save's files are written (CheckpointWriter.save waits for them first)."""
        self.pool.used, self.overflow_bytes, self.shared_bytes = 0, 0, 0
        if self.shared is not None:
            self.shared.begin()

    def stage(self, buckets, live, written=None):
        """megatron's write buckets with every GPU tensor copied to host memory (here, while it
        fits) and every CPU tensor that is live training state cloned; waits for the copies.
        The copies go after those of earlier stage() calls since clear(): one save of several
        models (PPO's policy, then its critic) stages each in turn while the first one's files
        are still being written, so the critic must not reuse the policy's bytes.
        written: returns once the buckets' files are written; the offload's buffers used here
        are not written to before (SharedHostBuffers.lend)."""
        staged = []
        for path, name, (byte_items, tensor_items) in buckets:
            items = []
            for item, tensor in tensor_items:
                is_live = tensor.untyped_storage().data_ptr() in live
                if tensor.is_cuda or (self.include_cpu and is_live):  # (megatron cloned CPU views already)
                    host = self.shared.copy_of(tensor) if self.shared is not None else None
                    if host is None:
                        host = self._copy(tensor)
                    else:
                        self.shared_bytes += tensor.numel() * tensor.element_size()
                    tensor = host
                elif is_live:  # the loop would change it mid-write
                    tensor = tensor.clone()
                items.append((item, tensor))
            staged.append((path, name, (byte_items, items)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non_blocking copies have landed
        if self.shared is not None:
            self.shared.lend(written or (lambda: None))
        return staged

    def _copy(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        host = self.pool.take(nbytes)
        if host is None:
            self.overflow_bytes += nbytes
            return tensor.to("cpu", non_blocking=True) if tensor.is_cuda else tensor.clone()  # megatron's way
        # A tensor over exactly its bytes, not a view of the buffer: the writer serializes a
        # tensor's whole storage (a view's is the buffer: torch.distributed.checkpoint failed with
        # "unexpected pos" on a GPU). HostPool.take makes a storage of the slice's own size over
        # the same (pinned) memory; the buffer outlives every save that uses it.
        return host.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)


class PendingWrite:
    """One dist_checkpointing save of this rank between planning and finalize."""

    def __init__(self, request, background, live, staging=None):
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        self.request = request
        self.results = queue.Queue()  # (bucket index, write results or the exception)
        self.space = {}  # bucket index -> (bytes free, room for the file) seen after its write failed
        self.threads = []
        self.buckets = []
        self.stage_s = 0.0  # seconds of copying to host memory
        if request.async_fn is None:  # nothing of this rank's is written (all replicas elsewhere)
            return
        # megatron-core 0.16.1: async_fn = partial(write_preloaded_data_multiproc, transforms, use_msc),
        # args = [rank, write_buckets, results_queue]. We call its per-file writer ourselves.
        fn = request.async_fn
        if getattr(fn, "func", None) is not FileSystemWriterAsync.write_preloaded_data_multiproc:
            raise RuntimeError(
                f"unexpected megatron AsyncRequest {fn!r}: common/train/checkpoint_io.py is written "
                "against megatron-core 0.16.1's FileSystemWriterAsync"
            )
        self.transforms = fn.args[0]
        self.megatron_queue = request.async_fn_args[2]
        # GPU tensors are copied to host memory (HostStaging; megatron's own staging for a
        # synchronous save). megatron has already cloned CPU views (e.g. DDP-buffer params), but
        # a CPU tensor that is live state (torch Adam moments on a CPU run or after offloading)
        # would be written as the loop changes it: a background save copies those too.
        started = time.perf_counter()
        if background:  # host copies of everything the loop will change: see HostStaging
            preload = request.preload_fn
            if getattr(preload, "func", None) is not FileSystemWriterAsync.preload_tensors:
                raise RuntimeError(f"unexpected megatron preload function {preload!r} (common/train/checkpoint_io.py)")
            # preload's args: (write_buckets, non_blocking); the offload's buffers used are read until join()
            self.buckets = (staging or HostStaging()).stage(preload.args[0], live, written=self.join)
        else:
            self.buckets = request.preload_fn()  # a synchronous save: the loop waits for the files anyway
        self.stage_s = time.perf_counter() - started
        short = disk_space_shortfall(self.buckets)
        if short:  # the files cannot fit: nothing written, the failure reported at finish() on every rank
            for index in range(len(self.buckets)):
                self.results.put((index, OSError(errno.ENOSPC, short)))
            return
        # One thread per file (megatron's default: 2 per rank), for a synchronous save too (joined
        # at once). daemon: a program that dies mid-write is not kept alive by its checkpoint
        # (the step directory then stays *.tmp and is never published).
        for index, bucket in enumerate(self.buckets):
            self.threads.append(
                threading.Thread(target=self._write_file, args=(index, bucket), name=f"ckpt-write-{index}", daemon=True)
            )
            self.threads[-1].start()

    def _write_file(self, index, bucket, attempts=2):
        """megatron's per-file writer for one bucket, from the host copies; a failed file is
        written once more from scratch (the copies are unchanged, the file is reopened "wb"),
        unless the disk has no room for it. A full disk shows as torch's serializer error
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (the secondary
        error of its failed write; torch drops the errno): the reported failure says how much
        space is left, so that the cause is visible."""
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        for attempt in range(1, attempts + 1):
            results = queue.Queue()
            FileSystemWriterAsync.write_preloaded_data(
                self.transforms, index, bucket, results, _DoneCounter(), True
            )  # True: fsync
            outcome = results.get()
            if not isinstance(outcome[1], BaseException):
                break
            free = shutil.disk_usage(os.path.dirname(bucket[0])).free
            room = free >= bucket_bytes(bucket)
            if attempt == attempts or not room:  # what error() adds to the failure's message
                self.space[index] = (free, room)
                break
            print(
                f"[checkpoint] writing {bucket[0]} failed ({type(outcome[1]).__name__}: {outcome[1]}); "
                "writing it again",
                file=sys.stderr,
                flush=True,
            )
        self.results.put(outcome)

    def written(self):
        """True once this rank's files are written (or failed). Local, no communication."""
        return not any(t.is_alive() for t in self.threads)

    def join(self):
        for t in self.threads:
            t.join()

    def error(self):
        """None, or what went wrong writing this rank's files (after written())."""
        self.outcomes = dict(self.results.get_nowait() for _ in range(self.results.qsize()))
        by_message = {}  # one entry per distinct error: the files' (free, room), free measured per file
        for index, e in sorted(self.outcomes.items()):
            if isinstance(e, BaseException):
                by_message.setdefault(f"{type(e).__name__}: {e}", []).append(self.space.get(index))
        failed = [message + _space_note(spaces) for message, spaces in by_message.items()]
        if len(self.outcomes) != len(self.buckets):
            failed.append(f"{len(self.buckets) - len(self.outcomes)} file writer(s) gave no result")
        return "; ".join(failed) or None

    def finalize(self):
        """megatron's finalize: every rank's write results to rank 0, which writes .metadata,
        then metadata.json. Collective; after error() was None on every rank."""
        if self.buckets:
            self.megatron_queue.put(self.outcomes)  # what FileSystemWriterAsync.retrieve_write_results reads
        for fn in self.request.finalize_fns:
            fn()


def bucket_bytes(bucket):
    """Bytes one of megatron's write buckets (path, name, (byte items, tensor items)) puts on
    disk: its tensors' and byte items' sizes, plus torch.save's per-tensor overhead (~1 KB)."""
    _, _, (byte_items, tensor_items) = bucket
    return sum(t.numel() * t.element_size() + 1024 for _, t in tensor_items) + sum(
        len(data.getbuffer()) for _, data in byte_items
    )


def disk_space_shortfall(buckets):
    """None when the filesystem of the buckets' files has room for all of them (and 1%), else
    what is missing, as a message. This rank's files only: ranks sharing a disk each check
    their own share, so a shared disk can still fill up (then the write reports it)."""
    if not buckets:
        return None
    directory = os.path.dirname(buckets[0][0])
    need = sum(bucket_bytes(b) for b in buckets) * 1.01
    free = shutil.disk_usage(directory).free
    if need <= free:
        return None
    return (
        f"not enough disk space for this rank's checkpoint files: they need {_size(need)}, "
        f"{_size(free)} is free on the filesystem of {directory}. Free space there, keep fewer "
        "checkpoints (--keep-checkpoints) or write the run to a larger disk (--out)"
    )


def _space_note(spaces):
    """What a write error's message adds: how many files failed with it (when more than one),
    the least free space seen after those failures, and whether a file did not fit. One
    note per distinct error, so that two files failing alike read as one failure (the free
    space, measured after each, differs by what other writers wrote meanwhile)."""
    seen = [s for s in spaces if s is not None]
    if not seen:  # e.g. the shortfall found before writing, one message for the rank's files
        return ""
    count = f"{len(seen)} files" if len(seen) > 1 else ""
    full = ", less than a file needs: the disk is full" if not all(room for _, room in seen) else ""
    return f" ({count + '; ' if count else ''}{_size(min(free for free, _ in seen))} free on its filesystem{full})"


def _size(nbytes):
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


class _DoneCounter:
    """The count_queue megatron's per-file writer signals completion on (get + task_done);
    one per writer, already holding its item."""

    def get(self):
        return 0

    def task_done(self):
        pass


def start_save(sharded_state_dict, ckpt_dir, *, background, live=(), parallel_group=None, staging=None):
    """Plan the save (collective) and start writing this rank's files; returns a PendingWrite.

    parallel_group: the ranks holding replicas of the same data (the data-parallel group):
    megatron's FullyParallelSaveStrategyWrapper then spreads the writing of replicated tensors
    over them (else the first replica of each, mostly DP rank 0, writes everything).
    live: storage pointers of live training state (live_storages), copied when background.
    staging: the HostStaging that background copies go to (default: a fresh, unpinned one)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    in_process_results()
    strategy = get_default_save_sharded_strategy()  # torch_dist
    if parallel_group is not None and dist.get_world_size(parallel_group) > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, parallel_group)
    request = dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=strategy, async_sharded_save=True)
    return PendingWrite(request, background, set(live), staging)


def all_written(writes, block):
    """Whether every rank has written all its files of `writes`. Collective (one all_reduce).
    block: wait for this rank's writers first."""
    if block:
        for write in writes:
            write.join()
    done = torch.tensor([int(all(write.written() for write in writes))], device=device_for_collectives())
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item())


def finish(writes, what):
    """After all_written: raise on every rank if any rank's write failed, else finalize each
    write (rank 0 writes the metadata). Collective."""
    from torch.distributed.checkpoint.api import CheckpointException

    local = "; ".join(e for e in (write.error() for write in writes) if e) or None
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, local)
    if any(errors):
        raise CheckpointWriteError(
            f"writing {what} failed (the checkpoint before it is kept): "
            + "; ".join(f"rank {rank}: {error}" for rank, error in enumerate(errors) if error)
        )
    try:
        for write in writes:
            write.finalize()
    except CheckpointException as e:  # a BaseException: make it an ordinary error
        raise RuntimeError(f"finalizing {what} failed: {e}") from e


def in_process_results():
    """Before a dist_checkpointing save: megatron's write-results queue as a plain queue of this
    process instead of its default, a queue served by a spawned Manager process (see the module
    docstring). megatron creates its queue only where this module-level slot is empty."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
