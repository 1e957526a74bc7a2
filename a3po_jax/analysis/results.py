"""From run directories to the tables and plots the README and the notebooks show.

Every run writes ``run_dir/config.json`` (the resolved
:class:`a3po_jax.training.config.TrainConfig`) and ``run_dir/metrics.jsonl`` (one record
per optimizer step, see
:mod:`a3po_jax.training.metrics`). This module loads a set of such directories and turns
them into:

* a markdown table of the final and mean-of-last-k reward per run, with the config fields
  that differ between the runs as columns (and a mean ± std table over seeds when runs
  differ only by seed);
* pivot tables of a metric over a sweep (e.g. rows η, columns prox);
* PNG plots: reward vs step and vs wall-clock time, time per step by phase, staleness
  histograms, importance-weight and clip-fraction curves, and a metric vs η sweep plot.

Command line::

    python -m a3po_jax.cli.results results/staleness_sweep_toy --out results/staleness_sweep_toy
    python -m a3po_jax.cli.results RUN_DIR [RUN_DIR ...] --out DIR [--last-k 5]

writes ``DIR/summary.md`` and the PNGs it links. A directory argument that is not itself a
run (no ``metrics.jsonl``) is searched recursively for runs.

Plotting uses ``matplotlib.figure.Figure`` directly (no pyplot state, no backend switch),
so the same functions draw into files here and inline in a notebook. Plain Python and
numpy only: no pandas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from a3po_jax.training.metrics import METRICS_FILE, read_metrics

CONFIG_FILE = "config.json"
REWARD = "reward/mean"
# Phases of one trainer step, in the order they happen (stacked bottom to top).
PHASES = ("time/wait_rollouts_s", "time/train_s", "time/weight_push_s")
# Config fields that name where a run lives rather than what it is.
IGNORED_CONFIG_KEYS = ("run_dir",)
EFFECTIVE_STALENESS = "system.effective_staleness"
# Fixed η of the modes that do not use system.max_staleness (design §4).
_MODE_STALENESS = {"sync": 0, "periodic": 0, "one_step_off": 1}


# --------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One run directory, loaded.

    Attributes:
      name: a short unique name (the directory path relative to the runs' common parent).
      path: the run directory.
      config: the run's config flattened to ``{"section.field": value}``, plus the derived
        ``system.effective_staleness`` (η the producer was held to, whatever the mode).
      records: the metrics records in step order (``read_metrics``).
    """

    name: str
    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def num_steps(self) -> int:
        return len(self.records)

    def scalar(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar metric, over the records that have a finite value."""
        steps, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
        return np.asarray(steps, np.int64), np.asarray(values, np.float64)

    def elapsed_s(self) -> np.ndarray:
        """Wall-clock seconds at the end of each step, counted from the end of the first.

        The first step holds start-up and compilation (tens of seconds on a CPU for a tiny
        model), which would hide the per-step differences this clock is for.
        """
        wall = np.asarray([r["wall_time"] for r in self.records], np.float64)
        return wall - wall[0] if wall.size else wall


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"algo": {"prox": "a3po"}}`` → ``{"algo.prox": "a3po"}``; lists become tuples."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = tuple(value) if isinstance(value, list) else value
    return flat


def _with_derived(flat: dict[str, Any]) -> dict[str, Any]:
    mode = flat.get("system.mode")
    if mode is not None:
        flat[EFFECTIVE_STALENESS] = _MODE_STALENESS.get(mode, flat.get("system.max_staleness"))
    return flat


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Load one run directory (``config.json`` + ``metrics.jsonl``).

    Raises:
      FileNotFoundError: naming the missing file.
    """
    path = Path(path)
    for file in (CONFIG_FILE, METRICS_FILE):
        if not (path / file).is_file():
            raise FileNotFoundError(f"{path} is not a run directory: {file} is missing")
    config = json.loads((path / CONFIG_FILE).read_text())
    return Run(
        name=name if name is not None else path.name,
        path=path,
        config=_with_derived(flatten_config(config)),
        records=read_metrics(path),
    )


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """The run directories named by ``paths``: a run itself, or every run below a folder."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / METRICS_FILE).is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p.parent for p in path.rglob(METRICS_FILE)))
        else:
            raise FileNotFoundError(f"{path} is neither a run directory nor a folder of runs")
    unique = list(dict.fromkeys(p.resolve() for p in found))
    return unique


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Load every run under ``paths`` (see :func:`find_run_dirs`), named by their path
    relative to the runs' common parent. Runs with no records yet are skipped."""
    dirs = find_run_dirs(paths)
    if not dirs:
        raise FileNotFoundError("no run directories (with metrics.jsonl) found")
    common = Path(*_common_parts([d.parts for d in dirs])) if len(dirs) > 1 else dirs[0].parent
    runs = []
    for d in dirs:
        run = load_run(d, name=str(d.relative_to(common)) if d != common else d.name)
        if run.records:
            runs.append(run)
    return runs


def _common_parts(parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    common: list[str] = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return tuple(common)


# --------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------


def config_differences(runs: Sequence[Run]) -> list[str]:
    """Config keys whose values differ between the runs (run_dir excluded), sorted."""
    keys = sorted({k for run in runs for k in run.config} - set(IGNORED_CONFIG_KEYS))
    differing = [k for k in keys if len({_hashable(run.config.get(k)) for run in runs}) > 1]
    # η is derived from mode and max_staleness; if it varies, the raw max_staleness column
    # is only noise (sync runs keep the default max_staleness they ignore).
    if EFFECTIVE_STALENESS in differing and "system.max_staleness" in differing:
        differing.remove("system.max_staleness")
    return differing


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def run_label(run: Run, keys: Sequence[str]) -> str:
    """``prox=a3po eta=4`` from the given config keys (the last part of each name)."""
    if not keys:
        return run.name
    return " ".join(f"{_short(k)}={_fmt(run.config.get(k))}" for k in keys)


def _short(key: str) -> str:
    return "eta" if key == EFFECTIVE_STALENESS else key.rsplit(".", 1)[-1]


def _fmt(value: Any, floatfmt: str = ".3f") -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else format(value, floatfmt)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def last_k_mean(run: Run, key: str = REWARD, k: int = 5) -> float:
    """Mean of ``key`` over the last ``k`` steps that logged it (nan if none)."""
    if k < 1:
        raise ValueError(f"last_k_mean: k must be >= 1, got {k}")
    _, values = run.scalar(key)
    return float(values[-k:].mean()) if values.size else float("nan")


def mean_over_steps(run: Run, key: str, *, skip_first: int = 0) -> float:
    """Mean of a scalar metric over the run's steps (after the first ``skip_first``)."""
    _, values = run.scalar(key)
    values = values[skip_first:]
    return float(values.mean()) if values.size else float("nan")


def summary_rows(runs: Sequence[Run], *, metric: str = REWARD, last_k: int = 5) -> list[dict]:
    """One row per run: its differing config values; the final, mean-of-last-k and
    all-steps mean (area under the curve / steps) ``metric``; the run's mean staleness,
    clip fraction, max importance weight and time per step (the first step, which
    compiles, is left out of the time)."""
    keys = config_differences(runs)
    rows = []
    for run in runs:
        _, values = run.scalar(metric)
        row: dict[str, Any] = {"run": run.name}
        row.update({_short(k): run.config.get(k) for k in keys})
        row["steps"] = run.num_steps
        row[f"{metric} final"] = float(values[-1]) if values.size else float("nan")
        row[f"{metric} last-{last_k}"] = last_k_mean(run, metric, last_k)
        row[f"{metric} all-steps mean"] = mean_over_steps(run, metric)
        row["staleness mean"] = mean_over_steps(run, "staleness/mean")
        row["clipfrac mean"] = mean_over_steps(run, "loss/clipfrac")
        row["is/weight_max max"] = _max_over_steps(run, "is/weight_max")
        row["s/step"] = mean_over_steps(run, "time/step_s", skip_first=1)
        rows.append(row)
    return rows


def _max_over_steps(run: Run, key: str, *, skip_first: int = 0) -> float:
    _, values = run.scalar(key)
    values = values[skip_first:]
    return float(values.max()) if values.size else float("nan")


def seed_aggregate_rows(
    runs: Sequence[Run], *, metric: str = REWARD, last_k: int = 5, seed_key: str = "seed"
) -> list[dict]:
    """Mean ± std (over seeds) of the mean-of-last-k and all-steps-mean ``metric``, for
    runs that differ only by seed.

    Returns one row per configuration (in first-seen order), the ± cells as strings;
    empty if no two runs share a configuration.
    """
    keys = [k for k in config_differences(runs) if k != seed_key]
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(_hashable(run.config.get(k)) for k in keys), []).append(run)
    if all(len(g) == 1 for g in groups.values()):
        return []
    rows = []
    for values, members in groups.items():
        scores = np.asarray([last_k_mean(r, metric, last_k) for r in members])
        areas = np.asarray([mean_over_steps(r, metric) for r in members])
        row: dict[str, Any] = {_short(k): v for k, v in zip(keys, values, strict=True)}
        row["seeds"] = len(members)
        row[f"{metric} last-{last_k}"] = _mean_std(scores)
        row[f"{metric} all-steps mean"] = _mean_std(areas)
        row["staleness mean"] = float(
            np.mean([mean_over_steps(r, "staleness/mean") for r in members])
        )
        row["clipfrac mean"] = float(
            np.mean([mean_over_steps(r, "loss/clipfrac") for r in members])
        )
        rows.append(row)
    return rows


def merge_seeds(runs: Sequence[Run], *, seed_key: str = "seed") -> list[Run]:
    """Runs that differ only by ``seed_key`` merged into one run each, for plotting.

    A merged run's record at step s holds, for every scalar metric all its members logged
    at s, the mean over the members; ``wall_time`` is the mean time since each member's
    first step; integer histogram summaries (``staleness/tokens``) are summed. Steps that
    not every member reached are dropped. Its config's ``seed`` becomes e.g. "0+1+2".
    Runs without a twin are returned as they are.
    """
    keys = [k for k in config_differences(runs) if k != seed_key]
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(_hashable(run.config.get(k)) for k in keys), []).append(run)
    merged = []
    for members in groups.values():
        if len(members) == 1:
            merged.append(members[0])
            continue
        by_step = [{r["step"]: r for r in m.records} for m in members]
        clocks = [dict(zip(by_step[i], m.elapsed_s(), strict=True)) for i, m in enumerate(members)]
        steps = sorted(set.intersection(*(set(b) for b in by_step)))
        records = []
        for step in steps:
            rows = [b[step] for b in by_step]
            record: dict[str, Any] = {
                "step": step,
                "wall_time": float(np.mean([c[step] for c in clocks])),
            }
            for key in rows[0]:
                if key in ("step", "wall_time"):
                    continue
                values = [row.get(key) for row in rows]
                if all(_is_number(v) for v in values):
                    record[key] = float(np.mean(values))
                elif all(isinstance(v, dict) and "values" in v for v in values):
                    record[key] = _sum_histograms(values)
            records.append(record)
        config = dict(members[0].config)
        config[seed_key] = "+".join(str(m.config.get(seed_key)) for m in members)
        label = run_label(members[0], keys) if keys else members[0].name
        merged.append(Run(f"{label} (mean of {len(members)})", members[0].path, config, records))
    return merged


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sum_histograms(summaries: list[dict]) -> dict:
    totals: dict[int, int] = {}
    for summary in summaries:
        for v, c in zip(summary["values"], summary["counts"], strict=True):
            totals[v] = totals.get(v, 0) + c
    values = sorted(totals)
    return {"values": values, "counts": [totals[v] for v in values]}


