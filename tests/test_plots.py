"""Tests of common/run/plots.py (curves.png): which series each panel takes (seconds only in the
time panel, throughputs and memory in panels of their own units), the time stack's numbers,
outlier-robust y limits, and legends that fit the figure and cover no panel. A GPU run's keys
are drawn from a synthetic metrics history; a CPU run's in tests/test_train_grpo.py
(test_curves_of_a_run).

    .venv/bin/python -m pytest -q tests/test_plots.py
"""

import json
import math
import subprocess
import sys

import pytest

from common.run.plots import (
    is_seconds,
    is_throughput,
    panels,
    plot_curves,
    robust_limits,
    time_stack,
)
from tests.conftest import ROOT

# Every phase the training scripts time (Timer in common/train/offload.py, train_grpo.py, train_ppo.py).
PHASES = [
    "offload_s",
    "wake_s",
    "sync_s",
    "rollout_s",
    "reward_s",
    "reward_model_s",
    "eval_s",
    "sleep_s",
    "reload_s",
    "old_logprob_s",
    "ref_s",
    "values_s",
    "train_s",
    "save_s",
]


def gpu_history(steps=40):
    """What a GPU run of train_ppo.py logs (the keys of its metrics.jsonl), with made-up numbers:
    an explained variance far below the rest over the first 3 steps, a first step that compiles,
    a save every 10 steps, a validation every 10."""
    history = []
    for step in range(steps):
        times = {k: 1.0 + i for i, k in enumerate(PHASES) if k not in ("save_s", "eval_s")}
        if step % 10 == 9:
            times["save_s"] = 5.0
        if step % 10 == 0:
            times["eval_s"] = 2.0
        if step == 0:
            times["rollout_s"] += 300.0  # CUDA graphs captured, kernels compiled
        record = {
            "step": step,
            "reward_mean": 0.1 + step / 100,
            "kl": 0.001 * step,
            "entropy": 1.0 - step / 100,
            "policy_loss": 0.01 * (-1) ** step,
            "grad_norm": 0.5,
            "response_len_mean": 300.0 + step,
            "value_loss": 0.05,
            "explained_variance": [-900.0, -50.0, -4.0][step] if step < 3 else 0.5 + 0.01 * (step % 5),
            "lr": 1e-6,
            "save_total_sec": 40.0,
            **times,
            "step_s": sum(times.values()) + 1.0,
            "mem_sync_gb": 30.0,
            "mem_rollout_gb": 62.0,
            "mem_logprob_gb": 48.0,
            "mem_train_gb": 71.0,
            "gen_tokens_per_s": 20000.0 + step,
            "train_tokens_per_s_per_gpu": 5000.0,
            "train_mfu": 0.3,
        }
        if step % 10 == 0:
            record.update({"eval_accuracy": 0.2, "eval_pass@4": 0.4, "eval_maj@4": 0.3, "eval_response_len": 300.0})
        history.append(record)
    return history


def panel_axes(fig, title):
    """The axes whose (left) title is `title`."""
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == title]
    return ax


def time_panel_labels(fig):
    ax = panel_axes(fig, "seconds per step")
    return [c.get_label() for c in ax.collections], [ln.get_label() for ln in ax.get_lines() if ln.get_marker() != "^"]


def test_seconds_and_throughputs_by_name():
    for key in ["rollout_s", "step_s", "old_logprob_s", "wait_per_sync_s"]:
        assert is_seconds(key) and not is_throughput(key), key
    for key in ["gen_tokens_per_s", "train_tokens_per_s_per_gpu"]:
        assert is_throughput(key) and not is_seconds(key), key
    for key in ["save_total_sec", "mem_train_gb", "train_mfu", "eval_pass@4", "lr"]:
        assert not is_seconds(key) and not is_throughput(key), key


def test_panels_take_series_of_one_unit():
    by_title = {title: keys for title, _, keys in panels(gpu_history())}
    assert by_title["seconds per step"] == sorted(PHASES + ["step_s"])  # nothing but seconds
    assert by_title["tokens/s"] == ["gen_tokens_per_s", "train_tokens_per_s_per_gpu"]
    assert by_title["GPU memory, peak per phase (GB)"] == [
        "mem_logprob_gb",
        "mem_rollout_gb",
        "mem_sync_gb",
        "mem_train_gb",
    ]
    assert by_title["train_mfu (%)"] == ["train_mfu"]
    assert by_title["validation"] == ["eval_accuracy", "eval_maj@4", "eval_pass@4"]
    assert by_title["explained_variance"] == ["explained_variance"]


def test_time_stack_counts_missing_phases_as_zero():
    # save_s only on checkpoint steps (1 and 3), step_s missing on step 2, a step without times,
    # a throughput and a string that end like seconds do not
    history = [
        {"step": 0, "reward_mean": 0.1, "rollout_s": 1.0, "train_s": 2.0, "step_s": 3.5, "gen_tokens_per_s": 9e3},
        {"step": 1, "rollout_s": 1.5, "train_s": 2.5, "save_s": 4.0, "step_s": 8.5},
        {"step": 2, "rollout_s": 0.5, "train_s": 1.0},
        {"step": 3, "rollout_s": 1.0, "train_s": 2.0, "save_s": 3.0, "step_s": 6.5, "tag_s": "x"},
        {"step": 4, "reward_mean": 0.2},
    ]
    steps, phases, total = time_stack(history)
    assert steps == [0, 1, 2, 3]
    # in the order first logged (the stack's bottom first), save_s counted 0 where missing
    assert list(phases.items()) == [
        ("rollout_s", [1.0, 1.5, 0.5, 1.0]),
        ("train_s", [2.0, 2.5, 1.0, 2.0]),
        ("save_s", [0.0, 4.0, 0.0, 3.0]),
    ]
    assert "step_s" not in phases  # the total is drawn as a line, never stacked on its parts
    assert total[:2] == [3.5, 8.5] and math.isnan(total[2]) and total[3] == 6.5


