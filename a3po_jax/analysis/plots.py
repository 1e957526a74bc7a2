"""Plots of a set of runs: reward curves, diagnostics, the mismatch dashboard, phase times,
staleness histograms and a sweep plot.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas, matplotlib).

Every function returns a ``matplotlib.figure.Figure`` built directly (no pyplot state, no
backend switch), so the same functions draw into files (``fig.savefig``) and inline in a
notebook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from a3po_jax.analysis.runs import (
    EFFECTIVE_STALENESS,
    PHASES,
    REWARD,
    Run,
    config_differences,
    mean_over_steps,
    run_label,
    short_key,
    staleness_distribution,
)
from a3po_jax.analysis.tables import pivot


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 3.6):
    """A constrained-layout Figure and its [nrows, ncols] axes, each panel width x height."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def moving_average(values: pd.Series, window: int) -> np.ndarray:
    """Trailing moving average (window 1 = raw); the first points average what exists."""
    return values.rolling(max(window, 1), min_periods=1).mean().to_numpy()


def run_labels(runs: Sequence[Run]) -> list[str]:
    """One legend label per run, from the config fields that differ between the runs."""
    keys = config_differences(runs)
    return [run_label(r, keys) for r in runs]


def plot_curves(
    runs: Sequence[Run],
    key: str,
    *,
    x: str = "step",
    smooth: int = 1,
    ax: Any = None,
    labels: Sequence[str] | None = None,
):
    """One line per run of a scalar metric vs ``x`` ("step" or "wall": seconds since the
    end of the first step). Returns the Figure (a new one unless ``ax`` is given)."""
    if x not in ("step", "wall"):
        raise ValueError(f"plot_curves: x must be 'step' or 'wall', got {x!r}")
    fig = None
    if ax is None:
        fig, axes = new_figure()
        ax = axes[0, 0]
    labels = list(labels) if labels is not None else run_labels(runs)
    if len(runs) > 10:
        # The default cycle repeats after 10 colours; a sweep of 15 would share colours.
        from matplotlib import colormaps

        ax.set_prop_cycle(color=colormaps["tab20"].colors)
    for run, label in zip(runs, labels, strict=True):
        values = run.series(key)
        if values.empty:
            continue
        if x == "wall":
            clock = pd.Series(run.elapsed_s(), index=run.frame.index)
            xs = clock.loc[values.index].to_numpy()
        else:
            xs = values.index.to_numpy()
        ax.plot(xs, moving_average(values, smooth), label=label, linewidth=1.5)
    ax.set_xlabel("step" if x == "step" else "wall-clock s (from end of step 1)")
    title = key if smooth <= 1 else f"{key} (moving avg {smooth})"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return fig if fig is not None else ax.figure


def plot_reward(runs: Sequence[Run], *, metric: str = REWARD, smooth: int = 5):
    """Reward vs step (left) and vs wall-clock time (right)."""
    fig, axes = new_figure(1, 2)
    plot_curves(runs, metric, x="step", smooth=smooth, ax=axes[0, 0])
    plot_curves(runs, metric, x="wall", smooth=smooth, ax=axes[0, 1])
    add_legend(fig, axes[0, 1], len(runs))
    return fig


def plot_diagnostics(runs: Sequence[Run], *, smooth: int = 3):
    """Importance weights (``is/weight_max``, ``is/weight_mean``), ``loss/clipfrac`` and
    ``staleness/mean`` vs step, one panel each."""
    keys = ("is/weight_max", "is/weight_mean", "loss/clipfrac", "staleness/mean")
    fig, axes = new_figure(2, 2, width=5.2, height=3.2)
    for ax, key in zip(axes.flat, keys, strict=True):
        plot_curves(runs, key, x="step", smooth=smooth, ax=ax)
    add_legend(fig, axes[0, 1], len(runs))
    return fig


# The train-inference mismatch dashboard (``a3po_jax.core.train_step.mismatch_stats``).
MISMATCH_KL = "mismatch/k3_kl_fresh"
MISMATCH_FRESH = "mismatch/fresh_tokens"
MISMATCH_IW = ("mismatch/iw_p01", "mismatch/iw_p50", "mismatch/iw_p99")
MISMATCH_IW_TAILS = ("mismatch/iw_min", "mismatch/iw_max")
MISMATCH_FRACS = {
    "tokens": ("mismatch/masked_frac", "mismatch/truncated_frac"),
    "sequences": ("mismatch/seq_masked_frac", "mismatch/seq_truncated_frac"),
}


def has_mismatch(runs: Sequence[Run]) -> bool:
    """Whether any run logged the ``mismatch/*`` metrics (older runs did not)."""
    return any(not r.series(MISMATCH_KL).empty for r in runs)