def _mean_std(values: np.ndarray, floatfmt: str = ".3f") -> str:
    """``0.958 ± 0.008`` (sample std); just the mean for one value."""
    if values.size == 1:
        return format(float(values[0]), floatfmt)
    return f"{values.mean():{floatfmt}} ± {values.std(ddof=1):{floatfmt}}"


def markdown_table(
    rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3f"
) -> str:
    """A GitHub markdown table of ``rows`` (dicts); columns default to the first row's keys."""
    if not rows:
        return ""
    columns = list(columns) if columns is not None else list(rows[0])
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c), floatfmt) for c in columns) + " |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Pivot:
    """A metric laid out on a grid of two config fields, averaged over repeated runs.

    Attributes:
      row_key, col_key: the config fields on the rows and columns.
      rows, cols: their values, sorted.
      values: [R, C] the mean of the metric over the runs in each cell (nan if none).
      stds: [R, C] the sample standard deviation over those runs (nan below 2 runs).
      counts: [R, C] how many runs each cell averages.
      metric: what was measured (e.g. "reward/mean last-5").
    """

    row_key: str
    col_key: str
    rows: tuple
    cols: tuple
    values: np.ndarray
    stds: np.ndarray
    counts: np.ndarray
    metric: str

    def cell(self, row: Any, col: Any) -> float:
        return float(self.values[self.rows.index(row), self.cols.index(col)])

    def to_markdown(self, floatfmt: str = ".3f") -> str:
        """Cells are ``mean ± std (n)`` where a cell averages several runs."""
        corner = f"{_short(self.row_key)} \\ {_short(self.col_key)}"
        table = []
        for i, r in enumerate(self.rows):
            row: dict[str, Any] = {corner: r}
            for j, c in enumerate(self.cols):
                mean, n = self.values[i, j], int(self.counts[i, j])
                row[str(c)] = (
                    f"{mean:{floatfmt}} ± {self.stds[i, j]:{floatfmt}} ({n})" if n > 1 else mean
                )
            table.append(row)
        return markdown_table(table, [corner] + [str(c) for c in self.cols], floatfmt)


