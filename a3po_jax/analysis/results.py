"""From run directories to the tables and plots the README and the notebooks show.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas, matplotlib).

Every run writes ``run_dir/config.json`` (the resolved
:class:`a3po_jax.training.config.TrainConfig`) and ``run_dir/metrics.jsonl`` (one record
per optimizer step, see :mod:`a3po_jax.training.metrics`). This module loads a set of such
directories and turns them into:

* a table of the final and mean-of-last-k reward per run, with the config fields that
  differ between the runs as columns (and a mean ± std table over seeds when runs differ
  only by seed);
* pivot tables of a metric over a sweep (e.g. rows η, columns prox);
* PNG plots: reward vs step and vs wall-clock time, time per step by phase, staleness
  histograms, importance-weight and clip-fraction curves, and a metric vs η sweep plot.
* for a synchronous sweep over ``algo.num_minibatches`` N that logs ``kl/ref_k3``
  (Asynchronous RLHF's off-policy robustness): reward against the policy version that
  generated it, final reward / area / KL per (loss, N) with their spread over seeds
  (:func:`offpolicy_table`), and the reward-vs-KL frontier per N.

The table work is pandas: a run's scalar metrics are a DataFrame indexed by step
(:attr:`Run.frame`), the runs' configs one DataFrame (:func:`config_frame`), and the tables
are DataFrames (:func:`summary_table`, :func:`seed_table`, :func:`pivot`) that
:func:`markdown_table` renders. Plotting uses ``matplotlib.figure.Figure`` directly (no
pyplot state, no backend switch), so the same functions draw into files and inline in a
notebook. The command line is :mod:`a3po_jax.cli.results`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from a3po_jax.training.config import staleness_bound
from a3po_jax.training.metrics import METRICS_FILE, read_metrics

CONFIG_FILE = "config.json"
REWARD = "reward/mean"
# Phases of one trainer step, in the order they happen (stacked bottom to top).
PHASES = ("time/wait_rollouts_s", "time/train_s", "time/weight_push_s")
# Config fields that name where a run lives rather than what it is.
IGNORED_CONFIG_KEYS = ("run_dir",)
EFFECTIVE_STALENESS = "system.effective_staleness"
# The exact per-step staleness histogram: counts[d] = trained tokens at staleness d.
STALENESS_COUNTS = "staleness/counts"


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

    @functools.cached_property
    def frame(self) -> pd.DataFrame:
        """The scalar metrics, one row per step (index ``step``), one float column per
        metric; a step that did not log a metric, or logged a non-finite value, holds NaN.
        Non-scalar metrics (histogram summaries, lists, strings) and bools are left out."""
        rows = [
            {k: float(v) for k, v in r.items() if k != "step" and _is_number(v)}
            for r in self.records
        ]
        steps = pd.Index([r["step"] for r in self.records], name="step", dtype=np.int64)
        frame = pd.DataFrame(rows, index=steps, dtype=np.float64)
        return frame.replace([np.inf, -np.inf], np.nan)

    def series(self, key: str) -> pd.Series:
        """A scalar metric over the steps that logged a finite value (empty if none)."""
        if key not in self.frame:
            return pd.Series([], index=pd.Index([], name="step", dtype=np.int64), dtype=float)
        return self.frame[key].dropna()

    def scalar(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar metric, over the records that have a finite value."""
        values = self.series(key)
        return values.index.to_numpy(np.int64), values.to_numpy(np.float64)

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
        # The bound comes from the config module, the one place the rule per mode lives.
        flat[EFFECTIVE_STALENESS] = staleness_bound(
            mode, flat.get("system.max_staleness"), flat.get("algo.num_minibatches", 1)
        )
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
    return list(dict.fromkeys(p.resolve() for p in found))


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


def config_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """The runs' flattened configs, one row per run (index: run name), object columns."""
    return pd.DataFrame(
        [run.config for run in runs], index=pd.Index([r.name for r in runs], name="run")
    ).astype(object)


