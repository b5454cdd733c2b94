"""The memory plan in words: the start-up summary and --dry-run's table (common/run/memory_check.py
decides, this prints)."""

from common.model.sizes import hf_parameter_count
from common.run import memory_plan as M


def format_summary(plan):
    """The few lines a GPU run prints at start-up (nothing for a CPU run)."""
    if not plan.on_gpu:
        return ""
    totals = ", ".join(f"{p} {plan.total(p) / M.GB:.1f}" for p in plan.phases)
    host = plan.host_stage.host
    node = f", {plan.ranks_per_node * host / M.GB:.1f} per node" if plan.ranks_per_node > 1 else ""
    return (
        f"memory plan, GB per GPU of {plan.device_bytes / M.GB:.1f}: {totals}; pinned host memory "
        f"{host / M.GB:.1f} per rank{node} (--dry-run prints every item)"
    )


def format_plan(plan, inputs):
    """--dry-run's table: items x phases per rank (device and pinned host), then the node."""
    spec = inputs["spec"]
    layout = " ".join(f"{k} {inputs[k]}" for k in ("tp", "pp", "cp", "ep", "etp") if inputs[k] > 1) or "tp 1"
    dp = inputs["world"] // (inputs["tp"] * inputs["pp"] * inputs["cp"])
    params = hf_parameter_count(spec)
    title = (
        f"memory plan: {spec.architecture} {_count(params)} parameters, world {inputs['world']} ({layout} dp "
        f"{dp})"
        + (f", rollout tp {inputs['rollout_tp']}" if inputs["engine"] == "vllm" else "")
        + f", {M.dtype_name(inputs['dtype_bytes'])}"
    )
    if plan.on_gpu:
        where = f"GB per rank, on GPUs of {plan.device_bytes / M.GB:.1f} GB"
        columns = list(plan.phases) + ["pinned host"]
    else:
        where = "GB of host memory per rank (a CPU run: no GPU found; --gpu-memory-gb plans for one)"
        columns = list(plan.phases)
    if len(plan.stages) > 1:
        where += f"; pipeline stage {plan.shown.stage} of {len(plan.stages)}, the fullest"
    width = max(len(i.name) for i in plan.shown.items) + 2
    lines = [title, where, " " * width + "".join(f"{c:>12}" for c in columns)]
    for item in plan.shown.items:
        values = [item.device.get(p, 0) for p in plan.phases] + ([item.host] if plan.on_gpu else [])
        if any(v >= 0.005 * M.GB for v in values):
            lines.append(f"{item.name:<{width}}" + "".join(_cell(v) for v in values))
    totals = [plan.total(p) for p in plan.phases] + ([plan.shown.host] if plan.on_gpu else [])
    lines.append(f"{'total':<{width}}" + "".join(f"{v / M.GB:>12.1f}" for v in totals))
    if plan.capacity:
        lines.append(f"{'of':<{width}}" + "".join(f"{plan.capacity / M.GB:>12.1f}" for _ in plan.phases))
    if plan.on_gpu:
        lines.append(
            "  the run's metrics: " + ", ".join(f"{m} ~ {p}" for p, m in M.PHASE_METRICS.items() if p in plan.phases)
        )
        lines.append("  (mem_sync_gb ends after the KV cache wakes: the larger of sync and rollout)")
    if plan.engine_share is not None:
        share, sequences = plan.engine_share * plan.device_bytes, plan.kv_tokens // max(plan.max_model_len, 1)
        lines.append(
            f"engine: --gpu-memory-utilization {plan.engine_share:.2f} = {share / M.GB:.1f} GB per GPU, KV cache "
            f"for {plan.kv_tokens} tokens ({sequences} sequences of {plan.max_model_len})"
        )
    lines += node_lines(plan)
    return "\n".join(lines)


def node_lines(plan):
    n = plan.ranks_per_node
    have = f"{plan.node_bytes / M.GB:.1f} GB available" if plan.node_bytes else "unknown available memory"
    if not plan.on_gpu:
        peak = max(plan.total(p) for p in plan.phases)
        return [f"node: {n} rank(s) x {peak / M.GB:.1f} GB = {n * peak / M.GB:.1f} GB of {have}"]
    stage = plan.host_stage
    pinned, save = stage.host, stage.host_save
    line = f"node: {n} rank(s) x {pinned / M.GB:.1f} GB pinned = {n * pinned / M.GB:.1f} GB"
    if stage is not plan.shown:
        line += f" (pipeline stage {stage.stage}'s, which pins the most)"
    if save:
        line += f", + {n * save / M.GB:.1f} GB at a save (the optimizer's gather)"
    line += f", + ~{n * M.PROCESS_HOST / M.GB:.0f} GB for the processes; of {have}"
    return [line]


def _cell(value):
    return f"{value / M.GB:>12.1f}" if value >= 0.005 * M.GB else f"{'-':>12}"


def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"
