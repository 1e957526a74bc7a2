"""The report of one run: what ``a3po-train`` prints at the end, and ``report.md`` with its
PNGs in the run directory.

Analysis layer (host side, never jitted). Reads only ``config.json``, ``metrics.jsonl``
and ``ledger.jsonl`` of the run directory, so :func:`write_run_report` makes the same
report at the end of a run (:mod:`a3po_jax.cli.train`) and for any run directory later
(``python -m a3po_jax.cli.results RUN_DIR``). It needs no pandas (it runs at the end of
every run, in the base install); the plots need matplotlib (the base install gets it with
reasoning-gym, the ``analysis`` extra names it) and are left out, with a line saying so,
where it is missing.

Rows of the report (:func:`report_rows`):

* held-out accuracy at the first and the last evaluation (``eval/*``; step 0 is before
  training) with the 95 % interval the trainer logged
  (:func:`a3po_jax.analysis.evaluation.accuracy_interval`);
* training reward (``reward/mean``) over the first k and the last k steps;
* what scored the rewards (``reward/scorer``, ``task.reward``), the seconds spent scoring
  (``time/reward_s``) and, under a reward model, the verifier's gold score at both ends;
* steps trained (and skipped), wall time (from the start of the first evaluation or step
  logged to the last record; a resumed run's downtime is in it) and the share of it spent
  evaluating and compiling (``time/compile_s``), peak memory;
* staleness seen (exact, from the per-step histograms ``staleness/counts``) against the
  bound η;
* which side waited: the trainer's share of its step time spent waiting for rollouts and
  the host's share of it spent serving, read as generation-bound, training-bound or both
  busy; where the host's time went per step (``host/<part>_s``, the serving loop's parts
  and idle); groups dropped (by reason) and re-issued (after a resume, from the ledger; after
  a host failure, from ``hosts/reissued_requests``), with the ledger's exactly-once audit.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from a3po_jax.inference.host_metrics import LOOP_PARTS
from a3po_jax.rollout.ledger import audit, ledger_path
from a3po_jax.training.config import EVAL_SPLIT, staleness_bound
from a3po_jax.training.metrics import METRICS_FILE, TENSORBOARD_DIR, read_metrics

REPORT_FILE = "report.md"
# The PNGs beside report.md: file -> caption.
FIGURES = {
    "reward.png": "Training reward per step",
    "eval_accuracy.png": "Held-out accuracy with its 95 % interval",
    "entropy.png": "Policy entropy per step (nats per token)",
    "staleness.png": "Staleness of the trained tokens",
}
REWARD = "reward/mean"
ENTROPY = "policy/entropy"
STALENESS_COUNTS = "staleness/counts"
# Steps averaged at each end of the reward curve: at most this many, a third of the run.
MAX_REWARD_WINDOW = 5


@dataclasses.dataclass(frozen=True)
class RunReport:
    """One run's report: its rows, the figures written (file names), and why none were."""

    run_dir: Path
    title: str
    rows: tuple[tuple[str, str], ...]
    figures: tuple[str, ...] = ()
    no_plots: str | None = None  # why there are no figures (matplotlib missing)

    def terminal(self) -> str:
        """The rows as an aligned two-column table, with where the report and curves are."""
        width = max(len(label) for label, _ in self.rows)
        lines = [self.title]
        lines += [f"  {label:<{width}}  {value}" for label, value in self.rows]
        path = self.run_dir / REPORT_FILE
        if self.figures:
            lines.append(f"report: {path} (plots beside it: {', '.join(self.figures)})")
        else:
            lines.append(f"report: {path} (no plots: {self.no_plots})")
        lines.append(f"curves: {tensorboard_command(self.run_dir)}  (pip install tensorboard)")
        return "\n".join(lines)

    def markdown(self) -> str:
        """``report.md``: the rows as a table, then the figures."""
        lines = [f"# {self.title}", "", "| | |", "|---|---|"]
        lines += [f"| {label} | {value} |" for label, value in self.rows]
        lines.append("")
        if self.no_plots:
            lines += [f"No plots: {self.no_plots}.", ""]
        for file in self.figures:
            lines += [f"## {FIGURES[file]}", "", f"![{FIGURES[file]}]({file})", ""]
        command = tensorboard_command(self.run_dir)
        lines += [f"Every metric per step: `{METRICS_FILE}`; the curves: `{command}`.", ""]
        return "\n".join(lines)