def config_differences(runs: Sequence[Run]) -> list[str]:
    """Config keys whose values differ between the runs (run_dir excluded), sorted."""
    configs = config_frame(runs).drop(columns=list(IGNORED_CONFIG_KEYS), errors="ignore")
    # dropna=False: a key some runs lack (None/NaN) differs from one they all have.
    differing = sorted(configs.columns[configs.nunique(dropna=False) > 1])
    # η is derived from mode and max_staleness; if it varies, the raw max_staleness column
    # is only noise (sync runs keep the default max_staleness they ignore).
    if EFFECTIVE_STALENESS in differing and "system.max_staleness" in differing:
        differing.remove("system.max_staleness")
    return differing


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
    if isinstance(value, float | np.floating):
        return "nan" if not math.isfinite(value) else format(value, floatfmt)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def final_value(run: Run, key: str = REWARD) -> float:
    """The last finite value of ``key`` the run logged (nan if none)."""
    values = run.series(key)
    return float(values.iloc[-1]) if len(values) else float("nan")


def last_k_mean(run: Run, key: str = REWARD, k: int = 5) -> float:
    """Mean of ``key`` over the last ``k`` steps that logged it (nan if none)."""
    if k < 1:
        raise ValueError(f"last_k_mean: k must be >= 1, got {k}")
    return float(run.series(key).tail(k).mean())


def mean_over_steps(run: Run, key: str, *, skip_first: int = 0) -> float:
    """Mean of a scalar metric over the run's steps (after the first ``skip_first``)."""
    return float(run.series(key).iloc[skip_first:].mean())


def median_over_steps(run: Run, key: str, *, skip_first: int = 0) -> float:
    """Median of a scalar metric over the run's steps (after the first ``skip_first``): for
    times, robust to the steps that compiled a new shape."""
    return float(run.series(key).iloc[skip_first:].median())


def max_over_steps(run: Run, key: str, *, skip_first: int = 0) -> float:
    """Largest value of a scalar metric over the run's steps (after ``skip_first``)."""
    return float(run.series(key).iloc[skip_first:].max())


def summary_table(runs: Sequence[Run], *, metric: str = REWARD, last_k: int = 5) -> pd.DataFrame:
    """One row per run: its differing config values; the final, mean-of-last-k and
    all-steps mean (area under the curve / steps) ``metric``; the run's mean staleness,
    clip fraction, max importance weight and time per step (the first step, which
    compiles, is left out of the time). Columns: ``run``, the short config names, then
    the measurements."""
    keys = config_differences(runs)
    table = config_frame(runs)[keys].rename(columns=_short).reset_index()
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
    table = config_frame(runs)[keys].rename(columns=_short).reset_index()
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


