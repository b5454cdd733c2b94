"""curves.png: the metrics of metrics.jsonl in panels, each panel in one unit.

    plot_curves(history, "runs/grpo-embedded/curves.png")      # history: metrics.jsonl's records
    python -m common.run.plots runs/grpo-embedded/metrics.jsonl  # redraw a run's curves.png (any time)

The panels, each drawn when the run logged its keys:
  one per CURVES key           reward_mean, kl, entropy, ... (a number per step)
  validation                   eval_accuracy, eval_pass@k, eval_maj@k: fractions, at the eval steps
  tokens/s                     throughputs: keys ending in `_per_s` or holding `_per_s_`
  train_mfu (%)                model FLOPs utilisation (GPU runs)
  GPU memory (GB)              mem_*_gb: the peak of each phase
  seconds per step             the phases stacked, step_s (the whole step) a line over them

Naming convention the panels rely on: a key ending in `_s` is seconds spent in one phase of
the step (rollout_s, sync_s, train_s, ...) and is stacked, unless it ends in `_per_s` (a
throughput: gen_tokens_per_s). Seconds that are not a phase of the step (a background save)
end in `_sec`.

Scales are robust: a panel's y limits hold the bulk of its points (robust_limits), so that a
few extreme ones (PPO's explained variance over the first steps, a step that compiles or
saves) do not flatten the rest. Those points are drawn as red triangles on the panel's edge,
and the panel's title says how many there are and the most extreme value.
"""

import math
import os
import re

# Curves with a panel each, when present in the logged metrics.
CURVES = [
    "reward_mean",
    "kl",
    "entropy",
    "policy_loss",
    "grad_norm",
    "response_len_mean",
    "value_loss",  # these two: train_ppo.py
    "explained_variance",
]
TOTAL_TIME_KEY = "step_s"  # the whole step: a line over the stacked phases, never stacked itself
EVAL_KEY = re.compile(r"eval_(accuracy|pass@\d+|maj@\d+)$")  # common/rollout/evaluate.py's fractions
MEMORY_KEY = re.compile(r"mem_\w+_gb$")  # common/train/colocation.py's PhaseMemory
MFU_KEY = "train_mfu"  # common/model/flops.py

CELL_W, CELL_H = 4.5, 3.2  # inches of one panel, its title and tick labels included
LEGEND_LINE_H = 0.2  # inches per legend row at fontsize "small"
DPI = 80


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_throughput(key):
    """A rate per second: gen_tokens_per_s, train_tokens_per_s_per_gpu."""
    return re.search(r"_per_s(_|$)", key) is not None


def is_seconds(key):
    """Seconds of one phase of the step (rollout_s, sync_s, ...), or step_s: never a throughput."""
    return key.endswith("_s") and not is_throughput(key)


# ---- what each panel draws ---------------------------------------------------------------


def time_stack(history):
    """What the "seconds per step" panel draws: (steps, phases, total).

    steps: every logged step that timed anything; phases: {key: [seconds at each step]} for
    every seconds key (is_seconds) but step_s, a phase a step did not log counted 0 there
    (save_s exists only on checkpoint steps, and must not hide the other steps); total:
    step_s at each step (nan where absent), drawn as a line, so the gap above the stack is the
    step's untimed work."""
    # in the order the run first logged them (its phases' order in a step): the stack's bottom is the first
    phase_keys = list(
        dict.fromkeys(
            k for r in history for k, v in r.items() if is_seconds(k) and k != TOTAL_TIME_KEY and _is_number(v)
        )
    )
    rows = [r for r in history if any(_is_number(r.get(k)) for k in (*phase_keys, TOTAL_TIME_KEY))]
    steps = [r["step"] for r in rows]
    phases = {k: [r[k] if _is_number(r.get(k)) else 0.0 for r in rows] for k in phase_keys}
    total = [r[TOTAL_TIME_KEY] if _is_number(r.get(TOTAL_TIME_KEY)) else math.nan for r in rows]
    return steps, phases, total


