"""Run directories loaded: configs, metrics and the per-run reductions the tables use.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas).

Every run writes ``run_dir/config.json`` (the resolved
:class:`a3po_jax.training.config.TrainConfig`) and ``run_dir/metrics.jsonl`` (one record
per optimizer step, see :mod:`a3po_jax.training.metrics`). :func:`load_runs` turns a set of
such directories into :class:`Run` objects: a run's scalar metrics are a DataFrame indexed
by step (:attr:`Run.frame`), the runs' configs one DataFrame (:func:`config_frame`).
Runs that differ only by seed are grouped by :func:`seed_groups` and averaged for plots by
:func:`merge_seeds`.
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
        """Training steps logged (a step-0 record holds the evaluation before training)."""
        return sum(1 for r in self.records if r["step"] >= 1)

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
        model), which would hide the per-step differences this clock is for. A step-0
        record (the evaluation before training) comes before it: its time is negative.
        """
        wall = np.asarray([r["wall_time"] for r in self.records], np.float64)
        first = next((i for i, r in enumerate(self.records) if r["step"] >= 1), 0)
        return wall - wall[first] if wall.size else wall


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
    return " ".join(f"{short_key(k)}={format_cell(run.config.get(k))}" for k in keys)


def short_key(key: str) -> str:
    """A config key's column name: its last part (``algo.prox`` -> ``prox``), η as ``eta``."""
    return "eta" if key == EFFECTIVE_STALENESS else key.rsplit(".", 1)[-1]


def format_cell(value: Any, floatfmt: str = ".3f") -> str:
    """A table cell: floats with ``floatfmt`` (nan as "nan"), tuples comma-joined."""
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


def last_k_median(run: Run, key: str = REWARD, k: int = 5) -> float:
    """Median of ``key`` over the last ``k`` steps that logged it (nan if none): for a metric
    one step of which can spike (the k3 KL estimate, a reward with the KL in it)."""
    if k < 1:
        raise ValueError(f"last_k_median: k must be >= 1, got {k}")
    return float(run.series(key).tail(k).median())


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


def seed_groups(runs: Sequence[Run], seed_key: str) -> tuple[list[str], list[list[Run]]]:
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


def merge_seeds(runs: Sequence[Run], *, seed_key: str = "seed") -> list[Run]:
    """Runs that differ only by ``seed_key`` merged into one run each, for plotting.

    A merged run's record at step s holds, for every scalar metric all its members logged
    at s, the mean over the members; ``wall_time`` is the mean time since each member's
    first step; staleness histograms (``staleness/counts``, and the older
    ``staleness/tokens`` summaries) are summed. Steps that not every member reached are
    dropped. Its config's ``seed`` becomes e.g. "0+1+2". Runs without a twin are returned
    as they are.
    """
    keys, groups = seed_groups(runs, seed_key)
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


def sort_key(value: Any) -> tuple:
    """Sort key for config values: numbers before strings, each in natural order; None last."""
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