def pivot(
    runs: Sequence[Run],
    *,
    row_key: str,
    col_key: str,
    metric: str = REWARD,
    last_k: int = 5,
    reduce: str = "last_k",
    skip_first: int = 0,
) -> Pivot:
    """Grid of ``metric`` over (``row_key``, ``col_key``), e.g. η × prox.

    Args:
      runs: the runs; runs with the same cell (e.g. several seeds) are averaged.
      row_key, col_key: flattened config keys.
      metric: a scalar metric name.
      last_k: steps averaged per run for ``reduce="last_k"``.
      reduce: per-run reduction: "last_k" (mean of the last k steps), "mean" (over all
        steps: for a reward, the area under its curve divided by the steps) or "max".
      skip_first: for "mean" and "max", leave out each run's first steps (use 1 for
        times: the first step compiles).
    """
    reducers = {
        "last_k": lambda r: last_k_mean(r, metric, last_k),
        "mean": lambda r: mean_over_steps(r, metric, skip_first=skip_first),
        "max": lambda r: _max_over_steps(r, metric, skip_first=skip_first),
    }
    if reduce not in reducers:
        raise ValueError(f"pivot: reduce={reduce!r} is not one of {', '.join(reducers)}")
    rows = tuple(sorted({r.config.get(row_key) for r in runs}, key=_sort_key))
    cols = tuple(sorted({r.config.get(col_key) for r in runs}, key=_sort_key))
    cells: dict[tuple[int, int], list[float]] = {}
    for run in runs:
        value = reducers[reduce](run)
        if math.isfinite(value):
            i, j = rows.index(run.config.get(row_key)), cols.index(run.config.get(col_key))
            cells.setdefault((i, j), []).append(value)
    values = np.full((len(rows), len(cols)), np.nan)
    stds = np.full((len(rows), len(cols)), np.nan)
    counts = np.zeros((len(rows), len(cols)), np.int64)
    for (i, j), items in cells.items():
        values[i, j] = np.mean(items)
        counts[i, j] = len(items)
        if len(items) > 1:
            stds[i, j] = np.std(items, ddof=1)
    label = f"{metric} last-{last_k}" if reduce == "last_k" else f"{metric} {reduce}"
    return Pivot(row_key, col_key, rows, cols, values, stds, counts, label)