def panels(history):
    """The panels of curves.png, in order: a list of (title, kind, keys); kind is "line" (one
    curve), "lines" (several curves of one unit, with a legend) or "time" (time_stack)."""
    keys = sorted({k for r in history for k, v in r.items() if k != "step" and _is_number(v)})
    out = [(key, "line", [key]) for key in CURVES if key in keys]
    groups = [
        ("validation", [k for k in keys if EVAL_KEY.match(k)]),
        ("tokens/s", [k for k in keys if is_throughput(k)]),
        ("train_mfu (%)", [k for k in keys if k == MFU_KEY]),
        ("GPU memory, peak per phase (GB)", [k for k in keys if MEMORY_KEY.match(k)]),
    ]
    out += [(title, "lines" if len(group) > 1 else "line", group) for title, group in groups if group]
    if any(is_seconds(k) for k in keys):
        out.append(("seconds per step", "time", sorted(k for k in keys if is_seconds(k))))
    return out


def robust_limits(values, *, spread=3.0, keep_last=0.1, margin=0.05, min_points=10):
    """(low, high) y limits that hold the bulk of `values`: the points within `spread` times
    the 10-90% quantile range beyond that range, plus `margin` of the span on each side. The
    quantiles are rounded inwards (the second value of 10, not a mix of the first two), so one
    extreme value of a short run does not move them.

    A curve that takes off late is not an outlier: the last `keep_last` of the points (at least
    3) are always inside, as are all points when fewer than `min_points`, when the quantile
    range is empty (most points equal: a reward still 0) or when more than a fifth of the
    points would be outside (no bulk to speak of). None when no value is finite."""
    finite = [v for v in values if _is_number(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    if len(finite) >= min_points:
        ordered = sorted(finite)
        last = len(ordered) - 1
        q_low, q_high = ordered[math.ceil(0.1 * last)], ordered[math.floor(0.9 * last)]
        reach = spread * (q_high - q_low)
        split = len(finite) - max(3, math.ceil(keep_last * len(finite)))
        head, tail = finite[:split], finite[split:]
        kept = [v for v in head if q_low - reach <= v <= q_high + reach] + tail
        if reach > 0 and len(head) + len(tail) - len(kept) <= len(finite) / 5:
            low, high = min(kept), max(kept)
    pad = margin * (high - low) if high > low else max(abs(high) * margin, 1e-3)
    return low - pad, high + pad


def _mark_off_scale(ax, xs, ys, limits, title, color="tab:red"):
    """Points outside limits as triangles on the panel's edge; the title says how many and the extreme."""
    low, high = limits
    above = [(x, y) for x, y in zip(xs, ys) if _is_number(y) and y > high]
    below = [(x, y) for x, y in zip(xs, ys) if _is_number(y) and y < low]
    notes = []
    for points, edge, marker, extreme, word in ((above, high, "^", max, "max"), (below, low, "v", min, "min")):
        if points:
            ax.plot([x for x, _ in points], [edge] * len(points), marker, color=color, clip_on=False, zorder=5)
            notes.append(f"{len(points)} off scale, {word} {extreme(y for _, y in points):.4g}")
    ax.set_title(title, loc="left", fontsize="medium")
    if notes:
        ax.set_title("; ".join(notes), loc="right", fontsize="x-small", color=color)


def _series(history, key, scale=1.0):
    points = [(r["step"], r[key] * scale) for r in history if _is_number(r.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


# ---- the figure ----------------------------------------------------------------------------


def _legend_columns(count, height_in):
    """Columns a legend of `count` entries needs to fit `height_in` inches."""
    rows = max(1, int((height_in - 0.45) / LEGEND_LINE_H))  # minus its title and frame
    return math.ceil(count / rows)


def plot_curves(history, path=None):
    """Draw history (metrics.jsonl's records, {"step": s, key: value, ...}) into path (a PNG,
    written whole or not at all; None: not written). Returns the matplotlib Figure, None when
    there is nothing to draw."""
    drawn = panels(history)
    if not drawn:
        return None
    # Figure + Agg canvas directly, not pyplot: no global backend switch, no GUI, no leaks.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Cells of CELL_W x CELL_H, 3 a row; the time panel takes two cells and its legend a third
    # cell beside it, so the legend covers no data and always fits the figure.
    cells = sum(3 if kind == "time" else 1 for _, kind, _ in drawn)
    cols = min(3, cells)
    placed, row, col = [], 0, 0
    for panel in drawn:
        width = 2 if panel[1] == "time" else 1
        if col + width + (panel[1] == "time") > cols:
            row, col = row + 1, 0
        placed.append((panel, row, col, width))
        col += width
    rows = row + 1
    fig_w, fig_h = CELL_W * cols, CELL_H * rows
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    FigureCanvasAgg(fig)
    left, right, top, bottom = 0.75, 0.2, 0.35, 0.5  # inches in a cell: tick labels, title, "step"

    def axes_at(row, col, width, legend_rows=0):
        """The axes of a panel in its cells, leaving legend_rows legend lines below it."""
        x0, y0 = col * CELL_W + left, (rows - row - 1) * CELL_H + bottom + legend_rows * LEGEND_LINE_H
        w, h = width * CELL_W - left - right, CELL_H - top - bottom - legend_rows * LEGEND_LINE_H
        return fig.add_axes([x0 / fig_w, y0 / fig_h, w / fig_w, h / fig_h]), h

    for (title, kind, keys), row, col, width in placed:
        if kind == "time":
            _draw_time(axes_at(row, col, width)[0], axes_at(row, col + width, 1)[0], history, colormaps)
            continue
        legend_rows = math.ceil(len(keys) / 2) + 1 if kind == "lines" else 0  # + its frame
        ax, height = axes_at(row, col, width, legend_rows)
        scale = 100.0 if keys == [MFU_KEY] else 1.0  # MFU in percent
        curves = [_series(history, key, scale) for key in keys]
        for key, (xs, ys) in zip(keys, curves):
            # sparse curves (validation: every N steps) get markers, or a lone point would not show
            ax.plot(xs, ys, marker="o" if len(xs) < 30 or title == "validation" else None, markersize=3, label=key)
        all_y = [y for _, ys in curves for y in ys]
        if title == "validation":
            limits = (-0.03, 1.03)  # fractions: the whole range, so that two runs' panels compare
        elif title.startswith("GPU memory"):
            limits = (0.0, max(all_y) * 1.08 or 1.0)  # from 0: what is left of the GPU shows
        else:  # each curve's bulk
            each = [robust_limits(ys) for _, ys in curves if ys]
            limits = (min(lo for lo, _ in each), max(hi for _, hi in each))
        ax.set_ylim(*limits)
        _mark_off_scale(ax, [x for xs, _ in curves for x in xs], all_y, limits, title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if kind == "lines":  # below the axes, under the "step" label: covers no data
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -bottom / height), ncol=2, fontsize="small")
    if path is not None:
        # Write then rename: a reader (or an image viewer) never sees a half-written PNG.
        tmp = os.path.join(os.path.dirname(os.path.abspath(path)), "." + os.path.basename(path) + ".tmp")
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
    return fig


def _draw_time(ax, legend_ax, history, colormaps):
    """The "seconds per step" panel: the phases stacked, step_s as a line, the legend beside."""
    steps, phases, total = time_stack(history)
    if phases:
        cmap = colormaps["tab10" if len(phases) <= 10 else "tab20"]  # tab10 repeats its colours past 10
        ax.stackplot(steps, *phases.values(), labels=list(phases), colors=[cmap(i) for i in range(len(phases))])
    if any(not math.isnan(t) for t in total):
        ax.plot(steps, total, color="black", linewidth=1.2, label=f"{TOTAL_TIME_KEY} (total)")
    # the top of each step: the stack or the step's total, whichever is higher
    stacked = [sum(column) for column in zip(*phases.values())] or [0.0] * len(steps)
    tops = [t if t > s else s for s, t in zip(stacked, total)]  # (a nan total: the stack)
    limits = (0.0, robust_limits(tops, margin=0.0)[1] * 1.05)  # from 0: the phases' shares show
    ax.set_ylim(*limits)
    _mark_off_scale(ax, steps, tops, limits, "seconds per step")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend_ax.axis("off")
    legend_ax.legend(
        handles[::-1],  # reversed: top of the list = top of the stack
        labels[::-1],
        loc="upper left",
        bbox_to_anchor=(-0.1, 1.0),
        fontsize="small",
        title="seconds per step",
        ncol=_legend_columns(len(labels), CELL_H - 0.2),
    )


def main(argv=None):
    import argparse
    import json

    p = argparse.ArgumentParser(description="Redraw a run's curves.png from its metrics.jsonl.")
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--out", default=None, help="the PNG to write (default: curves.png beside metrics.jsonl)")
    args = p.parse_args(argv)
    with open(args.metrics) as f:
        history = [json.loads(line) for line in f if line.strip()]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "curves.png")
    if plot_curves(history, out) is None:
        raise SystemExit(f"{args.metrics} holds no numbers to draw")
    print(out)


if __name__ == "__main__":
    main()