def test_robust_limits_by_hand():
    # 10 points, one far out: the 10% and 90% quantiles, rounded inwards, are the 2nd and 9th sorted
    # values, 0.5 and 0.64: the bulk is within 3 x 0.14 of them, [0.5, 0.9], + 5% of 0.4 each side
    values = [-900.0, 0.5, 0.52, 0.54, 0.56, 0.58, 0.6, 0.62, 0.64, 0.9]
    assert robust_limits(values) == pytest.approx((0.48, 0.92))
    assert robust_limits(values[::-1]) == pytest.approx((-945.045, 45.945))  # last: kept, nothing cut
    # a reward that takes off late is the curve, not an outlier (the last 10%, at least 3, are kept;
    # the quantiles 0 and 0.01 would make 0.2 and 0.5 outliers)
    late = [0.0] * 17 + [0.01, 0.2, 0.5]
    assert robust_limits(late) == pytest.approx((-0.025, 0.525))
    # all equal but one: no bulk range, nothing is cut
    assert robust_limits([1.0] * 19 + [1.5] + [1.0] * 3) == pytest.approx((0.975, 1.525))
    # fewer than 10 points: nothing is cut; one point: a small span around it
    assert robust_limits([0.0, 100.0, 1.0]) == pytest.approx((-5.0, 105.0))
    assert robust_limits([2.0]) == pytest.approx((1.9, 2.1))
    assert robust_limits([math.nan, None]) is None


def test_gpu_run_plot(tmp_path):
    """A GPU run's keys drawn: the time panel stacks exactly the phases (its top at each step is
    their sum, step_s a line), the rest sit in panels of their units, outliers are marked on the
    edge, and no legend is cut off or covers a panel."""
    history = gpu_history()
    fig = plot_curves(history, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    stacked, lines = time_panel_labels(fig)
    assert sorted(stacked) == sorted(PHASES) and lines == ["step_s (total)"]
    ax = panel_axes(fig, "seconds per step")
    top_band = ax.collections[-1].get_paths()[0].vertices
    for step in (1, 9, 10):
        expected = sum(history[step][k] for k in PHASES if k in history[step])
        assert max(y for x, y in top_band if x == step) == pytest.approx(expected)
    # step 0's 300 s of compilation is off the scale: the other steps fill the panel, step 0 marked
    low, high = ax.get_ylim()
    assert low == 0 and max(r["step_s"] for r in history[1:]) < high < 100
    assert ax.get_title(loc="right") == f"1 off scale, max {history[0]['step_s']:.4g}"
    # throughputs in tokens/s, memory in GB from 0, MFU in percent
    tokens = panel_axes(fig, "tokens/s")
    assert sorted(ln.get_label() for ln in tokens.get_lines()) == ["gen_tokens_per_s", "train_tokens_per_s_per_gpu"]
    memory = panel_axes(fig, "GPU memory, peak per phase (GB)")
    assert memory.get_ylim()[0] == 0 and 71.0 < memory.get_ylim()[1] < 80
    (mfu,) = panel_axes(fig, "train_mfu (%)").get_lines()
    assert list(mfu.get_ydata()) == pytest.approx([30.0] * len(history))
    # explained variance: the bulk (0.5..0.54) fills the panel; steps 0-2 are triangles on its lower edge
    ev = panel_axes(fig, "explained_variance")
    low, high = ev.get_ylim()
    assert -0.1 < low < 0.5 and 0.54 < high < 0.6
    (marks,) = [ln for ln in ev.get_lines() if ln.get_marker() == "v"]
    assert list(marks.get_xdata()) == [0, 1, 2] and list(marks.get_ydata()) == [low] * 3
    assert ev.get_title(loc="right") == "3 off scale, min -900"
    assert_legends_fit(fig)


def assert_legends_fit(fig):
    """Every legend lies inside the figure and overlaps no axes (its own: the data area; the
    others: their titles and tick labels too)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [(a, a.get_legend()) for a in fig.axes if a.get_legend() is not None]
    assert len(legends) >= 2
    figure_box = fig.bbox
    for owner, legend in legends:
        box = legend.get_window_extent(renderer)
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1, legend
        assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1, legend
        for ax in fig.axes:
            if not ax.axison:  # the time panel's legend cell
                continue
            other = ax.get_window_extent(renderer) if ax is owner else ax.get_tightbbox(renderer, for_layout_only=True)
            assert not box.overlaps(other), (legend.get_title().get_text(), ax.get_title(loc="left"))


def test_redraw_from_the_command_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gpu_history(12)))
    out = subprocess.run(
        [sys.executable, "-m", "common.run.plots", tmp_path / "metrics.jsonl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_nothing_to_draw(tmp_path):
    assert plot_curves([{"step": 0, "tag": "x"}], tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "common.run.plots", tmp_path / "metrics.jsonl"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "holds no numbers to draw" in proc.stderr