def tensorboard_command(run_dir: str | Path) -> str:
    """The command that shows the run's curves (TensorBoard itself is not a dependency)."""
    return f"tensorboard --logdir {Path(run_dir) / TENSORBOARD_DIR}"


def write_run_report(run_dir: str | Path, *, plots: bool = True) -> RunReport:
    """Write ``run_dir/report.md`` and, with matplotlib, its PNGs; return the report.

    Raises:
      FileNotFoundError: ``run_dir`` has no ``config.json`` or ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    config, records = load_run_files(run_dir)
    figures: tuple[str, ...] = ()
    no_plots = None
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            no_plots = "matplotlib is not installed (pip install 'a3po_jax[analysis]')"
        else:
            for file, fig in run_figures(records, config).items():
                fig.savefig(run_dir / file, dpi=100)
            figures = tuple(FIGURES)
    else:
        no_plots = "not asked for"
    report = RunReport(
        run_dir=run_dir,
        title=report_title(run_dir, config),
        rows=tuple(report_rows(records, config, ledger=ledger_summary(run_dir))),
        figures=figures,
        no_plots=no_plots,
    )
    (run_dir / REPORT_FILE).write_text(report.markdown())
    return report


def load_run_files(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's config (as saved) and its metrics records (``read_metrics``)."""
    for file in ("config.json", METRICS_FILE):
        if not (run_dir / file).is_file():
            raise FileNotFoundError(f"{run_dir} is not a run directory: {file} is missing")
    return json.loads((run_dir / "config.json").read_text()), read_metrics(run_dir)


def report_title(run_dir: Path, config: dict[str, Any]) -> str:
    system, algo = config.get("system", {}), config.get("algo", {})
    return (
        f"Run {run_dir}: {config.get('model', {}).get('name')} on "
        f"{config.get('task', {}).get('name')}, mode {system.get('mode')}, "
        f"loss {algo.get('loss')}, prox {algo.get('prox')}"
    )


# ---------------------------------------------------------------------------------------
# The rows.


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar metric over the records that logged a finite number."""
    pairs = [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]
    pairs = [(s, v) for s, v in pairs if np.isfinite(v)]
    steps = np.array([s for s, _ in pairs], np.int64)
    return steps, np.array([v for _, v in pairs], np.float64)


def reward_window(num_steps: int) -> int:
    """Steps averaged at each end of the reward curve: a third of the run, 1 to 5."""
    return max(1, min(MAX_REWARD_WINDOW, num_steps // 3))


def staleness_counts(records: Sequence[dict[str, Any]]) -> np.ndarray:
    """Trained tokens at each staleness d over the run (``staleness/counts`` summed)."""
    lists = [r[STALENESS_COUNTS] for r in records if isinstance(r.get(STALENESS_COUNTS), list)]
    total = np.zeros(max((len(c) for c in lists), default=0))
    for counts in lists:
        total[: len(counts)] += counts
    return total


def ledger_summary(run_dir: Path) -> dict[str, Any] | None:
    """The ledger audit's counts (None without a ledger, e.g. a replay)."""
    if not ledger_path(run_dir).is_file():
        return None
    result = audit(run_dir)
    return {"ok": result.ok, "reissued": result.reissued, "dropped": dict(result.dropped)}


# The interval each held-out metric is logged with: (low, high) keys.
INTERVALS = {
    "eval/accuracy": ("eval/ci95_low", "eval/ci95_high"),
    "eval/mean_at_k": ("eval/mean_at_k_ci95_low", "eval/mean_at_k_ci95_high"),
}


def _eval_cell(record: dict[str, Any], key: str = "eval/accuracy") -> str:
    """``0.438 [0.320, 0.562] at step 0`` (runs logged before the interval: ± stderr)."""
    low, high = (record.get(k) for k in INTERVALS[key])
    cell = f"{record[key]:.3f}"
    if low is not None and high is not None:
        cell += f" [{low:.3f}, {high:.3f}]"
    elif key == "eval/accuracy" and "eval/stderr" in record:
        cell += f" ± {record['eval/stderr']:.3f} (stderr)"
    return f"{cell} at step {record['step']}"


