"""GPU: the pinned host pool of common/train/host_pool.py (cudaHostRegister of plain host memory).

    python -m pytest -q -s tests/gpu/test_host_pool_gpu.py

Skipped without CUDA. The CPU side (exact aligned pieces, the fallback count) is tests/test_offload.py.
  1. the block is registered (not torch's power-of-two pinned allocator) and exactly as large as
     asked; its pieces are pinned for torch (is_pinned), so non_blocking copies return before
     they are done; GPU -> piece -> GPU round trips of every dtype the trainer offloads are
     bit-exact, for pieces at 512-byte offsets;
  2. copies to and from the registered block run at least at 0.8x the speed of torch's own
     pinned memory (printed: GB/s and the seconds per 10 GB that registering took);
  3. the memory is unregistered when the pool goes (registering the same memory again succeeds).
Results go to $OUT/host_pool_gpu.json when OUT is set.
"""

import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def bandwidth(dst, src, repeat=5):
    """GB/s of dst.copy_(src, non_blocking=True), the best of `repeat`."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best / 1e9


def test_registered_pool_pins_exactly_and_copies_fast():
    from common.train.host_pool import HostPool

    gb = 2**30
    sizes = [gb + 3, 7 * 2**20 + 1, 4096]  # odd sizes: each piece starts 512-aligned, the sum is not a power of two
    started = time.perf_counter()
    pool = HostPool(HostPool.size_for(sizes), pin=True)
    register_s = time.perf_counter() - started
    assert pool.pinned == "registered" and pool.nbytes == HostPool.size_for(sizes) < 2 * gb
    pieces = [pool.take(n) for n in sizes]
    assert all(p.is_pinned() for p in pieces) and pool.block.is_pinned()
    assert [p.data_ptr() % 512 for p in pieces] == [0, 0, 0]

    # bit-exact round trips of the dtypes offloaded (bf16 params, fp32 main params and moments)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for piece in pieces:
            n = piece.numel() * 8 // torch.finfo(dtype).bits
            device = torch.randn(n, device="cuda").to(dtype)
            host = piece[: n * device.element_size()].view(dtype)
            host.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            back = torch.empty_like(device)
            back.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, device), (dtype, piece.numel())

    # non_blocking D2H into the pool is asynchronous (the call returns long before 1 GB has moved)
    device = torch.ones(gb, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pieces[0][:gb].copy_(device, non_blocking=True)
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    whole = time.perf_counter() - t0
    assert issued < whole / 4, (issued, whole)

    reference = torch.empty(gb, dtype=torch.uint8, pin_memory=True)  # torch's own pinned memory
    speeds = {
        "d2h_pool": bandwidth(pieces[0][:gb], device),
        "d2h_torch": bandwidth(reference, device),
        "h2d_pool": bandwidth(device, pieces[0][:gb]),
        "h2d_torch": bandwidth(device, reference),
    }
    result = dict(register_s_per_10gb=register_s * 10 * gb / pool.nbytes, **{k: round(v, 2) for k, v in speeds.items()})
    print(result)
    assert speeds["d2h_pool"] >= 0.8 * speeds["d2h_torch"] and speeds["h2d_pool"] >= 0.8 * speeds["h2d_torch"]

    # unregistered with the pool: the same memory registers again
    owner = pool.block
    del pool, pieces
    gc.collect()
    error = torch.cuda.cudart().cudaHostRegister(owner.data_ptr(), owner.numel(), 0)
    assert int(error) == 0, error
    assert int(torch.cuda.cudart().cudaHostUnregister(owner.data_ptr())) == 0
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_pool_gpu.json"), "w") as f:
            json.dump(result, f)
