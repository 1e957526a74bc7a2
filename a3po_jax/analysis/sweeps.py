"""Sweeps: an experiment file's list of override sets, turned into named runs.

Analysis layer (host-side shell).

An experiment file builds its base config in ``config()``; a sweep adds a module-level
``SWEEP``, a list of dicts ``{"section.field": value}``, one per run::

    SWEEP = [
        {"algo.prox": prox, "system.max_staleness": eta}
        for eta in (0, 1, 2, 4, 8)
        for prox in ("behav", "recompute", "a3po")
    ]

Each entry becomes the ``section.field=value`` overrides of ``a3po-train`` and a run name
made from its values (``prox-a3po_max_staleness-4``), so ``scripts/run_sweep.py`` can put
every run in its own directory and skip the ones already complete.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from a3po_jax.training.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    import_experiment,
    load_experiment,
)
from a3po_jax.training.metrics import METRICS_FILE, read_metrics


@dataclasses.dataclass(frozen=True)
class SweepRun:
    """One run of a sweep.

    Attributes:
      name: directory name of the run, unique within the sweep.
      overrides: its ``section.field=value`` strings (without ``run_dir``).
    """

    name: str
    overrides: tuple[str, ...]


def format_value(value: Any) -> str:
    """A config value as ``apply_overrides`` parses it: bools lower-case, tuples comma-joined."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(format_value(v) for v in value)
    return str(value)


def entry_overrides(entry: dict[str, Any]) -> tuple[str, ...]:
    """``{"algo.prox": "a3po"}`` → ``("algo.prox=a3po",)``."""
    return tuple(f"{key}={format_value(value)}" for key, value in entry.items())


def run_name(entry: dict[str, Any]) -> str:
    """A directory name from an entry's values: ``prox-a3po_max_staleness-4``."""
    if not entry:
        return "base"
    parts = [f"{key.rsplit('.', 1)[-1]}-{format_value(value)}" for key, value in entry.items()]
    # Anything that is not safe in a path becomes one "-" (e.g. JSON in task.options).
    return re.sub(r"-{2,}", "-", re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts))).strip("-")


def load_sweep(path: str | Path) -> list[SweepRun]:
    """The runs of an experiment file's ``SWEEP`` (one run named "base" if it has none).

    Raises:
      ConfigError: if the file is missing or fails to import, SWEEP is not a list of
        dicts with string keys, or two entries map to the same run name.
    """
    path = Path(path)
    entries = getattr(import_experiment(path), "SWEEP", [{}])
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: SWEEP must be a non-empty list of override dicts")
    runs: list[SweepRun] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise ConfigError(f"{path}: SWEEP[{i}] must be a dict of 'section.field' -> value")
        if "run_dir" in entry:
            raise ConfigError(f"{path}: SWEEP[{i}] sets run_dir; run_sweep.py chooses it")
        name = run_name(entry)
        if name in seen:
            raise ConfigError(f"{path}: SWEEP[{i}] and SWEEP[{seen[name]}] are both {name!r}")
        seen[name] = i
        runs.append(SweepRun(name, entry_overrides(entry)))
    return runs


def resolve(
    experiment: str | Path, run: SweepRun, out_dir: str | Path, extra: tuple[str, ...] = ()
) -> tuple[TrainConfig, list[str]]:
    """The validated config of one sweep run and its full override list (run_dir last, so
    ``extra`` cannot move it)."""
    overrides = [*run.overrides, *extra, f"run_dir={Path(out_dir) / run.name}"]
    return apply_overrides(load_experiment(experiment), overrides), overrides


def completed_steps(run_dir: str | Path) -> int:
    """The last step logged in ``run_dir/metrics.jsonl`` (0 if none)."""
    if not (Path(run_dir) / METRICS_FILE).is_file():
        return 0
    records = read_metrics(run_dir)
    return int(records[-1]["step"]) if records else 0


def is_complete(cfg: TrainConfig) -> bool:
    """Whether the run at ``cfg.run_dir`` logged all ``cfg.steps`` steps."""
    return completed_steps(cfg.run_dir) >= cfg.steps
