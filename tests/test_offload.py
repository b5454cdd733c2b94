"""Offloading the training state to host memory and back (common/train/offload.py).

    .venv/bin/python -m pytest -q tests/test_offload.py

A tiny Qwen2 trains 3 Adam steps twice: straight, and with its whole training state (params,
grad buffers, Adam state, main params) offloaded and reloaded after every step. With fp32
and bf16 models, with megatron's distributed optimizer and without, in 1 process and under
torchrun DP=2 (the optimizer state sharded): the losses and final params must be bit-
identical, the tensors' storages must be empty while offloaded, the model's params must
survive the optimizer's offload (fp32: the main params are the model's own; the weight sync
runs between the two offloads), and the bytes moved must be what the dtypes say. A plain
frozen model (train_grpo.py's reference) gives the same logits after a round trip. On a GPU
the optimizer's reload runs on a side stream during the next forward/backward, waited for
before the optimizer step, as in the scripts. On a CPU
the "device" memory is host memory (include_cpu=True); the same test on a GPU machine moves
CUDA memory to pinned host buffers and also checks that torch's allocated GPU memory dropped
by the bytes moved (tests/gpu/run_all.sh runs it). Host buffers are made once, by allocate()
before the first step (Adam's state created first, as the scripts do): no offload makes one.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_torchrun, script_env

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
    assert reference["equal"] and reference["left"] == 0 and reference["moved"] == reference["param_bytes"], reference
    assert set(result) == {"float32_distopt", "float32_ddp", "bfloat16_distopt", "bfloat16_ddp"}
    for name, r in result.items():
        assert r["losses"] == r["losses_offloaded"], name
        assert r["max_param_diff"] == 0.0, name
        assert all(left == 0 for left in r["left"]), (name, r["left"])  # storages empty while offloaded
        assert all(r["intact"]), name  # the optimizer's offload leaves the model's params alone (fp32)
        assert r["late_buffers"] == 0, name  # allocate() made every host buffer before the first step
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
    """The phases of common/offload.Colocation (the scripts' choreography), all offloads on."""
    assert seen["reference_at_start"] is False  # frozen models wait in host memory from the start
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


def on_gpu():
    import torch

    return torch.cuda.is_available()


def test_offload_roundtrip_one_process(hf_dir):
    proc = subprocess.run(
        [sys.executable, WORKER, str(hf_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=script_env()
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
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
