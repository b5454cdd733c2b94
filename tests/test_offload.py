"""Offloading the training state to host memory and back (common/train/offload.py).

    .venv/bin/python -m pytest -q tests/test_offload.py

A tiny Qwen2 trains 3 Adam steps twice: straight, and with its whole training state (params,
grad buffers, Adam state, main params) offloaded and reloaded after every step. With fp32
and bf16 models, with megatron's distributed optimizer and without, in 1 process and under
torchrun DP=2 (the optimizer state sharded): the losses and final params must be bit-
identical, the tensors' storages must be empty while offloaded, the model's params must
survive the optimizer's offload (fp32: the main params are the model's own; the weight sync
runs between the two offloads), and the bytes moved must be what the dtypes say. The host
buffers are pieces of one pool sized by arithmetic before the first step, which creates
Adam's state: the planned bytes must be exactly the bytes the offloads keep, and no Adam
state may exist before that step. A plain frozen model (train_grpo.py's reference) gives the
same logits after a round trip. A background save of a policy and a critic (train_ppo.py)
stages through the offload's buffers; the next offload skips what it staged, the one after
waits for the (held) writer, and the checkpoint loads bit-exact. On a GPU the optimizer's
reload runs on a side stream during the next forward/backward, waited for before the
optimizer step, as in the scripts. On a CPU the "device" memory is host memory
(include_cpu=True); the same test on a GPU machine moves CUDA memory to pinned (registered)
host buffers and also checks that torch's allocated GPU memory dropped by the bytes moved
(tests/gpu/run_all.sh runs it).
"""

import json

import pytest

from tests.conftest import run_script, run_torchrun

WORKER = "tests/offload_worker.py"
# bytes per parameter moved: params + grad buffer (fp32, grad_reduce_in_fp32) + Adam (2 x fp32)
# + fp32 main params when the model is bf16 (for an fp32 model they are the params themselves)
BYTES_PER_PARAM = {"float32": 4 + 4 + 8, "bfloat16": 2 + 4 + 8 + 4}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.tiny_models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("offload") / "qwen2"
    save_tiny_hf_model("qwen2", str(path))
    return path


def parse(proc):
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def check(result, dp):
    reference = result.pop("reference")  # a plain frozen model (train_grpo.py's reference)
    check_colocation(result.pop("colocation"))
    check_shared_staging(result.pop("shared"))
    check_turns(result.pop("turns"))
    assert reference["equal"] and reference["left"] == 0 and reference["moved"] == reference["param_bytes"], reference
    assert set(result) == {"float32_distopt", "float32_ddp", "bfloat16_distopt", "bfloat16_ddp"}
    for name, r in result.items():
        assert r["losses"] == r["losses_offloaded"], name
        assert r["max_param_diff"] == 0.0, name
        assert all(left == 0 for left in r["left"]), (name, r["left"])  # storages empty while offloaded
        assert all(r["intact"]), name  # the optimizer's offload leaves the model's params alone (fp32)
        assert r["late_buffers"] == 0, name  # allocate() made every host buffer before the first step
        # ... sized by arithmetic before Adam had any state (none was created for it): the bytes
        # planned are exactly those kept in host memory by the offloads after real steps
        assert r["state_before_step"] == 0, name
        assert r["kept"] == [r["planned"]] * 3, (name, r["kept"], r["planned"])
        # one pool of exactly the (aligned) planned bytes, every buffer a piece of it, none beside it
        assert r["pool_exact"] and r["in_pool"] and r["pool_extra"] == 0, name
        assert r["pinned"] == ("registered" if on_gpu() else None), name
        # the optimizer's reload overlaps the next forward/backward on a GPU (a side stream; the
        # equal params above then show wait() kept the step from reading it early); on a CPU it waits
        assert r["overlapped"] == [on_gpu()] * 3, (name, r["overlapped"])
        dtype, kind = name.split("_")
        per_param = BYTES_PER_PARAM[dtype]
        if kind == "distopt":  # Adam state (+ the fp32 main params of a bf16 model) sharded over DP
            per_param = per_param - (8 + (4 if dtype == "bfloat16" else 0)) * (1 - 1 / dp)
        expected = r["numel"] * per_param
        # megatron pads its flat buffers (to 128-element multiples per bucket, per DP shard)
        assert expected <= r["moved"][-1] <= 1.05 * expected + 64 * 1024, (name, r["moved"], expected)
        if on_gpu():  # the GPU memory was released (torch's allocator; empty_cache gave it back)
            assert r["freed_gpu"][-1] >= 0.95 * r["moved"][-1], (name, r["freed_gpu"], r["moved"])


