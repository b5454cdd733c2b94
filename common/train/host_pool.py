"""Host memory of one rank's training state off the GPU: one block, sized up front, carved into exact pieces.

    pool = HostPool(HostPool.size_for(sizes), pin=torch.cuda.is_available())   # once, at start-up
    host = pool.take(nbytes)      # a uint8 tensor over exactly nbytes of the block (None once it is full)
    host = pool.extra(nbytes)     # a separate allocation beyond the block: counted, warned about once

Why one block: the offload (common/train/offload.py) keeps a host copy of every storage it moves,
and the distributed optimizer's fp32 main params and Adam moments are one tensor per parameter.
Pinned one by one (torch.empty(n, pin_memory=True)), each takes a block of torch's caching host
allocator, which rounds every request up to a power of two: up to 2x the bytes, ~85 GB pinned per
rank for a 7B model at TP=2 x DP=2 whose state off the GPU is ~38 GB. Here the sizes are added up
once (exact, each piece aligned to ALIGN bytes) and the sum is pinned in one piece.

How it is pinned: ordinary (pageable) host memory of exactly that size, registered with CUDA
(cudaHostRegister: page-locked and mapped for the GPU's DMA, as cudaHostAlloc's memory is; torch
then treats it as pinned: is_pinned() is True and non_blocking copies are asynchronous). The
alternative, slabs of exactly a power of two from torch's allocator, would still round the last
slab up or need many slabs; registering costs the seconds per 10 GB that pinning costs any way
(the pages are faulted in and locked once), and nothing is rounded. Measured on an H100 (torch
2.11, one 1 GB piece; tests/gpu/test_host_pool_gpu.py): copies at 55.0 GB/s device-to-host and
54.5 host-to-device, as with torch's own pinned memory (54.7 / 54.6; pageable: 13.7 / 8.9);
registering took 4-6 s per 10 GB. Should registering fail
(a driver or container that refuses it), the block is taken from torch's pinned allocator
instead (rounded up, said once). Without a GPU the block is plain memory (tests).

Each piece is made with torch.from_numpy over its slice of the block, so it is a tensor with a
storage of exactly its own bytes (a checkpoint writer serializes a tensor's whole storage:
common/train/checkpoint_io.py HostStaging).
"""

import sys
import weakref

import torch


class HostPool:
    ALIGN = 512  # bytes between piece starts: every dtype's alignment, and DMA-friendly copy starts

    def __init__(self, nbytes, pin, align=ALIGN):
        self.align = align
        self.nbytes = int(nbytes)
        self.used = 0  # bytes handed out by take(), alignment included
        self.extra_bytes = 0  # bytes extra() allocated beyond the block
        self.extra_count = 0
        self.pinned = "registered" if pin and self.nbytes else None  # how: registered / torch / None
        self._warned = False
        self._pin = pin
        # owns the memory as long as the pool lives; `align` more bytes, so that piece starts are
        # aligned in memory, not only within the block (malloc gives 64-byte aligned blocks)
        self._owner = torch.empty(self.nbytes + (align if self.nbytes else 0), dtype=torch.uint8)
        if self.pinned and not _register(self._owner):
            print(
                f"[host memory] could not register {self.nbytes / 1e9:.2f} GB of host memory with CUDA; "
                "taking it from torch's pinned allocator instead (it rounds up to a power of two)",
                file=sys.stderr,
                flush=True,
            )
            self._owner = torch.empty(self.nbytes + align, dtype=torch.uint8, pin_memory=True)
            self.pinned = "torch"
        self._base = -self._owner.data_ptr() % align  # the first aligned byte of the block
        self._array = self._owner.numpy()  # the same memory, for slices with storages of their own
        if self.pinned == "registered":  # unregistered when the pool goes, before its memory is freed
            weakref.finalize(self, _unregister, self._owner).atexit = False  # at exit the process frees it all

    @staticmethod
    def size_for(sizes, align=ALIGN):
        """Bytes of a pool that take() can carve pieces of these sizes from, in any order."""
        return sum(_round_up(int(n), align) for n in sizes)

    @property
    def block(self):
        """The whole block, a uint8 tensor of nbytes starting at an aligned address (pinned when the pool is)."""
        return self._owner[self._base : self._base + self.nbytes]

    def contains(self, tensor):
        """Whether tensor's memory lies inside the block."""
        start, ptr = self._owner.data_ptr() + self._base, tensor.data_ptr()
        return self.nbytes > 0 and start <= ptr < start + self.nbytes

    def take(self, nbytes):
        """The next nbytes of the block as a uint8 tensor of its own storage, or None when they do not fit."""
        start = _round_up(self.used, self.align)  # within the aligned block
        if start + nbytes > self.nbytes:
            return None
        self.used = start + nbytes
        offset = self._base + start
        return torch.from_numpy(self._array[offset : offset + nbytes])

    def extra(self, nbytes):
        """nbytes allocated on their own (pinned like the block), for what the block has no room for:
        counted, and said once per pool, since it means the sizes given at start-up were short."""
        self.extra_bytes += nbytes
        self.extra_count += 1
        if not self._warned:
            self._warned = True
            print(
                f"[host memory] the host buffer pool ({self.nbytes / 1e9:.2f} GB) has no room for "
                f"{nbytes / 1e6:.1f} MB: allocated separately (further ones too, not said again). "
                "More host memory is in use than the start-up check counted",
                file=sys.stderr,
                flush=True,
            )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=bool(self._pin))


def _round_up(n, align):
    return -(-n // align) * align


def _register(owner):
    """cudaHostRegister the tensor's memory (flags 0: page-locked, and with unified addressing mapped
    and portable). torch's binding returns the cudaError_t (0: success)."""
    error = torch.cuda.cudart().cudaHostRegister(owner.data_ptr(), owner.numel(), 0)
    return int(error) == 0


def _unregister(owner):
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no copy may still be reading or writing the memory
    torch.cuda.cudart().cudaHostUnregister(owner.data_ptr())
