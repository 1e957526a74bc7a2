"""What a training step records, and where training metrics go: a JSONL file, TensorBoard,
and the console.

* :func:`step_record` builds one step's record: the step's own metrics, rewards, response
  lengths, every ``staleness/*`` metric (from one definition,
  :func:`a3po_jax.rollout.admission.trained_staleness`), throughput and the queue's and
  hosts' counters.

Training layer (host-side shell).

* :class:`MetricsLogger` writes one JSON line per ``log`` call to ``run_dir/metrics.jsonl``,
  flushed at once so a crash loses nothing already logged, and the same numbers as
  TensorBoard scalars (arrays as histograms) under ``run_dir/tensorboard``.
* :func:`read_metrics` reads the JSONL back for notebooks and tests, skipping a line cut
  short by a crash and resolving resumed runs (later records of a step win).
* :class:`ProgressBar` is a tqdm bar on a terminal and a plain line every N steps
  elsewhere (CI logs stay short).
* :class:`Timer` measures one phase into ``metrics["time/<phase>_s"]``, waiting for JAX's
  asynchronous dispatch to finish first when given a value to wait on.

Array-valued metrics (e.g. ``staleness/tokens``, the per-token staleness) are samples of a
distribution: TensorBoard gets a histogram, the JSONL a summary
``{"count", "min", "max", "mean", "values"|"edges", "counts"}`` (integer arrays of small
range get one bin per value). Lists of numbers are written as JSON lists as they are, e.g.
``staleness/counts``: counts[d] = trained tokens at staleness d in that step.

Only process 0 of a multi-host run should create a logger.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from a3po_jax.core.types import RolloutGroup
from a3po_jax.rollout.admission import staleness_metrics, trained_staleness
from a3po_jax.rollout.scoring import scorer_metrics

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# Integer arrays whose values span at most this many integers get one bin per value.
_MAX_INTEGER_BINS = 64
_FLOAT_BINS = 16


def to_json_value(name: str, value: Any) -> Any:
    """Converts one metric to a JSON-able value: scalars (Python, numpy, 0-d JAX arrays)
    to Python numbers, arrays to a histogram summary, lists of numbers to a JSON list,
    strings and None unchanged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise TypeError(f"metric {name!r} is a list; only lists of numbers are logged")
        return list(value)
    if isinstance(value, np.generic) or hasattr(value, "__array__"):
        array = np.asarray(value)
        if array.ndim == 0:
            return array.item()
        return histogram_summary(array)
    raise TypeError(
        f"metric {name!r} has type {type(value).__name__}; expected a number, string, None "
        "or an array"
    )