def check_colocation(seen):
    """The phases of common/train/colocation.Colocation (the scripts' choreography), all offloads on."""
    # frozen models wait in host memory from allocate() on: nothing is pinned before the host check
    assert seen["reference_at_start"] is True and seen["reference_after_allocate"] is False
    # allocate() creates no Adam state; the pool it pinned had room for what the first steps created
    assert seen["adam_after_allocate"] == 0 and seen["adam_tensors"] > 0
    assert seen["pool"]["nbytes"] == seen["host_bytes"] == seen["pool"]["used"] and seen["pool"]["extra"] == 0
    assert seen["pool_after_step"] == seen["pool_at_end"] == {"used": seen["host_bytes"], "extra": 0}
    assert seen["policy_at_sync"] is True and seen["adam_at_sync"] is False  # the sync reads a whole policy
    assert seen["synced"] > 0
    assert seen["calls_in_rollout"] == ["wake_weights", "update_weights", "wake_kv_cache"]
    assert (
        seen["policy_in_rollout"] is False and seen["critic_in_rollout"] is False and seen["adam_in_rollout"] is False
    )
    assert seen["calls_after"][-1] == "sleep" and seen["policy_after"] is True  # the engine asleep, the policy back
    assert seen["critic_after"] is False and seen["adam_after"] is False  # until reload_idle / reload_optimizers
    assert seen["reference_in_block"] is True and seen["reference_after_block"] is False
    assert seen["memory"] == ["start", "sync", "rollout"]
    assert seen["same"] == {"policy": True, "critic": True, "reference": True, "adam": True}
    assert seen["timed"] == ["offload_s", "reload_s", "sleep_s", "sync_s", "wake_s"]
    assert seen["overlapped"] == [on_gpu()] * 2 and seen["waited"] == [True, True]  # a side stream on a GPU only


def check_shared_staging(seen):
    """A background save staged through the offload's host buffers (common/train/offload.py
    SharedHostBuffers), policy and critic, its writer held across the next two steps."""
    assert seen["state_before_step"] == 0  # sizing the buffers created no Adam state
    # the staging's own buffer: no training tensor of its own (all are held by the offload), only
    # the slack for megatron's small tensors; nothing of the save went there or beside it
    assert seen["staging_reserve"] == 16 << 20
    # (on a GPU megatron's few small tensors of a DP=2 save land in the staging's own buffer: < 1 MB)
    assert seen["save"]["own"] < (1 << 20 if on_gpu() else 1) and seen["save"]["overflow"] == 0
    # step 2's offload copied no storage the save had staged (the buffers held the GPU's values),
    # and reloading from them gave back exactly the state that was saved. On a CPU megatron
    # clones the tensors that are views into a larger storage (the DDP param buffer, SwiGLU's
    # halves): those storages were not staged and are copied; on a GPU every storage was staged
    step2 = seen["step2"]
    # The save copies whole storages into the buffers (staged); its writer reads the bytes of this rank's
    # tensors there (shared). On a CPU they are the same; on a GPU a storage holds bytes this rank does
    # not write (at DP=2 the other rank writes its replicas of the parameters): shared <= staged
    staged = step2["kept"] - step2["copied"]
    assert 0 < seen["save"]["shared"] <= staged, (seen["save"], step2)
    assert seen["save"]["shared"] == staged or on_gpu(), (seen["save"], step2)
    assert step2["copied"] == 0 if on_gpu() else step2["copied"] < step2["kept"] / 2
    assert step2["reload_exact"]
    # step 3's offload wrote into the buffers, after waiting for the writer held on the last rank
    assert seen["step3"]["copied"] == seen["step3"]["kept"] == step2["kept"]
    assert seen["step3"]["waited"] in (True, None)
    # the checkpoint (written from the buffers while steps 2 and 3 changed the state) loads bit-exact
    assert seen["published"].endswith("step_000001") and seen["loaded_exact"] and seen["tensors"] > 0
    assert seen["pool"]["extra"] == 0


