"""Tables over a set of runs: per run, over seeds, on a sweep grid, and as markdown.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas).

The tables are DataFrames (:func:`summary_table`, :func:`seed_table`, :func:`length_table`,
:func:`phase_time_ratio`, :func:`paired_step_difference`, :func:`pivot`) that
:func:`markdown_table` renders as GitHub markdown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from a3po_jax.analysis.runs import (
    EFFECTIVE_STALENESS,
    REWARD,
    Run,
    config_differences,
    config_frame,
    final_value,
    format_cell,
    last_k_mean,
    max_over_steps,
    mean_over_steps,
    median_over_steps,
    seed_groups,
    short_key,
    sort_key,
)


def summary_table(runs: Sequence[Run], *, metric: str = REWARD, last_k: int = 5) -> pd.DataFrame:
    """One row per run: its differing config values; the final, mean-of-last-k and
    all-steps mean (area under the curve / steps) ``metric``; the run's mean staleness,
    clip fraction, max importance weight and time per step (the first step, which
    compiles, is left out of the time). Columns: ``run``, the short config names, then
    the measurements."""
    keys = config_differences(runs)
    table = config_frame(runs)[keys].rename(columns=short_key).reset_index()
    table["steps"] = [run.num_steps for run in runs]
    table[f"{metric} final"] = [final_value(run, metric) for run in runs]
    table[f"{metric} last-{last_k}"] = [last_k_mean(run, metric, last_k) for run in runs]
    table[f"{metric} all-steps mean"] = [mean_over_steps(run, metric) for run in runs]
    table["staleness mean"] = [mean_over_steps(run, "staleness/mean") for run in runs]
    table["clipfrac mean"] = [mean_over_steps(run, "loss/clipfrac") for run in runs]
    table["is/weight_max max"] = [max_over_steps(run, "is/weight_max") for run in runs]
    table["s/step"] = [mean_over_steps(run, "time/step_s", skip_first=1) for run in runs]
    return table


LENGTH_GENERATED = "length/generated_mean"


def has_length(runs: Sequence[Run]) -> bool:
    """Whether any run logged the ``length/*`` metrics (older runs did not)."""
    return any(not r.series(LENGTH_GENERATED).empty for r in runs)


def length_table(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run: the length bias over the whole run (the ``length/*`` counters are
    cumulative, so their last value covers every step): mean completion length generated,
    trained and their difference, samples dropped and their mean length; the run's mean
    staleness, all-steps mean reward and time per step (first step left out)."""
    keys = config_differences(runs)
    table = config_frame(runs)[keys].rename(columns=short_key).reset_index()
    table["generated len"] = [final_value(run, LENGTH_GENERATED) for run in runs]
    table["trained len"] = [final_value(run, "length/trained_mean") for run in runs]
    table["trained - generated"] = [
        final_value(run, "length/trained_minus_generated") for run in runs
    ]
    table["dropped samples"] = [final_value(run, "length/dropped_samples") for run in runs]
    table["dropped len"] = [final_value(run, "length/dropped_mean") for run in runs]
    table["staleness mean"] = [mean_over_steps(run, "staleness/mean") for run in runs]
    table[f"{REWARD} all-steps mean"] = [mean_over_steps(run, REWARD) for run in runs]
    table["s/step"] = [mean_over_steps(run, "time/step_s", skip_first=1) for run in runs]
    return table


def seed_table(
    runs: Sequence[Run], *, metric: str = REWARD, last_k: int = 5, seed_key: str = "seed"
) -> pd.DataFrame:
    """Mean ± std (over seeds) of the mean-of-last-k and all-steps-mean ``metric``, for
    runs that differ only by seed.

    Returns one row per configuration (in first-seen order): its differing config values,
    ``seeds``, the two ``metric`` columns as ``"mean ± std"`` strings (the sample std; just
    the mean for one seed), and the mean staleness and clip fraction averaged over the
    seeds, and ``train s/step``: the median over steps 2.. of ``time/train_s`` (the train
    phase alone; the median leaves out the steps that compiled a new shape), mean ± std
    over the seeds. Empty if no two runs share a configuration.
    """
    keys, groups = seed_groups(runs, seed_key)
    if all(len(g) == 1 for g in groups):
        return pd.DataFrame()
    scores = pd.DataFrame(
        {
            "config": [i for i, g in enumerate(groups) for _ in g],
            "last": [last_k_mean(r, metric, last_k) for g in groups for r in g],
            "area": [mean_over_steps(r, metric) for g in groups for r in g],
            "staleness": [mean_over_steps(r, "staleness/mean") for g in groups for r in g],
            "clipfrac": [mean_over_steps(r, "loss/clipfrac") for g in groups for r in g],
            "train_s": [
                median_over_steps(r, "time/train_s", skip_first=1) for g in groups for r in g
            ],
        }
    )
    stats = scores.groupby("config", sort=False).agg(["mean", "std", "count"])
    table = pd.DataFrame([{short_key(k): g[0].config.get(k) for k in keys} for g in groups])
    table["seeds"] = stats[("last", "count")].to_numpy()
    for column, name in (("last", f"{metric} last-{last_k}"), ("area", f"{metric} all-steps mean")):
        table[name] = [
            mean_std(mean, std, n)
            for mean, std, n in zip(
                stats[(column, "mean")], stats[(column, "std")], table["seeds"], strict=True
            )
        ]
    table["staleness mean"] = stats[("staleness", "mean")].to_numpy()
    table["clipfrac mean"] = stats[("clipfrac", "mean")].to_numpy()
    table["train s/step"] = [
        mean_std(mean, std, n, ".2f")
        for mean, std, n in zip(
            stats[("train_s", "mean")], stats[("train_s", "std")], table["seeds"], strict=True
        )
    ]
    return table


def time_to_reward(run: Run, level: float, *, metric: str = REWARD, smooth: int = 3) -> float:
    """Wall-clock seconds (from the end of the first, compiling step) until the moving
    average over `smooth` steps of `metric` first reaches `level`; NaN if it never does."""
    values = run.series(metric)
    if values.empty:
        return float("nan")
    averaged = values.rolling(smooth, min_periods=1).mean().to_numpy()
    elapsed = dict(zip([r["step"] for r in run.records], run.elapsed_s(), strict=True))
    reached = np.flatnonzero(averaged >= level)
    return float(elapsed[int(values.index[reached[0]])]) if reached.size else float("nan")


def speed_table(
    runs: Sequence[Run],
    *,
    level: float | None = None,
    metric: str = REWARD,
    last_k: int = 5,
    smooth: int = 3,
    seed_key: str = "seed",
) -> tuple[pd.DataFrame, float]:
    """Steps per hour and time to a reward level, mean ± std over seeds, per configuration;
    returns (the table, the level).

    Steps per hour count the steps after the first (which compiles) over the wall-clock time
    they took. The level defaults to 0.8 x the lowest configuration's mean last-k
    ``metric``, so that every configuration reaches it: the time to it says which got there
    first in wall-clock time (`time_to_reward`, ``smooth``-step moving average). Also the
    fractions of the wall-clock time the trainer spent held by weight pushes and waiting for
    rollouts (means over steps 2..).
    """
    keys, groups = seed_groups(runs, seed_key)
    if level is None:
        level = 0.8 * min(
            float(np.mean([last_k_mean(r, metric, last_k) for r in g])) for g in groups
        )
    rows = []
    for group in groups:
        per_run = []
        for run in group:
            elapsed = run.elapsed_s()
            step_s = run.series("time/step_s").iloc[1:].sum()

            def share(key: str, run=run, step_s=step_s) -> float:  # of steps 2..
                return run.series(key).iloc[1:].sum() / step_s if step_s > 0 else float("nan")

            per_run.append(
                {
                    "steps_h": 3600.0 * (run.num_steps - 1) / elapsed[-1]
                    if run.num_steps > 1 and elapsed[-1] > 0
                    else float("nan"),
                    "to_level": time_to_reward(run, level, metric=metric, smooth=smooth),
                    "push": share("time/weight_push_s"),
                    "wait": share("time/wait_rollouts_s"),
                }
            )
        frame = pd.DataFrame(per_run)
        n = len(frame)
        reached = frame["to_level"].dropna()
        row = {short_key(k): group[0].config.get(k) for k in keys}
        row["seeds"] = n
        row["steps/hour"] = mean_std(frame["steps_h"].mean(), frame["steps_h"].std(), n, ".0f")
        row[f"s to {metric} {level:.3g}"] = (
            mean_std(reached.mean(), reached.std(), len(reached), ".0f")
            + ("" if len(reached) == n else f" ({len(reached)} of {n} reached)")
            if len(reached)
            else "not reached"
        )
        row["held by push"] = f"{frame['push'].mean():.1%}"
        row["waiting for rollouts"] = f"{frame['wait'].mean():.1%}"
        rows.append(row)
    return pd.DataFrame(rows), level


def phase_time_ratio(
    runs: Sequence[Run],
    *,
    numerator: str = "a3po",
    denominator: str = "recompute",
    method_key: str = "algo.prox",
    by: str = EFFECTIVE_STALENESS,
    metric: str = "time/train_s",
    seed_key: str = "seed",
) -> pd.DataFrame:
    """A phase's time for one method over another's, measured inside the runs themselves.

    For every value of ``by`` (η by default) and every seed that has a run of both methods,
    the ratio of the two runs' medians of ``metric`` over steps 2.. (the first step
    compiles; the median leaves out later steps that compiled a new shape). Returns one
    row per ``by`` value: the seeds paired, the mean over them of each method's median
    seconds, and the ratio as ``"mean ± std"`` over the seeds (A-3PO's claim: the a3po
    train phase costs about 3/4 of recompute's, one forward pass less in four).
    """
    cells: dict[tuple[Any, Any], dict[str, float]] = {}
    for run in runs:
        method = run.config.get(method_key)
        if method in (numerator, denominator):
            key = (run.config.get(by), run.config.get(seed_key))
            cells.setdefault(key, {})[method] = median_over_steps(run, metric, skip_first=1)
    rows = [
        {by: group, "num": pair[numerator], "den": pair[denominator]}
        for (group, _), pair in cells.items()
        if numerator in pair and denominator in pair
    ]
    if not rows:
        return pd.DataFrame()
    frame = pd.DataFrame(rows).assign(ratio=lambda f: f["num"] / f["den"])
    stats = frame.groupby(by, sort=True).agg(["mean", "std", "count"])
    table = pd.DataFrame({short_key(by): stats.index.to_numpy()})
    table["seeds"] = stats[("ratio", "count")].to_numpy()
    table[f"{numerator} s"] = stats[("num", "mean")].to_numpy()
    table[f"{denominator} s"] = stats[("den", "mean")].to_numpy()
    table[f"{numerator} / {denominator}"] = [
        mean_std(mean, std, n)
        for mean, std, n in zip(
            stats[("ratio", "mean")], stats[("ratio", "std")], table["seeds"], strict=True
        )
    ]
    return table


def paired_step_difference(
    runs: Sequence[Run],
    *,
    method_key: str = "system.mode",
    a: str = "periodic",
    b: str = "sync",
    metrics: Sequence[str] = (REWARD, "loss/total", "optim/grad_norm"),
    seed_key: str = "seed",
) -> pd.DataFrame:
    """How far two methods' runs of the same seed are apart, step by step.

    For every seed with a run of both ``a`` and ``b`` (values of ``method_key``): the steps
    both logged, the largest absolute difference over those steps of each metric (NaN
    where one of the two did not log it), and each run's median ``time/step_s`` over steps 2...
    Periodic Asynchrony's claim is that its update is the synchronous one: with the same
    seed the two runs should agree step for step up to float rounding (the fold order of
    the groups differs), not merely in distribution.
    """
    by_seed: dict[Any, dict[str, Run]] = {}
    for run in runs:
        method = run.config.get(method_key)
        if method in (a, b):
            by_seed.setdefault(run.config.get(seed_key), {})[method] = run
    rows = []
    for seed in sorted(by_seed, key=sort_key):
        pair = by_seed[seed]
        if a not in pair or b not in pair:
            continue
        fa, fb = pair[a].frame, pair[b].frame
        steps = fa.index.intersection(fb.index)
        row: dict[str, Any] = {short_key(seed_key): seed, "steps": len(steps)}
        for metric in metrics:
            if metric in fa and metric in fb:
                diff = (fa.loc[steps, metric] - fb.loc[steps, metric]).abs()
                row[f"max |Δ {metric}|"] = float(diff.max())
            else:
                row[f"max |Δ {metric}|"] = float("nan")
        for method in (a, b):
            row[f"{method} s/step"] = median_over_steps(pair[method], "time/step_s", skip_first=1)
        rows.append(row)
    return pd.DataFrame(rows)


def mean_std(mean: float, std: float, n: int, floatfmt: str = ".3f") -> str:
    """``0.958 ± 0.008`` (sample std); just the mean for one value."""
    if n <= 1:
        return format(float(mean), floatfmt)
    return f"{mean:{floatfmt}} ± {std:{floatfmt}}"


def markdown_table(
    rows: pd.DataFrame | Sequence[dict],
    columns: Sequence[str] | None = None,
    floatfmt: str = ".3f",
) -> str:
    """A GitHub markdown table of a DataFrame (or of dicts); columns default to all of the
    DataFrame's (the dicts' keys). Floats are printed with ``floatfmt``, nan as "nan"."""
    # dtype=object keeps dicts' values as given: None stays None, 3 stays 3 (not 3.0).
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), dtype=object)
    if frame.empty:
        return ""
    columns = list(columns) if columns is not None else list(frame.columns)
    lines = [
        "| " + " | ".join(map(str, columns)) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in frame.to_dict("records"):
        lines.append("| " + " | ".join(format_cell(row.get(c), floatfmt) for c in columns) + " |")
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

    def to_frame(self) -> pd.DataFrame:
        """The means as a DataFrame (index: row values, columns: column values)."""
        return pd.DataFrame(self.values, index=list(self.rows), columns=list(self.cols))

    def to_markdown(self, floatfmt: str = ".3f") -> str:
        """Cells are ``mean ± std (n)`` where a cell averages several runs."""
        corner = f"{short_key(self.row_key)} \\ {short_key(self.col_key)}"
        cells = self.to_frame().astype(object)
        several = self.counts > 1
        for i, j in zip(*np.nonzero(several), strict=True):
            mean, std, n = self.values[i, j], self.stds[i, j], int(self.counts[i, j])
            cells.iat[i, j] = f"{mean:{floatfmt}} ± {std:{floatfmt}} ({n})"
        table = cells.rename(columns=str).rename_axis(corner).reset_index()
        return markdown_table(table, floatfmt=floatfmt)


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
        "max": lambda r: max_over_steps(r, metric, skip_first=skip_first),
    }
    if reduce not in reducers:
        raise ValueError(f"pivot: reduce={reduce!r} is not one of {', '.join(reducers)}")
    per_run = pd.DataFrame(
        {
            "row": [r.config.get(row_key) for r in runs],
            "col": [r.config.get(col_key) for r in runs],
            "value": [reducers[reduce](r) for r in runs],
        }
    )
    rows = tuple(sorted(set(per_run["row"]), key=sort_key))
    cols = tuple(sorted(set(per_run["col"]), key=sort_key))
    # Runs without a finite value are left out of their cell (a gap, not a zero).
    stats = (
        per_run.dropna(subset=["value"])
        .groupby(["row", "col"])["value"]
        .agg(["mean", "std", "count"])
    )

    def grid(column: str, fill: float) -> np.ndarray:
        wide = stats[column].unstack("col") if len(stats) else pd.DataFrame()
        return wide.reindex(index=list(rows), columns=list(cols)).fillna(fill).to_numpy()

    label = f"{metric} last-{last_k}" if reduce == "last_k" else f"{metric} {reduce}"
    return Pivot(
        row_key,
        col_key,
        rows,
        cols,
        values=grid("mean", np.nan).astype(np.float64),
        stds=grid("std", np.nan).astype(np.float64),
        counts=grid("count", 0).astype(np.int64),
        metric=label,
    )