def _eval_rows(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    evals = [r for r in records if isinstance(r.get("eval/accuracy"), int | float)]
    if not evals:
        return [
            (
                "held-out accuracy",
                "not evaluated (evaluate=true, or eval_every=N, scores the test split)",
            )
        ]
    first, last = evals[0], evals[-1]
    where = f"{int(last.get('eval/num_prompts', 0))} {EVAL_SPLIT} prompts"
    label = "held-out pass@1 [95% CI]"
    if first is last:
        return [(label, f"{_eval_cell(last)} ({where})")]
    change = last["eval/accuracy"] - first["eval/accuracy"]
    rows = [(label, f"{_eval_cell(first)} -> {_eval_cell(last)} ({change:+.3f}, {where})")]
    if all("eval/finished_frac" in r for r in (first, last)):
        rows.append(("held-out answers finished", f"{_finished(first)} -> {_finished(last)}"))
    if "eval/mean_at_k" in first and "eval/mean_at_k" in last:
        k = int(last["eval/k"])
        rows.append(
            (
                f"held-out mean@{k} [95% CI]",
                f"{_eval_cell(first, 'eval/mean_at_k')} -> {_eval_cell(last, 'eval/mean_at_k')}",
            )
        )
    return rows


def _finished(record: dict[str, Any]) -> str:
    """``53% (0.833 of them right)``: how much of pass@1 is answering at all."""
    cell = f"{record['eval/finished_frac']:.0%}"
    if isinstance(record.get("eval/finished_accuracy"), int | float):
        cell += f" ({record['eval/finished_accuracy']:.3f} of them right)"
    return cell


def _steps(steps: np.ndarray) -> str:
    """``steps 1-5`` or ``step 3``."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def report_rows(
    records: Sequence[dict[str, Any]],
    config: dict[str, Any],
    *,
    ledger: dict[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """The report's (label, value) rows from a run's records and config (as saved)."""
    trained = [r for r in records if r["step"] >= 1]
    rows = _eval_rows(records)

    steps, reward = series(trained, REWARD)
    if len(reward):
        k = reward_window(len(reward))
        rows.append(
            (
                f"training {REWARD}",
                f"{reward[:k].mean():.3f} ({_steps(steps[:k])}) -> "
                f"{reward[-k:].mean():.3f} ({_steps(steps[-k:])})",
            )
        )
    rows.append(("rewards scored by", _scorer(trained, config)))
    planned = config.get("steps")
    last = trained[-1] if trained else {}
    skipped = int(last.get("step/skipped_total", 0))
    done = f"{last.get('step', 0)} of {planned}" + (f" ({skipped} skipped)" if skipped else "")
    rows.append(("steps", done))

    if records:
        first = records[0]
        own = first.get("time/eval_s" if first["step"] == 0 else "time/step_s", 0.0)
        wall = records[-1]["wall_time"] - (first["wall_time"] - own)
        _, evals = series(records, "time/eval_s")
        _, compiling = series(records, "time/compile_s")
        parts = f"held-out evaluation {_duration(evals.sum())}"
        if len(compiling):  # what a re-run with the compilation cache saves most of
            parts += f", compiling {_duration(compiling.sum())}"
        rows.append(("wall time", f"{_duration(wall)} ({parts})"))
    _, rss = series(records, "mem/peak_rss_gb")
    _, device = series(records, "mem/device_peak_gb")
    _, reward_model = series(records, "mem/reward_model_gb")
    if len(rss):
        memory = f"{rss.max():.2f} GiB resident (process)"
        if len(device):
            memory += f", {device.max():.2f} GiB on the device"
        if len(reward_model):
            memory += f"; reward model weights {reward_model.max():.2f} GiB"
        rows.append(("peak memory", memory))

    counts = staleness_counts(trained)
    system, algo = config.get("system", {}), config.get("algo", {})
    try:
        eta = staleness_bound(
            system.get("mode"), system.get("max_staleness"), algo.get("num_minibatches", 1)
        )
    except (ValueError, TypeError):
        eta = None
    bound = f" (bound η = {eta})" if eta is not None else ""
    if counts.sum() > 0:
        d = np.arange(len(counts))
        shares = " ".join(f"{100 * c / counts.sum():.0f}%" for c in counts)
        rows.append(
            (
                "staleness of trained tokens",
                f"max {int(d[counts > 0].max())}{bound}, mean "
                f"{float((d * counts).sum() / counts.sum()):.2f}; at d = 0..{len(counts) - 1}: "
                f"{shares}",
            )
        )
    else:
        _, worst = series(trained, "staleness/max")
        if len(worst):
            rows.append(("staleness of trained tokens", f"max {int(worst.max())}{bound}"))

    demand = _demand(trained, system.get("mode"))
    if demand is not None:
        rows.append(("which side waited", demand))
    host_time = _host_time(trained)
    if host_time is not None:
        rows.append(("host's time per step", host_time))
    rows.append(("groups dropped / re-issued", _drops(last, ledger)))
    return rows


# The report's reading of a run's demand (docs/training.md, "Which side waited").
WAITS = 0.2  # the trainer waiting this share of its steps: generation holds it back
HOST_BUSY = 0.7  # the host serving less than this share while the trainer hardly waits: idle
LOCKSTEP_MODES = ("sync", "periodic")  # each side waits for the other by design


def _demand(trained: Sequence[dict[str, Any]], mode: str | None) -> str | None:
    """The trainer's share of its step time spent waiting for rollouts and the host's
    share of it spent serving (medians of ``time/wait_frac`` and ``host/busy_frac`` over
    steps 2 on: step 1 compiles), and what they say: generation-bound (more hosts, or
    inference devices, shorten the steps), training-bound (the host idles: more trainer
    devices, or a larger η, would use it), or both busy. None for runs without the
    figures (a replay, older runs)."""
    later = [r for r in trained if r["step"] >= 2] or list(trained)
    _, wait = series(later, "time/wait_frac")
    _, busy = series(later, "host/busy_frac")
    if not len(wait) or not len(busy):
        return None
    wait_m, busy_m = float(np.median(wait)), float(np.median(busy))
    text = f"trainer waited {100 * wait_m:.0f} % of its steps, host served {100 * busy_m:.0f} %"
    if mode in LOCKSTEP_MODES:
        return text + f" ({mode}: each side waits for the other by design)"
    if wait_m >= WAITS:
        return text + ": generation-bound (more hosts would shorten the steps)"
    if busy_m < HOST_BUSY:
        return text + ": training-bound (the host idles; more trainer devices would use it)"
    return text + ": both busy"


def _host_time(trained: Sequence[dict[str, Any]]) -> str | None:
    """Where the host's time went per step: the mean of each ``host/<part>_s`` over steps
    2 on (step 1 compiles), largest first, with its share of them all; then the mean of
    ``host/decode_steps`` and the decode_wait per decode step, where the host counts its
    steps. None for runs without the figures (a replay, older runs)."""
    later = [r for r in trained if r["step"] >= 2] or list(trained)
    means = {}
    for part in (*LOOP_PARTS, "idle"):
        _, seconds = series(later, f"host/{part}_s")
        if len(seconds):
            means[part] = float(seconds.mean())
    total = sum(means.values())
    if not means or total <= 0:
        return None
    ranked = sorted(means.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{part} {s:.3g} s ({100 * s / total:.0f} %)" for part, s in ranked)
    _, steps = series(later, "host/decode_steps")
    if len(steps) and steps.mean() > 0 and "decode_wait" in means:
        each_ms = 1e3 * means["decode_wait"] / steps.mean()
        text += f"; {steps.mean():.3g} decode steps, decode_wait {each_ms:.3g} ms each"
    return text


def _scorer(trained: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """What scored the run (``reward/scorer`` of the steps, name@version; before the reward
    stage recorded it, ``task.reward`` of the config) and the seconds spent scoring
    (``time/reward_s``; none in a replay, whose rewards are the recorded ones)."""
    labels = sorted({r.get("reward/scorer") for r in trained} - {None})
    text = ", ".join(labels) or str(config.get("task", {}).get("reward", "verifier"))
    _, seconds = series(trained, "time/reward_s")
    if len(seconds):
        text += f" ({seconds.sum():.1f} s scoring, {seconds.mean():.2f} s per step)"
    _, gold = series(trained, "reward/gold_score_mean")
    if len(gold):
        k = reward_window(len(gold))
        text += f"; gold (verifier) score {gold[:k].mean():.3f} -> {gold[-k:].mean():.3f}"
    return text


def _drops(last: dict[str, Any], ledger: dict[str, Any] | None) -> str:
    """Dropped groups by reason (the queue's counters, cumulative over resumes), re-issued
    groups (the ledger's after a resume; the pool's after a host failure or as a host left),
    the audit."""
    prefix = "queue/dropped_groups/"
    reasons = {k[len(prefix) :]: v for k, v in last.items() if k.startswith(prefix) and v}
    dropped = int(last.get("queue/dropped_total", sum(reasons.values())))
    text = f"{dropped} dropped"
    if reasons:
        text += " (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")"
    reissued = []
    if ledger is not None:
        reissued.append(f"{ledger['reissued']} re-issued after a resume")
    if "hosts/reissued_requests" in last:
        reissued.append(f"{int(last['hosts/reissued_requests'])} after a host failure")
    if last.get("hosts/reissued_on_leave"):
        reissued.append(f"{int(last['hosts/reissued_on_leave'])} handed back by a host that left")
    if reissued:
        text += "; " + ", ".join(reissued)
    if ledger is not None:
        text += f"; exactly-once ledger audit {'OK' if ledger['ok'] else 'FAILED'}"
    return text


# ---------------------------------------------------------------------------------------
# The figures (matplotlib, no pyplot state: the same Figure objects as analysis/plots.py).


def _figure(ncols: int = 1):
    from matplotlib.figure import Figure

    # Fixed margins (inches) for the labels the figures hold: a constrained layout would
    # draw each figure twice at the end of every run (docs/development.md, "Measured").
    width, height, left, right, gap = 5.2 * ncols, 3.4, 0.75, 0.2, 0.9
    axes_width = (width - left - right - gap * (ncols - 1)) / ncols
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=0.55 / height,
        top=1 - 0.35 / height,
        wspace=gap / axes_width,  # matplotlib's gap is a fraction of one axes' width
    )
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` points (the first points average what exists)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    return (sums[index] - sums[start]) / (index - start)


def run_figures(records: Sequence[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """The report's figures by file name (:data:`FIGURES`)."""
    trained = [r for r in records if r["step"] >= 1]
    figures = {}

    fig, (ax,) = _figure()
    steps, reward = series(trained, REWARD)
    ax.plot(steps, reward, color="C0", alpha=0.35, linewidth=1, label="per step")
    ax.plot(steps, _moving_average(reward, 5), color="C0", linewidth=2, label="moving avg 5")
    ax.set(xlabel="step", title=REWARD)
    ax.legend(fontsize=8)
    figures["reward.png"] = fig

    fig, (ax,) = _figure()
    evals = [r for r in records if isinstance(r.get("eval/accuracy"), int | float)]
    if evals:
        at = np.array([r["step"] for r in evals])
        acc = np.array([r["eval/accuracy"] for r in evals])
        low = np.array([r.get("eval/ci95_low", a) for r, a in zip(evals, acc, strict=True)])
        high = np.array([r.get("eval/ci95_high", a) for r, a in zip(evals, acc, strict=True)])
        ax.errorbar(at, acc, yerr=[acc - low, high - acc], marker="o", capsize=4)
        ax.set_ylim(0, 1)
    else:
        ax.text(0.5, 0.5, "not evaluated", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="step (0 = before training)", title=f"held-out pass@1 ({EVAL_SPLIT} split)")
    figures["eval_accuracy.png"] = fig

    fig, (ax,) = _figure()
    steps, entropy = series(trained, ENTROPY)
    ax.plot(steps, entropy, marker=".")
    ax.set(xlabel="step", title=ENTROPY)
    figures["entropy.png"] = fig

    fig, (left, right) = _figure(2)
    counts = staleness_counts(trained)
    if counts.sum() > 0:
        left.bar(np.arange(len(counts)), counts / counts.sum(), width=0.8)
        left.set_xticks(np.arange(len(counts)))
    left.set(xlabel="staleness d (optimizer versions)", ylabel="fraction of trained tokens")
    left.set_title("over the run", fontsize=10)
    for key, style in (("staleness/mean", "-"), ("staleness/max", "--")):
        steps, values = series(trained, key)
        right.plot(steps, values, style, label=key)
    right.set(xlabel="step")
    right.set_title("per step", fontsize=10)
    right.legend(fontsize=8)
    figures["staleness.png"] = fig
    for fig in figures.values():
        for ax in fig.axes:
            ax.grid(alpha=0.3)
    return figures