def check_turns(seen):
    """PPO's critic and actor updating in turn (common/train/colocation.py turn; train_ppo.py)."""
    assert seen["critic_turn"] == [True, True] and seen["actor_turn"] == [True, True]  # one state on the device
    assert seen["same_as_plain"] and seen["save_is_state"]  # bit-identical to the same steps without offload
    assert seen["save_parts"] == ["", "critic"] and seen["published"].endswith("step_000003")
    assert seen["loaded_exact"]
    if on_gpu():  # every storage of the actor's state was staged by its part of the save: moved out, not copied
        assert seen["actor_out_copied"] == 0


def on_gpu():
    import torch

    return torch.cuda.is_available()


def test_offload_roundtrip_one_process(hf_dir):
    proc = run_script(WORKER, hf_dir, timeout=600)
    check(parse(proc), dp=1)


def test_offload_roundtrip_dp2(hf_dir):
    import torch

    if on_gpu() and torch.cuda.device_count() < 2:
        pytest.skip("DP=2 on a GPU machine needs 2 GPUs")
    check(parse(run_torchrun(WORKER, 2, hf_dir)), dp=2)


def test_host_memory_check():
    """check_host_memory's rule (common/train/offload.py): a node's ranks together may pin at most the
    memory that node has available; the message names the node, the parts and the flags."""
    from common.run.host_memory import check_host_memory, host_memory_available, host_memory_problem
    from common.train.guard import UsageError

    gb = 10**9
    rank = ("gpu-node-1", {"offload buffers": 61 * gb, "checkpoint staging": 53 * gb}, 300 * gb)
    assert host_memory_problem([rank]) is None  # one rank: 114 GB of 300
    two_jobs = host_memory_problem([rank, rank, rank])  # three ranks on one node: 342 GB of 300
    assert two_jobs is not None and "gpu-node-1" in two_jobs and "342.0 GB" in two_jobs and "300.0 GB" in two_jobs
    assert "offload buffers 183.0 GB" in two_jobs and "checkpoint staging 159.0 GB" in two_jobs
    assert "--no-offload-optimizer" in two_jobs
    # per node: the same three ranks spread over three nodes fit; the least available memory counts
    assert host_memory_problem([rank, ("gpu-node-2", *rank[1:]), ("gpu-node-3", *rank[1:])]) is None
    assert host_memory_problem([rank, ("gpu-node-1", rank[1], 100 * gb)]) is not None  # 228 GB of min(300, 100)
    assert host_memory_problem([("laptop", {"offload buffers": 10**15}, None)]) is None  # unknown: no check

    available = host_memory_available()  # this Linux machine: MemAvailable (and a cgroup limit if any)
    assert available is not None and 0 < available < 10**15
    check_host_memory({"offload buffers": 0, "checkpoint staging": 0})  # a CPU run pins nothing: passes
    with pytest.raises(UsageError, match="would pin"):
        check_host_memory({"offload buffers": 10**15})


def test_host_memory_cgroup_limits(tmp_path):
    """The room under a cgroup memory limit (a Slurm job's --mem), v2 and v1 layouts: limit -
    used + page cache (given back on demand) - tmpfs files (not); no limit: None."""
    from common.run.host_memory import _cgroup_room

    def tree(proc_line, folder, files):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / folder / name).write_text(text)
        (tmp_path / "cgroup").write_text(proc_line)
        return _cgroup_room(str(tmp_path / "cgroup"), str(tmp_path))

    gb = 10**9
    v2 = dict(
        **{"memory.max": f"{100 * gb}\n", "memory.current": f"{70 * gb}\n"},
        **{"memory.stat": f"anon {50 * gb}\nfile {20 * gb}\nshmem {5 * gb}\n"},
    )
    assert tree("0::/slurm/job_1\n", "slurm/job_1", v2) == 45 * gb  # 100 - 70 + 20 - 5
    assert tree("0::/slurm/job_2\n", "slurm/job_2", dict(v2, **{"memory.max": "max\n"})) is None
    v1 = {
        "memory.limit_in_bytes": f"{64 * gb}\n",
        "memory.usage_in_bytes": f"{60 * gb}\n",
        "memory.stat": f"cache {30 * gb}\nrss {30 * gb}\nshmem 0\n",
    }
    assert tree("4:memory:/slurm/job_3\n0::/\n", "memory/slurm/job_3", v1) == 34 * gb
    assert (
        tree(
            "4:memory:/slurm/job_4\n",
            "memory/slurm/job_4",
            dict(v1, **{"memory.limit_in_bytes": "9223372036854771712\n"}),
        )
        is None
    )
    assert _cgroup_room(str(tmp_path / "missing"), str(tmp_path)) is None


