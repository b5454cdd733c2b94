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

With rollout_gpus = R > 0 (--rollout-gpus, docs/async.md) the world splits in two: the first world - R ranks
train (torch.distributed's default group and megatron's groups are theirs alone, so megatron sees a world of
world - R), the last R only generate (their own default group, which vLLM's external launcher takes as its
world). Both groups come from the launcher's one store, under their own prefixes; the store itself, shared by
both sides, carries their messages (role_store(), common/rollout/remote.py).
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
    # --rollout-gpus: the ranks of the whole launch, and how many of them (the last) serve rollouts only
    global_rank: int = 0
    global_world_size: int = 1
    rollout_gpus: int = 0

    @property
    def serves_rollouts(self):
        """True on the --rollout-gpus ranks: they run the engine for the trainer's requests, nothing else."""
        return self.global_rank >= self.global_world_size - self.rollout_gpus

    @property
    def master_process(self):
        return self.rank == 0 and not self.serves_rollouts

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
            rollout_gpus=self.rollout_gpus,  # more ranks, the engine's alone (world_size: the trainer's)
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


# --rollout-gpus: (global rank, global world size, rollout GPUs, the launcher's store); None without
_SPLIT = None


def role_store():
    """The launcher's store both sides of a --rollout-gpus world reach (None in a world that is not split)."""
    return _SPLIT[3] if _SPLIT else None


def init_distributed(tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, seed=1234, timeout_minutes=60, rollout_gpus=0):
    """Initialise torch.distributed and megatron's parallel groups. All ranks call this.

    The data-parallel size is what is left: world_size / (tp * pp * cp). MoE layers fold
    the same ranks differently (megatron's "parallel folding"): their experts are split
    over ep * etp ranks of each pipeline stage, and expert-data-parallel is what is left.
    rollout_gpus: the last that many ranks serve rollouts only (module docstring); the others' world is
    what is left. Returns a DistInfo with this rank's coordinates (a rollout rank's: its place among them,
    no megatron groups).
    """
    global _SPLIT
    from megatron.core import parallel_state as mpu

    rank, world_size, local_rank = _launcher_env()
    global_rank, global_world = rank, world_size
    if rollout_gpus:
        if not 0 < rollout_gpus < world_size:
            raise ValueError(f"--rollout-gpus {rollout_gpus} must leave ranks to train: launch more than {world_size}")
        trainers = world_size - rollout_gpus
        rank, world_size = (rank, trainers) if rank < trainers else (rank - trainers, rollout_gpus)
    model_parallel = tp * pp * cp
    serves = global_rank >= global_world - rollout_gpus
    if world_size % model_parallel and not serves:
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
        if rollout_gpus:  # two default groups, one per side, on the launcher's one store
            launcher_store, _, _ = next(dist.rendezvous("env://", global_rank, global_world))
            _SPLIT = (global_rank, global_world, rollout_gpus, launcher_store)
            store = dist.PrefixStore("rollout/" if serves else "train/", launcher_store)
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
        )
        if serves:  # vLLM's external launcher reads its rank and world from these (env://)
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    split = dict(global_rank=global_rank, global_world_size=global_world, rollout_gpus=rollout_gpus)
    if serves:  # no megatron here: the engine's ranks
        random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
        return DistInfo(rank, world_size, local_rank, device, 1, 1, None, 1, 1, 1, 1, 0, 0, 0, **split)
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
        **split,
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
    if _SPLIT:
        return _SPLIT[0] == 0
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
    if _SPLIT:  # (a rollout rank's RANK and WORLD_SIZE are its group's now)
        return _SPLIT[0], _SPLIT[1]
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