def _seed_groups(runs: Sequence[Run], seed_key: str) -> tuple[list[str], list[list[Run]]]:
    """The config keys other than the seed that differ, and the runs grouped by their
    values of those keys (groups and members in first-seen order)."""
    keys = [k for k in config_differences(runs) if k != seed_key]
    configs = config_frame(runs)
    if keys:
        # One hashable label per run: a tuple of its values of the differing keys.
        labels = pd.Series(list(configs[keys].itertuples(index=False, name=None)), dtype=object)
    else:
        labels = pd.Series([()] * len(runs), dtype=object)
    codes, _ = pd.factorize(labels)
    groups = [[runs[i] for i in np.flatnonzero(codes == c)] for c in range(codes.max() + 1)]
    return keys, groups


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
    keys, groups = _seed_groups(runs, seed_key)
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
    table = pd.DataFrame([{_short(k): g[0].config.get(k) for k in keys} for g in groups])
    table["seeds"] = stats[("last", "count")].to_numpy()
    for column, name in (("last", f"{metric} last-{last_k}"), ("area", f"{metric} all-steps mean")):
        table[name] = [
            _mean_std(mean, std, n)
            for mean, std, n in zip(
                stats[(column, "mean")], stats[(column, "std")], table["seeds"], strict=True
            )
        ]
    table["staleness mean"] = stats[("staleness", "mean")].to_numpy()
    table["clipfrac mean"] = stats[("clipfrac", "mean")].to_numpy()
    table["train s/step"] = [
        _mean_std(mean, std, n, ".2f")
        for mean, std, n in zip(
            stats[("train_s", "mean")], stats[("train_s", "std")], table["seeds"], strict=True
        )
    ]
    return table


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
    table = pd.DataFrame({_short(by): stats.index.to_numpy()})
    table["seeds"] = stats[("ratio", "count")].to_numpy()
    table[f"{numerator} s"] = stats[("num", "mean")].to_numpy()
    table[f"{denominator} s"] = stats[("den", "mean")].to_numpy()
    table[f"{numerator} / {denominator}"] = [
        _mean_std(mean, std, n)
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
    for seed in sorted(by_seed, key=_sort_key):
        pair = by_seed[seed]
        if a not in pair or b not in pair:
            continue
        fa, fb = pair[a].frame, pair[b].frame
        steps = fa.index.intersection(fb.index)
        row: dict[str, Any] = {_short(seed_key): seed, "steps": len(steps)}
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


def _mean_std(mean: float, std: float, n: int, floatfmt: str = ".3f") -> str:
    """``0.958 ± 0.008`` (sample std); just the mean for one value."""
    if n <= 1:
        return format(float(mean), floatfmt)
    return f"{mean:{floatfmt}} ± {std:{floatfmt}}"


def merge_seeds(runs: Sequence[Run], *, seed_key: str = "seed") -> list[Run]:
    """Runs that differ only by ``seed_key`` merged into one run each, for plotting.

    A merged run's record at step s holds, for every scalar metric all its members logged
    at s, the mean over the members; ``wall_time`` is the mean time since each member's
    first step; staleness histograms (``staleness/counts``, and the older
    ``staleness/tokens`` summaries) are summed. Steps that not every member reached are
    dropped. Its config's ``seed`` becomes e.g. "0+1+2". Runs without a twin are returned
    as they are.
    """
    keys, groups = _seed_groups(runs, seed_key)
    merged = []
    for members in groups:
        if len(members) == 1:
            merged.append(members[0])
            continue
        frames = [m.frame.assign(wall_time=m.elapsed_s()) for m in members]
        stacked = pd.concat(frames, keys=range(len(members)), names=["member"])
        by_step = stacked.groupby(level="step")
        # A value only where every member logged it: a mean of fewer would mix in
        # one seed's noise at the steps the others skipped.
        mean = by_step.mean().where(by_step.count() == len(members))
        steps = sorted(set.intersection(*(set(f.index) for f in frames)))
        records = []
        for step, row in mean.loc[steps].iterrows():
            record = {"step": int(step), **row.dropna().to_dict()}
            member_records = [_record_at(m, step) for m in members]
            for key in (STALENESS_COUNTS, "staleness/tokens"):
                values = [r.get(key) for r in member_records]
                total = _sum_histograms(values)
                if total is not None:
                    record[key] = total
            records.append(record)
        config = dict(members[0].config)
        config[seed_key] = "+".join(str(m.config.get(seed_key)) for m in members)
        label = run_label(members[0], keys) if keys else members[0].name
        merged.append(Run(f"{label} (mean of {len(members)})", members[0].path, config, records))
    return merged


def _record_at(run: Run, step: int) -> dict[str, Any]:
    return next(r for r in run.records if r["step"] == step)


def _sum_histograms(values: list[Any]) -> Any:
    """The sum of one step's histograms over the members: count lists (index = d) are
    added elementwise; integer summaries (``{"values", "counts"}``) per value. None if
    not every member logged one of the same kind."""
    if all(isinstance(v, list) for v in values):
        total = np.zeros(max(len(v) for v in values))
        for v in values:
            total[: len(v)] += v
        return total.tolist()
    if all(isinstance(v, dict) and "values" in v for v in values):
        counts = pd.concat([pd.Series(v["counts"], index=v["values"]) for v in values])
        counts = counts.groupby(level=0).sum().sort_index()
        return {"values": counts.index.tolist(), "counts": counts.tolist()}
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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

    def to_frame(self) -> pd.DataFrame:
        """The means as a DataFrame (index: row values, columns: column values)."""
        return pd.DataFrame(self.values, index=list(self.rows), columns=list(self.cols))

    def to_markdown(self, floatfmt: str = ".3f") -> str:
        """Cells are ``mean ± std (n)`` where a cell averages several runs."""
        corner = f"{_short(self.row_key)} \\ {_short(self.col_key)}"
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
    rows = tuple(sorted(set(per_run["row"]), key=_sort_key))
    cols = tuple(sorted(set(per_run["col"]), key=_sort_key))
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


def _sort_key(value: Any) -> tuple:
    # Numbers before strings, each in natural order; None last.
    if value is None:
        return (2, "")
    if _is_number(value):
        return (0, value)
    return (1, str(value))


def staleness_distribution(run: Run) -> tuple[np.ndarray, np.ndarray, bool]:
    """Token counts by staleness d over the whole run.

    Returns ``(d, counts, exact)``. The trainer logs ``staleness/counts`` each step, a
    list with counts[d] = the step's trained tokens at staleness d, which is summed
    directly (``exact`` True).

    The rest are fallbacks for runs logged before that field existed (the committed runs
    in ``results/``): ``staleness/tokens`` as an integer histogram summary, or
    ``staleness/hist`` as a plain list of counts by d, are exact too. Otherwise
    (``staleness/hist`` logged as a summary of the count array, which does not keep which
    d each count belongs to) it falls back to the per-step mean staleness, weighted by the
    step's token count, rounded to the nearest integer, and ``exact`` is False.
    """
    totals = pd.Series(dtype=np.float64)

    def add(values: Sequence[int], counts: Sequence[float]) -> None:
        nonlocal totals
        step = pd.Series(np.asarray(counts, np.float64), index=np.asarray(values, np.int64))
        totals = totals.add(step, fill_value=0.0)

    for record in run.records:
        counts = record.get(STALENESS_COUNTS)
        tokens = record.get("staleness/tokens")
        hist = record.get("staleness/hist")
        if isinstance(counts, list):
            add(range(len(counts)), counts)
        elif isinstance(tokens, dict) and "values" in tokens:
            add(tokens["values"], tokens["counts"])
        elif isinstance(hist, list):
            add(range(len(hist)), hist)
    exact = not totals.empty
    if not exact:
        means = run.series("staleness/mean")
        if "loss/num_tokens" in run.frame:
            weights = run.frame["loss/num_tokens"].reindex(means.index).fillna(1.0)
        else:
            weights = pd.Series(1.0, index=means.index)
        if not means.empty:
            totals = weights.groupby(means.round().astype(np.int64).to_numpy()).sum()
    if totals.empty:
        return np.zeros(0, np.int64), np.zeros(0), exact
    totals = totals.reindex(range(int(totals.index.max()) + 1), fill_value=0.0)
    return totals.index.to_numpy(np.int64), totals.to_numpy(np.float64), exact


# --------------------------------------------------------------------------------------
# Plots (matplotlib Figures; save with fig.savefig or show inline in a notebook).
# --------------------------------------------------------------------------------------


def _figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _smooth(values: pd.Series, window: int) -> np.ndarray:
    """Trailing moving average (window 1 = raw); the first points average what exists."""
    return values.rolling(max(window, 1), min_periods=1).mean().to_numpy()


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
        values = run.series(key)
        if values.empty:
            continue
        if x == "wall":
            clock = pd.Series(run.elapsed_s(), index=run.frame.index)
            xs = clock.loc[values.index].to_numpy()
        else:
            xs = values.index.to_numpy()
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
    labels = _labels(runs)
    fig, axes = _figure(2, 2, width=5.2, height=3.2)
    ax = axes[0, 0]
    for i, run in enumerate(runs):
        kl = run.series(MISMATCH_KL)
        fresh = run.series(MISMATCH_FRESH).reindex(kl.index)
        # A step with no token at staleness 0 measured nothing (it logs 0): left out, so a
        # gap in the line is "not measured", not "no mismatch".
        kl = kl[(fresh.isna() | (fresh > 0)) & (kl > 0)]
        ax.plot(kl.index, _smooth(kl, smooth), marker=".", color=f"C{i % 10}", label=labels[i])
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
        low, mid, high = (_smooth(frame[k], smooth) for k in MISMATCH_IW)
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
                    ax.plot(values.index, _smooth(values, smooth), style, color=f"C{i % 10}")
        ax.set_xlabel("step")
        ax.set_title(f"{what} masked (solid) / truncated (dashed)", fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, axes[0, 1], len(runs))
    return fig


def _legend(fig, ax, n: int) -> None:
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
    labels = _labels(runs)
    fig, axes = _figure(width=max(6.0, 0.55 * len(runs) + 2.5), height=4.2)
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
    labels = _labels(runs)
    ncols = min(5, len(runs))
    nrows = math.ceil(len(runs) / ncols)
    fig, axes = _figure(nrows, ncols, width=2.6, height=2.2)
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
# Off-policy robustness (Asynchronous RLHF, arXiv 2410.18252): reward by generating
# version, and reward against the KL to the initial policy.
# --------------------------------------------------------------------------------------

KL_REF = "kl/ref_k3"  # k3 KL(π_θ ‖ π_init) on the trained tokens (algo.track_ref_kl)
OFFPOLICY_N = "algo.num_minibatches"


def loss_label(run: Run) -> str:
    """``dpo`` (Online DPO), ``rloo`` (clipped loss, leave-one-out advantages) or ``ppo``
    (clipped loss, group-normalised advantages), from the run's config."""
    if run.config.get("algo.loss") == "dpo":
        return "dpo"
    return "rloo" if run.config.get("algo.advantage") == "rloo" else "ppo"


def generating_versions(run: Run, key: str = REWARD) -> tuple[np.ndarray, np.ndarray]:
    """(versions, values) of ``key``: each step's value against the policy version that
    generated the step's samples. In synchronous generation (``system.mode=sync``) that is
    the version before the step's N = ``algo.num_minibatches`` updates, so runs with
    different N line up by policy, not by step.

    Raises:
      ValueError: for a run that is not synchronous (there a step mixes versions).
    """
    if run.config.get("system.mode") != "sync":
        raise ValueError(f"generating_versions: {run.name} is not a system.mode=sync run")
    n = int(run.config.get(OFFPOLICY_N, 1))
    frame = run.frame
    if key not in frame or "version" not in frame:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    rows = frame[["version", key]].dropna()
    return (rows["version"].to_numpy() - n).astype(np.int64), rows[key].to_numpy(np.float64)


def version_window_mean(run: Run, key: str = REWARD, *, window: int = 8) -> float:
    """Mean of ``key`` over the steps whose samples came from the last ``window`` + 1
    policy versions (generating version ≥ the run's last one − ``window``)."""
    versions, values = generating_versions(run, key)
    if not versions.size:
        return float("nan")
    return float(values[versions >= versions.max() - window].mean())


def version_area(run: Run, key: str = REWARD) -> float:
    """Area under ``key`` against the generating version (trapezoids), divided by the
    version span: the mean reward over training, the same weight per policy version."""
    versions, values = generating_versions(run, key)
    if versions.size < 2:
        return float(values[0]) if values.size else float("nan")
    heights = (values[1:] + values[:-1]) / 2
    return float(np.sum(heights * np.diff(versions)) / (versions[-1] - versions[0]))


def offpolicy_table(runs: Sequence[Run], *, window: int = 8) -> pd.DataFrame:
    """One row per (loss, N): the seeds, and mean ± std over them of the final reward
    (:func:`version_window_mean` over the last ``window`` + 1 versions), the area under
    the reward curve (:func:`version_area`) and the KL to the initial policy over the same
    window. Rows by N then loss; numbers as floats (``reward_final_mean``,
    ``reward_final_std``, ``reward_area_mean``, ..., ``KL_std``)."""
    rows = [
        {
            "loss": loss_label(r),
            "N": int(r.config.get(OFFPOLICY_N, 1)),
            "final": version_window_mean(r, REWARD, window=window),
            "area": version_area(r, REWARD),
            "kl": version_window_mean(r, KL_REF, window=window),
        }
        for r in runs
    ]
    frame = pd.DataFrame(rows)
    stats = frame.groupby(["N", "loss"]).agg(["mean", "std", "count"])
    table = pd.DataFrame(
        {"N": [n for n, _ in stats.index], "loss": [loss for _, loss in stats.index]}
    )
    table["seeds"] = stats[("final", "count")].to_numpy()
    for column, name in (("final", "reward_final"), ("area", "reward_area"), ("kl", "KL")):
        table[f"{name}_mean"] = stats[(column, "mean")].to_numpy()
        table[f"{name}_std"] = stats[(column, "std")].to_numpy()
    return table


def offpolicy_markdown(table: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """:func:`offpolicy_table` as markdown, each measurement ``mean ± std``."""
    lines = [
        "| N | loss | seeds | reward final | reward area | KL to init (k3) |",
        "|---|---|---|---|---|---|",
    ]
    for row in table.itertuples(index=False):
        cells = [
            _mean_std(
                getattr(row, f"{name}_mean"), getattr(row, f"{name}_std"), row.seeds, floatfmt
            )
            for name in ("reward_final", "reward_area", "KL")
        ]
        lines.append(f"| {row.N} | {row.loss} | {row.seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_n_and_loss(runs: Sequence[Run]) -> dict[int, dict[str, list[Run]]]:
    grouped: dict[int, dict[str, list[Run]]] = {}
    for run in runs:
        n = int(run.config.get(OFFPOLICY_N, 1))
        grouped.setdefault(n, {}).setdefault(loss_label(run), []).append(run)
    return {n: dict(sorted(grouped[n].items())) for n in sorted(grouped)}


def _seed_curve(members: Sequence[Run], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(versions, mean, std) over the members of ``key`` by generating version (the
    versions every member logged)."""
    curves = [pd.Series(v, index=x) for x, v in (generating_versions(r, key) for r in members)]
    frame = pd.concat(curves, axis=1).dropna()
    std = frame.std(axis=1, ddof=1) if frame.shape[1] > 1 else frame.iloc[:, 0] * 0
    return frame.index.to_numpy(), frame.mean(axis=1).to_numpy(), std.to_numpy()


def plot_reward_by_version(runs: Sequence[Run]):
    """Reward against the generating policy version, one panel per N, one line per loss:
    the mean over seeds with a ± std band."""
    grouped = _by_n_and_loss(runs)
    fig, axes = _figure(1, len(grouped), width=3.6, height=3.2)
    for ax, (n, losses_) in zip(axes.flat, grouped.items(), strict=True):
        for loss, members in losses_.items():
            x, mean, std = _seed_curve(members, REWARD)
            (line,) = ax.plot(x, mean, marker=".", label=f"{loss} ({len(members)} seeds)")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_title(f"N = {n}", fontsize=10)
        ax.set_xlabel("generating policy version")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(REWARD)
    axes[0, 0].legend(fontsize=7)
    return fig


def plot_reward_kl_frontier(runs: Sequence[Run], *, window: int = 8):
    """The paper's reward-vs-KL picture, one panel per N: per loss the mean-over-seeds
    path (KL to the initial policy, reward) along training, and its final point (means
    over the last ``window`` + 1 versions) with ± std over seeds on both axes. Up and to
    the left is better (more reward for less drift from the initial policy)."""
    grouped = _by_n_and_loss(runs)
    fig, axes = _figure(1, len(grouped), width=3.6, height=3.2)
    for ax, (n, losses_) in zip(axes.flat, grouped.items(), strict=True):
        for loss, members in losses_.items():
            _, reward, _ = _seed_curve(members, REWARD)
            _, kl, _ = _seed_curve(members, KL_REF)
            (line,) = ax.plot(kl, reward, alpha=0.45, linewidth=1)
            finals_r = [version_window_mean(r, REWARD, window=window) for r in members]
            finals_kl = [version_window_mean(r, KL_REF, window=window) for r in members]
            ddof = 1 if len(members) > 1 else 0
            ax.errorbar(
                np.mean(finals_kl),
                np.mean(finals_r),
                xerr=np.std(finals_kl, ddof=ddof),
                yerr=np.std(finals_r, ddof=ddof),
                color=line.get_color(),
                marker="o",
                capsize=3,
                label=f"{loss} ({len(members)} seeds)",
            )
        ax.set_title(f"N = {n}", fontsize=10)
        ax.set_xlabel(f"{KL_REF} (KL to the initial policy)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(REWARD)
    axes[0, 0].legend(fontsize=7)
    return fig


def is_offpolicy_sweep(runs: Sequence[Run]) -> bool:
    """Synchronous runs that log :data:`KL_REF` and vary N (the off-policy sweep)."""
    return (
        len(runs) > 1
        and all(r.config.get("system.mode") == "sync" and KL_REF in r.frame for r in runs)
        and len({r.config.get(OFFPOLICY_N) for r in runs}) > 1
    )


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
    aggregate = seed_table(runs, last_k=last_k)
    shown = merge_seeds(runs) if not aggregate.empty else list(runs)
    averaged = " (mean over seeds)" if not aggregate.empty else ""
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
    if has_mismatch(shown):
        figures["mismatch.png"] = (
            f"Train-inference mismatch: KL on fresh tokens, importance weights, masked and "
            f"truncated fractions{averaged}",
            plot_mismatch(shown),
        )
    axes = sweep_axes(runs)
    if axes is not None:
        figures["sweep.png"] = (
            f"Sweep over {_short(axes[0])} (each point: mean over its runs)",
            plot_sweep(runs, x_key=axes[0], hue_key=axes[1], last_k=last_k),
        )
    offpolicy = is_offpolicy_sweep(runs)
    if offpolicy:
        figures["reward_by_version.png"] = (
            "Reward by generating policy version, per N (mean ± std over seeds)",
            plot_reward_by_version(runs),
        )
        figures["frontier.png"] = (
            "Reward against KL to the initial policy, per N (final point: mean ± std over seeds)",
            plot_reward_kl_frontier(runs),
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
    if not aggregate.empty:
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
    if offpolicy:
        lines += [
            "## Off-policy robustness: final reward, area under the curve, KL (mean ± std)",
            "",
            "Final = mean over the samples generated by the last 9 policy versions; area ="
            " the reward curve's area against the generating version / the version span;"
            f" KL = `{KL_REF}` over the same steps as the final reward.",
            "",
            offpolicy_markdown(offpolicy_table(runs)),
            "",
        ]
    paired = paired_step_difference(runs)
    if not paired.empty:
        lines += [
            "## Periodic vs sync, step by step (same seed)",
            "",
            "The largest difference over the steps between the periodic and the synchronous"
            " run of each seed, and their median seconds per step (steps 2..). The same update"
            " gives differences at float rounding, not sampling noise.",
            "",
            markdown_table(paired, floatfmt=".3g"),
            "",
        ]
    for file, (caption, _) in figures.items():
        lines += [f"## {caption}", "", f"![{caption}]({file})", ""]
    if has_length(runs):
        lines += [
            "## Length bias (completion lengths in tokens, over the whole run)",
            "",
            markdown_table(length_table(runs)),
            "",
        ]
    lines += ["## Every run", "", markdown_table(summary_table(runs, last_k=last_k)), ""]
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