def test_host_pool_carves_exact_aligned_pieces(capsys):
    """common/train/host_pool.py: one block of the summed sizes, each rounded up to 512 bytes;
    each piece a tensor of exactly its bytes at its 512-aligned offset in the block; a request the
    block has no room for gets None from take() and a counted separate allocation from extra()."""

    from common.train.host_pool import HostPool

    sizes = [1, 511, 512, 513, 1000]
    pool = HostPool(HostPool.size_for(sizes), pin=False)
    assert pool.nbytes == 512 + 512 + 512 + 1024 + 1024  # no power-of-two rounding of the sum (3584)
    pieces = [pool.take(n) for n in sizes]
    assert [p.untyped_storage().nbytes() for p in pieces] == sizes
    assert [p.data_ptr() - pool.block.data_ptr() for p in pieces] == [0, 512, 1024, 1536, 2560]
    assert all(pool.contains(p) for p in pieces) and pool.used == 2560 + 1000
    pool.block.zero_()
    pieces[1].fill_(7)  # the same memory as the block
    assert pool.block[512 : 512 + 511].eq(7).all() and pool.block.sum().item() == 7 * 511
    assert pool.take(1) is None  # full
    extra = [pool.extra(100), pool.extra(50)]
    assert [e.numel() for e in extra] == [100, 50] and not any(pool.contains(e) for e in extra)
    assert pool.extra_count == 2 and pool.extra_bytes == 150
    assert capsys.readouterr().err.count("has no room") == 1  # said once
    assert HostPool.size_for([]) == 0 and HostPool(0, pin=False).take(0).numel() == 0


def test_shared_buffers_stage_views_skip_and_wait():
    """common/train/offload.py SharedHostBuffers on plain tensors: a checkpoint's view of a held
    storage is staged as a host tensor over exactly its bytes inside that storage's buffer (the
    whole storage copied once); the next offload skips the staged storage, the one after copies
    it only after the save's writer is done; an optimizer step in between makes it copy."""
    import types

    import torch

    from common.train.offload import Offloader, SharedHostBuffers

    base = torch.arange(1000, dtype=torch.float32)  # e.g. DDP's flat param buffer
    other = torch.full((64,), 3.0, dtype=torch.bfloat16)  # a tensor the save does not touch
    param = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.AdamW([param])
    off = Offloader(lambda: [("base", base, True, base), ("other", other, True, other)], include_cpu=True)
    shared = SharedHostBuffers([off], optimizers=[types.SimpleNamespace(optimizer=adam)], include_cpu=True)
    off.allocate()
    assert off.host_bytes() == 4096 + 512 and off.pool.nbytes == 4608

    shared.begin()
    view = base[100:300].view(20, 10)
    host = shared.copy_of(view)
    assert torch.equal(host, view) and host.dtype == torch.float32 and host.shape == (20, 10)
    assert host.untyped_storage().nbytes() == 800 and host.data_ptr() == off._host["base"].data_ptr() + 400
    assert shared.copy_of(base.view(100, 10)[:, 0]) is None  # not contiguous: the staging's own buffer
    assert shared.copy_of(torch.zeros(3)) is None  # not held
    written = []
    shared.lend(lambda: written.append("joined"))

    off.offload()  # the save left base's values in its buffer: only `other` is copied
    assert (off.kept, off.copied) == (4000 + 128, 128) and written == []
    off.reload()
    assert torch.equal(base, torch.arange(1000, dtype=torch.float32)) and torch.equal(other, torch.full((64,), 3.0))
    base += 1  # the next step changes it
    off.offload()  # writes into the buffer the writer may still read: waits for it first
    assert (off.kept, off.copied) == (4128, 4128) and written == ["joined"]
    off.reload()
    assert torch.equal(base, torch.arange(1000, dtype=torch.float32) + 1)

    shared.begin()
    shared.copy_of(base)
    shared.lend(lambda: None)
    param.grad = torch.ones(4)
    adam.step()  # an optimizer step after the save: the buffers may no longer match
    off.offload()
    assert off.copied == 4128
    off.reload()
