"""Distributed setup: torchrun / Slurm / plain `python` -> torch.distributed + megatron parallel_state.

One call, `init_distributed(...)`, on every rank at start-up:
  - reads the launcher's environment: torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT), `srun python ...` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    MASTER_ADDR/PORT set by launch/slurm.sh), or nothing at all (a single plain
    `python train_grpo.py`: world size 1 on a free local port);
  - NCCL on GPUs (one GPU per rank, cuda:LOCAL_RANK), gloo on a CPU, where it also
    applies common/model/cpu_compat.py;
  - megatron parallel_state with the TP/PP/VPP/CP/EP sizes;
  - seeds python, numpy, torch and megatron's model-parallel RNG tracker.
"""

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp_size: int
    pp_size: int
    vpp_size: int | None
    cp_size: int
    ep_size: int
    etp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def master_process(self):
        return self.rank == 0

    def layout(self):
        """The parallel layout, for the run record (config.json)."""
        return dict(
            world_size=self.world_size,
            tp=self.tp_size,
            pp=self.pp_size,
            vpp=self.vpp_size,
            cp=self.cp_size,
            ep=self.ep_size,
            etp=self.etp_size,
            dp=self.dp_size,
            device=str(self.device),
        )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env():
    """(rank, world_size, local_rank) from torchrun, Slurm, or a plain single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also torchrun inside srun)
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun python ...
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                "Running under srun with several tasks but MASTER_ADDR is not set. Export "
                "MASTER_ADDR (the first node of $SLURM_JOB_NODELIST) and MASTER_PORT, as "
                "launch/slurm.sh does, or launch through torchrun."
            )
        env.setdefault("MASTER_PORT", "29500")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    # plain `python script.py`: a world of one, on a fresh local port (a MASTER_PORT inherited
    # from a parent process, e.g. a test runner that initialised its own group, may be taken)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    return 0, 1, 0


def init_distributed(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, seed=1234, timeout_minutes=60):
    """Initialise torch.distributed and megatron's parallel groups. All ranks call this.

    The data-parallel size is what is left: world_size / (tp * pp * cp). MoE layers fold
    the same ranks differently (megatron's "parallel folding"): their experts are split
    over ep * etp ranks of each pipeline stage, and expert-data-parallel is what is left.
    Returns a DistInfo with this rank's coordinates.
    """
    from megatron.core import parallel_state as mpu

    rank, world_size, local_rank = _launcher_env()
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
            f"{model_parallel}; launch a multiple of {model_parallel} processes or change "
            "--tp/--pp/--cp."
        )
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError("--vpp (virtual pipeline stages) needs --pp > 1")

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        if "OMP_NUM_THREADS" not in os.environ:
            # One CPU thread for torch's host ops, as torchrun gives each rank when it starts more
            # than one: a plain `python` launch would take every core, and the threads of its
            # small host ops (batch indexing, ...) then stalled the main thread that launches the
            # kernels. Qwen2-1.5B's training step on one H200: 1.00 s with 16 threads, 0.89 s
            # with one (docs/performance.md). OMP_NUM_THREADS=N overrides.
            torch.set_num_threads(1)
    else:
        from common.model import cpu_compat

        cpu_compat.apply()
        device, backend = torch.device("cpu"), "gloo"

    if not dist.is_initialized():
        # A world of one (plain python) keeps its store in memory: a TCP store would bind the
        # port _launcher_env picked seconds earlier, which another process may have taken by
        # then (EADDRINUSE seen on a GPU machine running tests side by side).
        store = dist.HashStore() if world_size == 1 and "RANK" not in os.environ else None
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
        )
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    set_seed(seed)
    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        tp_size=tp,
        pp_size=pp,
        vpp_size=vpp if vpp and vpp > 1 else None,
        cp_size=cp,
        ep_size=ep,
        etp_size=etp,
        dp_size=mpu.get_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
    )


def set_seed(seed):
    """Seed every RNG. The same seed on all ranks; megatron's tracker derives the
    per-TP-rank streams (dropout inside TP regions) from it."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed():
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_master():
    """Global rank 0 (before init_process_group: the launcher's RANK, so torchrun ranks stay quiet)."""
    return dist.get_rank() == 0 if dist.is_initialized() else int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs):
    """print on global rank 0 only."""
    if is_master():
        print(*args, **kwargs, flush=True)


def launcher_rank():
    """This process's global rank as its launcher set it, readable before init_distributed and
    without its side effects: torchrun's RANK, else srun's SLURM_PROCID (several tasks), else 0.
    For what must happen before the process group exists (quieting warnings on ranks != 0)."""
    return _launcher_rank_and_world()[0]


def launcher_world_size():
    """The world size init_distributed will have, read the same way (common/run/preflight.py checks
    the parallel layout against it before anything is built)."""
    return _launcher_rank_and_world()[1]


def _launcher_rank_and_world():
    """_launcher_env's reading of torchrun / srun / a plain process, without its side effects."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