def histogram_summary(values: np.ndarray) -> dict:
    """Summary of an array of samples (flattened) for the JSONL file."""
    values = np.asarray(values).reshape(-1)
    if values.size == 0:
        return {"count": 0}
    if values.dtype == np.bool_:
        values = values.astype(np.int32)
    summary = {
        "count": int(values.size),
        "min": values.min().item(),
        "max": values.max().item(),
        "mean": float(values.mean(dtype=np.float64)),
    }
    if np.issubdtype(values.dtype, np.integer):
        low, high = int(values.min()), int(values.max())
        if high - low < _MAX_INTEGER_BINS:
            counts = np.bincount(values.astype(np.int64) - low, minlength=high - low + 1)
            summary["values"] = list(range(low, high + 1))
            summary["counts"] = counts.tolist()
            return summary
    finite = values[np.isfinite(values)] if np.issubdtype(values.dtype, np.floating) else values
    counts, edges = np.histogram(finite.astype(np.float64), bins=_FLOAT_BINS)
    summary["edges"] = edges.tolist()
    summary["counts"] = counts.tolist()
    return summary


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX's writer module imports torch, if installed, only to accept torch tensors
    as values; for a JAX trainer that costs hundreds of MB of memory and seconds of start-up.
    Unless something imported torch already, the import runs with torch hidden
    (``sys.modules["torch"] = None`` makes ``import torch`` raise ImportError, which
    tensorboardX catches), and torch is importable again afterwards.
    """
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """Logs metrics per step to ``run_dir/metrics.jsonl``, TensorBoard and the console.

    Appends to an existing file, so a resumed run continues the same log. Pass
    ``purge_step`` (the first step the resumed run will log) to hide what the crashed run
    logged from that step on: TensorBoard purges those events and :func:`read_metrics`
    drops those records.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        console: bool = True,
        console_every: int = 1,
        console_keys: Sequence[str] | None = None,
        purge_step: int | None = None,
        stream: IO[str] | None = None,
    ):
        """
        Args:
          run_dir: directory of the run; created if missing.
          tensorboard: also write TensorBoard events under ``run_dir/tensorboard``.
          console: print a line of scalars every ``console_every`` steps.
          console_every: steps between console lines.
          console_keys: the metrics on the console line (default: all scalars).
          purge_step: first step of a resumed run (see the class docstring).
          stream: where console lines go (default ``sys.stdout``).
        """
        if console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {console_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.console = console
        self.console_every = console_every
        self.console_keys = None if console_keys is None else list(console_keys)
        self._stream = stream
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")
        # A crash mid-write leaves a partial last line; start on a fresh line so the next
        # record is not glued to it (read_metrics skips the partial one).
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            self._file.write("\n")
        if purge_step is not None:
            self._write_line({"resume_from_step": int(purge_step), "wall_time": time.time()})
        self._writer = None
        if tensorboard:
            SummaryWriter = _summary_writer_class()  # only needed when TensorBoard is on
            self._writer = SummaryWriter(
                logdir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge_step, flush_secs=10
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Writes one record for ``step``; returns it as written to the JSONL file."""
        if "step" in metrics or "wall_time" in metrics:
            raise ValueError("metric names 'step' and 'wall_time' are reserved")
        step = int(step)
        record: dict[str, Any] = {"step": step, "wall_time": time.time()}
        for name, value in metrics.items():
            record[name] = to_json_value(name, value)
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
            self._write_line(record)
            if self._writer is not None:
                self._write_tensorboard(step, metrics, record)
        if self.console and step % self.console_every == 0:
            print(format_console_line(step, record, self.console_keys), file=self._out())
        return record

    def _write_line(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:  # a failed write() does not say which file (disk full...)
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def _write_tensorboard(self, step: int, metrics: Mapping[str, Any], record: dict) -> None:
        for name, value in record.items():
            if name in ("step", "wall_time"):
                continue
            if isinstance(value, dict):
                samples = np.asarray(metrics[name]).reshape(-1)
                if samples.size:
                    self._writer.add_histogram(name, samples.astype(np.float64), step)
            elif isinstance(value, (bool, int, float)):
                self._writer.add_scalar(name, float(value), step)

    def _out(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stdout

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def format_console_line(step: int, record: Mapping[str, Any], keys: Sequence[str] | None) -> str:
    """``step 12 | loss/total 0.1234 | reward/mean 0.5`` from the scalar entries."""
    names = keys if keys is not None else [k for k in record if k not in ("step", "wall_time")]
    parts = [f"step {step}"]
    for name in names:
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{name} {_format_number(value)}")
    return " | ".join(parts)


def _format_number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)  # ints exactly; strings, nan and inf as they are


# Keys of a step record that describe the machine and how far generation had run ahead when
# the step was logged (timings, memory, the host's and the queue's counters), not what the
# step learned: two runs of one reproducible configuration differ only in these.
SNAPSHOT_KEYS = (
    "time/",
    "throughput/",
    "mem/",
    "queue/",
    "host/",
    "hosts/",
    "length/generated_mean",
    "length/dropped_",
    "length/trained_minus_generated",
    "wall_time",
    "run_dir",
)


def learning_metrics(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` without its `SNAPSHOT_KEYS` (prefixes): what to compare between two runs
    that should have learned the same (docs/reproducibility.md)."""
    return {k: v for k, v in record.items() if not k.startswith(SNAPSHOT_KEYS)}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Reads ``run_dir/metrics.jsonl`` into a list of records, one per logged step.

    * A line that does not parse (the last line cut short by a crash) is skipped with a
      warning.
    * Resumed runs are resolved: at a ``resume_from_step`` marker, or whenever the step
      goes backwards, earlier records of that step and later ones are dropped, so each
      step keeps the records of the run that continued.
    """
    path = Path(run_dir) / METRICS_FILE
    records: list[dict] = []
    with path.open("r", encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            where = "truncated last line" if number >= len(lines) - 1 else "unreadable line"
            log.warning("%s: skipping %s %d: %.80r", path, where, number, line)
            continue
        if "resume_from_step" in record:
            first = record["resume_from_step"]
            records = [r for r in records if r["step"] < first]
            continue
        if records and record["step"] < records[-1]["step"]:
            records = [r for r in records if r["step"] < record["step"]]
        records.append(record)
    return records


class ProgressBar:
    """Console progress with the key numbers: a tqdm bar on a terminal, otherwise (CI,
    redirected logs) one plain line every ``every`` steps and at the last step."""

    def __init__(
        self,
        total: int,
        *,
        every: int | None = None,
        initial: int = 0,
        desc: str = "train",
        file: IO[str] | None = None,
        tty: bool | None = None,
    ):
        """
        Args:
          total: the last step.
          every: steps between plain lines (default: about 20 lines per run).
          initial: the step a resumed run starts from.
          desc: label in front of the bar or line.
          file: output stream (default ``sys.stderr``).
          tty: force bar (True) or lines (False); default: whether ``file`` is a terminal.
        """
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.every = every if every is not None else max(1, round(total / 20))
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.desc = desc
        self._file = file if file is not None else sys.stderr
        self._tty = tty if tty is not None else bool(getattr(self._file, "isatty", bool)())
        self._initial = initial
        self._step = initial
        self._start = time.monotonic()
        self._bar = None
        if self._tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, file=self._file, dynamic_ncols=True
            )

    def update(self, step: int, key_numbers: Mapping[str, Any] | None = None) -> None:
        """Moves to ``step`` (absolute, not an increment) showing ``key_numbers``."""
        key_numbers = {} if key_numbers is None else key_numbers
        numbers = {k: _format_number(to_json_value(k, v)) for k, v in key_numbers.items()}
        advanced = step - self._step
        self._step = step
        if self._bar is not None:
            self._bar.set_postfix(numbers, refresh=False)
            self._bar.update(advanced)
            return
        if step % self.every == 0 or step >= self.total:
            print(self._plain_line(step, numbers), file=self._file, flush=True)

    def write(self, line: str) -> None:
        """A line of its own above the bar (or between the plain lines)."""
        if self._bar is not None:
            self._bar.write(line, file=self._file)
        else:
            print(line, file=self._file, flush=True)

    def _plain_line(self, step: int, numbers: Mapping[str, str]) -> str:
        elapsed = time.monotonic() - self._start
        done = step - self._initial
        rate = elapsed / done if done > 0 else float("nan")
        eta = rate * (self.total - step) if done > 0 else float("nan")
        parts = [
            f"{self.desc} {step}/{self.total} ({100.0 * step / self.total:.0f}%)",
            f"{_format_duration(elapsed)} elapsed",
            f"{rate:.3g} s/step" if done > 0 else "- s/step",
            f"eta {_format_duration(eta)}" if done > 0 else "eta -",
        ]
        parts += [f"{k} {v}" for k, v in numbers.items()]
        return " | ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Timer:
    """Times one phase into ``metrics["time/<phase>_s"]`` (summed if the phase repeats
    within one step, e.g. per micro-batch).

    JAX dispatches asynchronously, so a jitted call returns before its work is done; give
    the result to :meth:`block_on` and the timer waits for it before stopping the clock::

        with Timer("train", metrics) as timer:
            state, out = timer.block_on(train_step(state, batch))
    """

    def __init__(self, phase: str, metrics: dict | None = None):
        if not phase or "/" in phase:
            raise ValueError(f"phase must be a non-empty name without '/', got {phase!r}")
        self.key = f"time/{phase}_s"
        self.metrics = metrics
        self.elapsed: float | None = None
        self._value: Any = None
        self._start = 0.0

    def block_on(self, value: Any) -> Any:
        """Waits for ``value`` (a pytree of arrays) at exit; returns it unchanged."""
        self._value = value
        return value

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return  # a failed phase has no meaningful time; let the exception propagate
        if self._value is not None:
            import jax  # only when there is something to wait on

            jax.block_until_ready(self._value)
            self._value = None  # do not keep device buffers alive through the timer
        self.elapsed = time.perf_counter() - self._start
        if self.metrics is not None:
            self.metrics[self.key] = self.metrics.get(self.key, 0.0) + self.elapsed


# -- one training step's record ---------------------------------------------------------------


def peak_memory() -> dict[str, float]:
    """``mem/peak_rss_gb``: this process's peak resident memory so far (GiB, ``getrusage``;
    on a CPU that includes every array), and ``mem/device_peak_gb`` (the largest
    ``memory_stats()["peak_bytes_in_use"]`` of the local devices) where the backend reports
    it (GPU, TPU; not the CPU)."""
    import jax  # the shell imports jax lazily (see Timer)

    # ru_maxrss is in KiB on Linux.
    out = {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    if peaks:
        out["mem/device_peak_gb"] = max(peaks) / 2**30
    return out


def length_metrics(queue: Mapping[str, Any]) -> dict[str, float | int | None]:
    """``length/*``: completion lengths (tokens) of the samples generated, trained and
    dropped so far in the run, from the queue's cumulative counters
    (:meth:`a3po_jax.rollout.queue.RolloutQueue.counters`).

    * ``length/generated_mean``, ``length/trained_mean``: mean over every sample filed in the
      queue / handed to the trainer;
    * ``length/dropped_samples``, ``length/dropped_mean``: samples of dropped groups (any
      reason; an incomplete group counts what it received) and their mean (None while
      none: JSON null, no TensorBoard point);
    * ``length/trained_minus_generated``: the length bias of training, in tokens (< 0: the
      trainer sees shorter answers than the policy writes).
    """
    generated = int(queue.get("produced_samples", 0))
    trained = int(queue.get("consumed_samples", 0))
    dropped = int(sum(queue.get("dropped_samples", {}).values()))
    dropped_tokens = int(sum(queue.get("dropped_tokens", {}).values()))
    nan = float("nan")
    gen_mean = queue.get("generated_tokens", 0) / generated if generated else nan
    trained_mean = queue.get("consumed_tokens", 0) / trained if trained else nan
    return {
        "length/generated_mean": float(gen_mean),
        "length/trained_mean": float(trained_mean),
        "length/dropped_samples": dropped,
        "length/dropped_mean": dropped_tokens / dropped if dropped else None,
        "length/trained_minus_generated": float(trained_mean - gen_mean),
    }


def step_record(
    *,
    groups: Sequence[RolloutGroup],
    batch: Any,
    start_version: int,
    num_minibatches: int,
    step_metrics: Mapping[str, Any],
    timings: Mapping[str, float],
    version: int,
    host_stats: Mapping[str, Any],
    counters: Mapping[str, Mapping[str, Any]],
    skipped_total: int,
) -> dict[str, Any]:
    """The record of one training step, as logged to ``metrics.jsonl``.

    Args:
      groups: the groups the step trained on.
      batch: their padded ``TrainBatch`` ([R, T] ``versions``, ``loss_mask``; ``rewards``
        after any KL-in-reward shaping).
      start_version: the version the step started from; with ``num_minibatches`` = k,
        row r trained at ``start_version + ⌊r·k/R⌋``.
      step_metrics: the jitted step's scalars (host values).
      timings: ``time/*_s`` of the step (needs ``time/train_s``).
      version: the version after the step.
      host_stats: the inference host's ``stats()``.
      counters: tables of counters by prefix (``{"queue": ..., "hosts": ...}``); a nested
        dict becomes ``prefix/key/reason`` entries; ``"queue"`` also gives ``length/*``
        (:func:`length_metrics`).
      skipped_total: non-finite steps skipped so far.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    lengths = np.array([r.num_tokens for r in rollouts], np.float32)
    staleness = trained_staleness(batch.versions, batch.loss_mask, start_version, num_minibatches)
    n_tok = float(np.asarray(batch.loss_mask).sum())
    record = {
        # Host-side staleness first: where the step reports staleness/max and /mean itself
        # (the loss computes them from the same d = v0 + i - v_b per minibatch i), its values
        # are kept; the tests check that both agree with the histogram.
        **staleness_metrics(staleness),
        **{k: float(v) for k, v in step_metrics.items()},
        **timings,
        "version": int(version),
        "reward/mean": float(np.mean(batch.rewards)),
        "reward/correct": float(np.mean([float(r.info.get("correct", 0.0)) for r in rollouts])),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/finished_frac": float(np.mean([r.finish_reason == "stop" for r in rollouts])),
        "throughput/train_tokens_per_s": n_tok / max(timings["time/train_s"], 1e-9),
        "throughput/host_tokens_per_s": float(host_stats.get("tokens_per_s", 0.0)),
        "host/version": int(host_stats.get("version", -1)),
        # In-flight swaps' KV-cache recompute (totals; per swap = seconds / recomputes).
        "host/kv_recomputes": int(host_stats.get("kv_recomputes", 0)),
        "host/kv_recompute_s": float(host_stats.get("kv_recompute_s", 0.0)),
        # Seconds the serving loop has worked (total), and the last completed weight push
        # of a pool of remote hosts: from the trainer's call until every host installed it.
        "host/busy_s": float(host_stats.get("busy_s", 0.0)),
        **{
            f"host/{k}": float(host_stats[k])
            for k in ("push_s", "push_bytes", "push_staging_s")
            if k in host_stats
        },
        "step/skipped_total": skipped_total,
        **peak_memory(),
    }
    for prefix, table in counters.items():
        for key, value in table.items():
            if isinstance(value, dict):
                for reason, count in value.items():
                    record[f"{prefix}/{key}/{reason}"] = count
            else:
                record[f"{prefix}/{key}"] = value
    if "queue" in counters:
        record.update(length_metrics(counters["queue"]))
    record.update(scorer_metrics(rollouts))
    return record