def plot_mismatch(runs: Sequence[Run], *, smooth: int = 1):
    """The train-inference mismatch vs step, four panels: k3-KL(π_behav ‖ π_θ) on tokens at
    staleness 0 (log scale; steps without such tokens left out); the token importance
    weight w = π_prox/π_behav (band p01 to p99, line p50, dotted min and max, log scale;
    the quantiles are histogram bin centres, so within one bin of the exact value and
    possibly just outside min/max); the fraction of tokens and of sequences the cap masked
    (solid) or truncated (dashed). One colour per run."""
    labels = run_labels(runs)
    fig, axes = new_figure(2, 2, width=5.2, height=3.2)
    ax = axes[0, 0]
    for i, run in enumerate(runs):
        kl = run.series(MISMATCH_KL)
        fresh = run.series(MISMATCH_FRESH).reindex(kl.index)
        # A step with no token at staleness 0 measured nothing (it logs 0): left out, so a
        # gap in the line is "not measured", not "no mismatch".
        kl = kl[(fresh.isna() | (fresh > 0)) & (kl > 0)]
        ax.plot(
            kl.index, moving_average(kl, smooth), marker=".", color=f"C{i % 10}", label=labels[i]
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("k3 KL(π_behav ‖ π_θ) on tokens at staleness 0", fontsize=10)
    ax.grid(alpha=0.3)
    ax = axes[0, 1]
    for i, run in enumerate(runs):
        if not set(MISMATCH_IW) <= set(run.frame.columns):
            continue
        frame = run.frame[list(MISMATCH_IW)].dropna()  # steps that logged all three
        color = f"C{i % 10}"
        steps = frame.index.to_numpy()
        low, mid, high = (moving_average(frame[k], smooth) for k in MISMATCH_IW)
        ax.fill_between(steps, low, high, color=color, alpha=0.25, linewidth=0)
        ax.plot(steps, mid, color=color, linewidth=1.5, label=labels[i])
        for key in MISMATCH_IW_TAILS:
            tail = run.series(key)
            ax.plot(tail.index, tail.to_numpy(), color=color, linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("importance weight w: p01-p99, p50, min/max", fontsize=10)
    ax.grid(alpha=0.3)
    for ax, (what, (masked, truncated)) in zip(axes[1], MISMATCH_FRACS.items(), strict=True):
        for i, run in enumerate(runs):
            for key, style in ((masked, "-"), (truncated, "--")):
                values = run.series(key)
                if not values.empty:
                    ax.plot(values.index, moving_average(values, smooth), style, color=f"C{i % 10}")
        ax.set_xlabel("step")
        ax.set_title(f"{what} masked (solid) / truncated (dashed)", fontsize=10)
        ax.grid(alpha=0.3)
    add_legend(fig, axes[0, 1], len(runs))
    return fig


def add_legend(fig, ax, n: int) -> None:
    """The panel's legend inside it for up to 8 runs, else one legend outside the figure."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:  # no run logged the panel's series: nothing to name
        return
    if n <= 8:
        ax.legend(handles, labels, fontsize=7, loc="best")
    else:
        fig.legend(handles, labels, fontsize=7, loc="outside right upper")


def plot_phase_times(runs: Sequence[Run], *, skip_first: int = 1):
    """Mean seconds per step by phase, stacked: waiting for rollouts, training, pushing
    weights (the first ``skip_first`` steps, which compile, are left out)."""
    labels = run_labels(runs)
    fig, axes = new_figure(width=max(6.0, 0.55 * len(runs) + 2.5), height=4.2)
    ax = axes[0, 0]
    means = pd.DataFrame(
        {
            phase: [mean_over_steps(r, phase, skip_first=skip_first) for r in runs]
            for phase in (*PHASES, "time/step_s")
        }
    ).fillna(0.0)
    xs = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for phase in PHASES:
        ax.bar(xs, means[phase], bottom=bottom, label=phase.removeprefix("time/"), width=0.7)
        bottom += means[phase].to_numpy()
    ax.plot(xs, means["time/step_s"], "k_", markersize=14, label="step_s (total)")
    ax.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"time per step by phase (mean, first {skip_first} step(s) excluded)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return fig


def plot_staleness(runs: Sequence[Run]):
    """One bar chart per run: the fraction of trained tokens at each staleness d."""
    labels = run_labels(runs)
    ncols = min(5, len(runs))
    nrows = math.ceil(len(runs) / ncols)
    fig, axes = new_figure(nrows, ncols, width=2.6, height=2.2)
    any_approx = False
    distributions = [staleness_distribution(r) for r in runs]
    top = max((len(d) for d, _, _ in distributions), default=1)
    for ax, (d, counts, exact), label in zip(axes.flat, distributions, labels, strict=False):
        any_approx |= not exact
        if counts.sum() > 0:
            ax.bar(d, counts / counts.sum(), width=0.8, color="C0" if exact else "C1")
        ax.set_xlim(-0.6, max(top, 1) - 0.4)
        ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(runs) :]:
        ax.set_visible(False)
    what = (
        "per-step mean staleness, token-weighted (per-token staleness not logged)"
        if any_approx
        else "fraction of trained tokens at staleness d"
    )
    fig.suptitle(f"staleness d = version(trainer) - version(token): {what}", fontsize=9)
    return fig


def plot_sweep(
    runs: Sequence[Run],
    *,
    x_key: str = EFFECTIVE_STALENESS,
    hue_key: str = "algo.prox",
    metrics: Sequence[str] = (REWARD, "loss/clipfrac", "is/weight_max"),
    last_k: int = 5,
):
    """Each metric (mean of the last ``last_k`` steps; clip fraction and weights averaged
    over the run instead) vs ``x_key``, one line per ``hue_key`` value; runs that share a
    point (seeds) are averaged."""
    fig, axes = new_figure(1, len(metrics), width=4.2, height=3.4)
    for ax, metric in zip(axes.flat, metrics, strict=True):
        reduce = "last_k" if metric.startswith("reward") else "mean"
        grid = pivot(
            runs, row_key=x_key, col_key=hue_key, metric=metric, last_k=last_k, reduce=reduce
        )
        xs = np.arange(len(grid.rows))
        for j, hue in enumerate(grid.cols):
            ax.plot(xs, grid.values[:, j], marker="o", label=f"{short_key(hue_key)}={hue}")
        ax.set_xticks(xs, [str(r) for r in grid.rows])
        ax.set_xlabel(short_key(x_key))
        ax.set_title(grid.metric, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    return fig


# --------------------------------------------------------------------------------------