def _sort_key(value: Any) -> tuple:
    # Numbers before strings, each in natural order; None last.
    if value is None:
        return (2, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def staleness_distribution(run: Run) -> tuple[np.ndarray, np.ndarray, bool]:
    """Token counts by staleness d over the whole run.

    Returns ``(d, counts, exact)``. ``exact`` is True when the run logged per-token
    staleness (``staleness/tokens`` as an integer histogram summary, or ``staleness/hist``
    as a plain list of counts by d). Otherwise (``staleness/hist`` logged as a summary of
    the count array, which does not keep which d each count belongs to) it falls back to
    the per-step mean staleness, weighted by the step's token count, rounded to the
    nearest integer, and ``exact`` is False.
    """
    totals: dict[int, float] = {}
    exact = False
    for record in run.records:
        tokens = record.get("staleness/tokens")
        hist = record.get("staleness/hist")
        if isinstance(tokens, dict) and "values" in tokens:
            for d, c in zip(tokens["values"], tokens["counts"], strict=True):
                totals[int(d)] = totals.get(int(d), 0.0) + c
            exact = True
        elif isinstance(hist, list):
            for d, c in enumerate(hist):
                totals[d] = totals.get(d, 0.0) + c
            exact = True
    if not exact:
        for record in run.records:
            mean = record.get("staleness/mean")
            if isinstance(mean, (int, float)) and math.isfinite(mean):
                d = int(round(mean))
                totals[d] = totals.get(d, 0.0) + float(record.get("loss/num_tokens", 1.0))
    if not totals:
        return np.zeros(0, np.int64), np.zeros(0), exact
    top = max(totals)
    d = np.arange(top + 1)
    return d, np.asarray([totals.get(i, 0.0) for i in d]), exact


# --------------------------------------------------------------------------------------
# Plots (matplotlib Figures; save with fig.savefig or show inline in a notebook).
# --------------------------------------------------------------------------------------


def _figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (window 1 = raw); the first points average what exists."""
    if window <= 1 or values.size == 0:
        return values
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _labels(runs: Sequence[Run]) -> list[str]:
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
        fig, axes = _figure()
        ax = axes[0, 0]
    labels = list(labels) if labels is not None else _labels(runs)
    if len(runs) > 10:
        # The default cycle repeats after 10 colours; a sweep of 15 would share colours.
        from matplotlib import colormaps

        ax.set_prop_cycle(color=colormaps["tab20"].colors)
    for run, label in zip(runs, labels, strict=True):
        steps, values = run.scalar(key)
        if not values.size:
            continue
        if x == "wall":
            clock = dict(zip((r["step"] for r in run.records), run.elapsed_s(), strict=True))
            xs = np.asarray([clock[s] for s in steps])
        else:
            xs = steps
        ax.plot(xs, _smooth(values, smooth), label=label, linewidth=1.5)
    ax.set_xlabel("step" if x == "step" else "wall-clock s (from end of step 1)")
    title = key if smooth <= 1 else f"{key} (moving avg {smooth})"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return fig if fig is not None else ax.figure


def plot_reward(runs: Sequence[Run], *, metric: str = REWARD, smooth: int = 5):
    """Reward vs step (left) and vs wall-clock time (right)."""
    fig, axes = _figure(1, 2)
    plot_curves(runs, metric, x="step", smooth=smooth, ax=axes[0, 0])
    plot_curves(runs, metric, x="wall", smooth=smooth, ax=axes[0, 1])
    _legend(fig, axes[0, 1], len(runs))
    return fig


def plot_diagnostics(runs: Sequence[Run], *, smooth: int = 3):
    """Importance weights (``is/weight_max``, ``is/weight_mean``), ``loss/clipfrac`` and
    ``staleness/mean`` vs step, one panel each."""
    keys = ("is/weight_max", "is/weight_mean", "loss/clipfrac", "staleness/mean")
    fig, axes = _figure(2, 2, width=5.2, height=3.2)
    for ax, key in zip(axes.flat, keys, strict=True):
        plot_curves(runs, key, x="step", smooth=smooth, ax=ax)
    _legend(fig, axes[0, 1], len(runs))
    return fig


def _legend(fig, ax, n: int) -> None:
    if n <= 8:
        ax.legend(fontsize=7, loc="best")
    else:
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside right upper")


def plot_phase_times(runs: Sequence[Run], *, skip_first: int = 1):
    """Mean seconds per step by phase, stacked: waiting for rollouts, training, pushing
    weights (the first ``skip_first`` steps, which compile, are left out)."""
    labels = _labels(runs)
    fig, axes = _figure(width=max(6.0, 0.55 * len(runs) + 2.5), height=4.2)
    ax = axes[0, 0]
    bottom = np.zeros(len(runs))
    xs = np.arange(len(runs))
    for phase in PHASES:
        means = np.asarray([mean_over_steps(r, phase, skip_first=skip_first) for r in runs])
        means = np.nan_to_num(means)
        ax.bar(xs, means, bottom=bottom, label=phase.removeprefix("time/"), width=0.7)
        bottom += means
    totals = [mean_over_steps(r, "time/step_s", skip_first=skip_first) for r in runs]
    ax.plot(xs, np.nan_to_num(totals), "k_", markersize=14, label="step_s (total)")
    ax.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"time per step by phase (mean, first {skip_first} step(s) excluded)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return fig


def plot_staleness(runs: Sequence[Run]):
    """One bar chart per run: the fraction of trained tokens at each staleness d."""
    labels = _labels(runs)
    ncols = min(5, len(runs))
    nrows = math.ceil(len(runs) / ncols)
    fig, axes = _figure(nrows, ncols, width=2.6, height=2.2)
    any_approx = False
    top = max((len(staleness_distribution(r)[0]) for r in runs), default=1)
    for ax, run, label in zip(axes.flat, runs, labels, strict=False):
        d, counts, exact = staleness_distribution(run)
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
    fig, axes = _figure(1, len(metrics), width=4.2, height=3.4)
    for ax, metric in zip(axes.flat, metrics, strict=True):
        reduce = "last_k" if metric.startswith("reward") else "mean"
        grid = pivot(
            runs, row_key=x_key, col_key=hue_key, metric=metric, last_k=last_k, reduce=reduce
        )
        xs = np.arange(len(grid.rows))
        for j, hue in enumerate(grid.cols):
            ax.plot(xs, grid.values[:, j], marker="o", label=f"{_short(hue_key)}={hue}")
        ax.set_xticks(xs, [str(r) for r in grid.rows])
        ax.set_xlabel(_short(x_key))
        ax.set_title(grid.metric, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    return fig


# --------------------------------------------------------------------------------------
# The whole report.
# --------------------------------------------------------------------------------------


def sweep_axes(runs: Sequence[Run]) -> tuple[str, str] | None:
    """(x, hue) keys for a sweep plot when the runs vary η and one other field."""
    keys = [k for k in config_differences(runs) if k != "seed"]
    if EFFECTIVE_STALENESS not in keys:
        return None
    others = [k for k in keys if k != EFFECTIVE_STALENESS]
    return (EFFECTIVE_STALENESS, others[0]) if len(others) == 1 else None


def write_summary(
    runs: Sequence[Run],
    out_dir: str | Path,
    *,
    last_k: int = 5,
    title: str = "Results",
    smooth: int = 5,
) -> Path:
    """Write ``out_dir/summary.md`` and its PNGs; returns the markdown file's path.

    Runs that differ only by seed are averaged (:func:`merge_seeds`) for the plots; the
    tables show the mean ± std over seeds and every run on its own.
    """
    if not runs:
        raise ValueError("write_summary: no runs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    aggregate = seed_aggregate_rows(runs, last_k=last_k)
    shown = merge_seeds(runs) if aggregate else list(runs)
    averaged = " (mean over seeds)" if aggregate else ""
    figures = {
        "reward.png": (
            f"Reward vs step and vs wall-clock time{averaged}",
            plot_reward(shown, smooth=smooth),
        ),
        "phase_times.png": (f"Time per step by phase{averaged}", plot_phase_times(shown)),
        "staleness.png": (f"Staleness histograms{averaged}", plot_staleness(shown)),
        "diagnostics.png": (
            f"Importance weights, clip fraction and staleness{averaged}",
            plot_diagnostics(shown),
        ),
    }
    axes = sweep_axes(runs)
    if axes is not None:
        figures["sweep.png"] = (
            f"Sweep over {_short(axes[0])} (each point: mean over its runs)",
            plot_sweep(runs, x_key=axes[0], hue_key=axes[1], last_k=last_k),
        )
    for file, (_, fig) in figures.items():
        fig.savefig(out / file, dpi=110)

    differing = config_differences(runs)
    common = {k: v for k, v in runs[0].config.items() if k not in differing}
    lines = [
        f"# {title}",
        "",
        f"{len(runs)} runs. Reward = `{REWARD}` (mean over the step's samples); `last-{last_k}`"
        f" = mean over the last {last_k} steps; `all-steps mean` = mean over every step (the"
        " area under the reward curve divided by the steps: higher = learned sooner); time"
        " per step excludes the first (compiling) step; ± is the sample std over seeds.",
        "",
    ]
    if aggregate:
        lines += ["## Mean ± std over seeds", "", markdown_table(aggregate), ""]
    if axes is not None:
        for metric, reduce in ((REWARD, "last_k"), (REWARD, "mean"), ("loss/clipfrac", "mean")):
            grid = pivot(
                runs,
                row_key=axes[0],
                col_key=axes[1],
                metric=metric,
                last_k=last_k,
                reduce=reduce,
            )
            what = grid.metric.replace(f"{REWARD} mean", f"{REWARD} all-steps mean")
            lines += [f"## {what} by {_short(axes[0])} × {_short(axes[1])}", ""]
            lines += [grid.to_markdown(), ""]
    for file, (caption, _) in figures.items():
        lines += [f"## {caption}", "", f"![{caption}]({file})", ""]
    lines += ["## Every run", "", markdown_table(summary_rows(runs, last_k=last_k)), ""]
    lines += [
        "## Settings shared by all runs",
        "",
        ", ".join(
            # Settings are shown as given (3e-05, 1e-08), not rounded to a table's digits.
            f"`{k}={v if isinstance(v, float) else _fmt(v)}`"
            for k, v in sorted(common.items())
            if k not in IGNORED_CONFIG_KEYS
        ),
        "",
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m a3po_jax.cli.results",
        description="Tables and plots from run directories (config.json + metrics.jsonl).",
    )
    parser.add_argument("runs", nargs="+", help="run directories or folders holding runs")
    parser.add_argument("--out", required=True, help="where summary.md and the PNGs go")
    parser.add_argument("--last-k", type=int, default=5, help="steps averaged for 'last-k'")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window (curves)")
    parser.add_argument("--title", default=None, help="heading of summary.md")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except FileNotFoundError as err:
        print(f"a3po_jax.cli.results: {err}", file=sys.stderr)
        return 2
    title = args.title or f"Results: {', '.join(Path(p).name for p in args.runs)}"
    path = write_summary(runs, args.out, last_k=args.last_k, title=title, smooth=args.smooth)
    print(f"wrote {path} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
