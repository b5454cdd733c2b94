"""Pinned host memory must fit the node: a check before a run pins its buffers.

    check_host_memory({"offload buffers": colo.host_bytes(),
                       "checkpoint staging": CheckpointWriter.host_bytes(models, colo.host_buffers)})

On GPUs a training script pins host memory once, at start-up: one pool per rank for the offload
of its training state during the rollout (common/train/offload.py, host_pool.py: exact sizes,
Adam's moments counted before its first step creates them), and a staging buffer for background
checkpoint saves (common/train/checkpoint_io.py HostStaging) holding only what the pool does not
(a save stages the offloaded state in the pool's buffers). Both numbers are arithmetic: nothing
is allocated to find them. Pinned memory cannot be swapped out, and a node that runs out of it
ends the job with SIGKILL and no message: two 7B jobs on one 4-GPU host with 503 GB did
(SIGKILL, nothing in the logs). So the ranks of each node add up what they are about to pin and
compare it with what the node has available, and a run that does not fit stops with a message
instead (preflight.UsageError: exit code 2, every rank alike).
"""

import os


def check_host_memory(parts):
    """Stop the run on every rank alike (preflight.UsageError: one message, exit 2) when the
    ranks of one node would pin more host memory than that node has available.

    parts: {what: bytes this rank is about to pin}. All ranks call this (an all_gather, which
    is also a barrier: every rank reads its node's free memory before any of them pins)."""
    import socket

    import torch.distributed as dist

    from common.train.guard import UsageError

    mine = (socket.gethostname(), {what: int(n) for what, n in parts.items()}, host_memory_available())
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    problem = host_memory_problem(every)
    if problem:
        raise UsageError(problem)


def host_memory_problem(ranks):
    """The message for the first node whose ranks need more pinned host memory than it has,
    else None. ranks: (host name, {what: bytes}, bytes available or None: unknown) per rank."""
    nodes = {}
    for host, parts, available in ranks:
        node = nodes.setdefault(host, dict(parts={}, available=available, ranks=0))
        node["ranks"] += 1
        for what, nbytes in parts.items():
            node["parts"][what] = node["parts"].get(what, 0) + nbytes
        if available is not None:  # the ranks read it at slightly different times: the least
            node["available"] = available if node["available"] is None else min(node["available"], available)
    for host, node in sorted(nodes.items()):
        need = sum(node["parts"].values())
        if node["available"] is not None and need > node["available"]:
            detail = ", ".join(f"{what} {nbytes / 1e9:.1f} GB" for what, nbytes in node["parts"].items() if nbytes)
            return (
                f"the {node['ranks']} rank(s) of this job on {host} would pin {need / 1e9:.1f} GB of host memory "
                f"({detail}), but {node['available'] / 1e9:.1f} GB are available there; pinned memory cannot "
                "be swapped, and running out kills the job without a message. Free host memory (another job on "
                "the node?), use fewer GPUs per node, or keep the state on the GPUs where their memory allows "
                "(--no-offload-optimizer, --no-offload-params)"
            )
    return None


def host_memory_available():
    """Bytes this process may still take: the kernel's MemAvailable, lowered to the room left
    under a cgroup memory limit (a Slurm job's --mem; v2 or v1, its page cache counted as
    free, as MemAvailable does); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    room = _cgroup_room()
    return min(found + ([room] if room is not None else [])) if found or room is not None else None


def _cgroup_room(proc_cgroup="/proc/self/cgroup", root="/sys/fs/cgroup"):
    """limit - used + reclaimable page cache of this process's memory cgroup, None without a
    limit (the paths: for tests)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    # (folder, limit file, usage file, page-cache key of memory.stat) for cgroup v2, then v1
    candidates = [
        (os.path.join(root, path.lstrip("/")), "memory.max", "memory.current", "file")
        for hid, controllers, path in lines
        if hid == "0" and controllers == ""
    ]
    candidates += [
        (os.path.join(root, "memory", path.lstrip("/")), "memory.limit_in_bytes", "memory.usage_in_bytes", "cache")
        for hid, controllers, path in lines
        if "memory" in controllers.split(",")
    ]
    for folder, limit_file, usage_file, cache_key in candidates:
        try:
            with open(os.path.join(folder, limit_file)) as f:
                limit = f.read().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # no limit (v1 writes a huge number)
                continue
            with open(os.path.join(folder, usage_file)) as f:
                used = int(f.read())
            with open(os.path.join(folder, "memory.stat")) as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            # page cache counts as used but is given back on demand; tmpfs files (shmem) are not
            return int(limit) - used + int(stat.get(cache_key, 0)) - int(stat.get("shmem", 0))
        except (OSError, ValueError):
            continue
    return None
