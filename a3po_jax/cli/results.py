"""Tables and plots of one or more runs: ``python -m a3po_jax.cli.results RUN... --out DIR``,
or the report of one run: ``python -m a3po_jax.cli.results RUN_DIR``.

CLI layer (entry points): nothing in the package imports it.

Examples::

    python -m a3po_jax.cli.results runs/quickstart_a3po     # one run: its report.md
    python -m a3po_jax.cli.results results/staleness_sweep_toy --out results/staleness_sweep_toy
    python -m a3po_jax.cli.results RUN_DIR [RUN_DIR ...] --out DIR [--last-k 5]

One run directory without ``--out``: prints the report ``a3po-train`` prints at the end of
a run and writes it to ``RUN_DIR/report.md`` with its PNGs
(:func:`a3po_jax.analysis.run_report.write_run_report`; no pandas needed). With ``--out``:
writes ``DIR/summary.md`` and the PNGs it links
(:func:`a3po_jax.analysis.report.write_summary`); a directory argument that is not itself a
run (no ``metrics.jsonl``) is searched recursively for runs. Needs the ``analysis`` extra
(pandas, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "python -m a3po_jax.cli.results"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tables and plots from run directories (config.json + metrics.jsonl).",
    )
    parser.add_argument("runs", nargs="+", help="run directories or folders holding runs")
    parser.add_argument(
        "--out",
        help="where summary.md and the PNGs go (without it, one run directory gets its report.md)",
    )
    parser.add_argument("--last-k", type=int, default=5, help="steps averaged for 'last-k'")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window (curves)")
    parser.add_argument(
        "--level",
        type=float,
        default=None,
        help="reward the speed table times each run to (default: 0.8 x the lowest"
        " configuration's mean last-k reward)",
    )
    parser.add_argument("--title", default=None, help="heading of summary.md")
    args = parser.parse_args(argv)
    if args.out is None:
        if len(args.runs) != 1 or not (Path(args.runs[0]) / "metrics.jsonl").is_file():
            parser.error("--out is required unless the one argument is a run directory")
        return run_report(args.runs[0])
    try:
        from a3po_jax.analysis.report import write_summary
        from a3po_jax.analysis.runs import load_runs
    except ImportError as err:
        print(f"{PROG}: {err} (pip install 'a3po_jax[analysis]')", file=sys.stderr)
        return 2
    try:
        runs = load_runs(args.runs)
    except FileNotFoundError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    title = args.title or f"Results: {', '.join(Path(p).name for p in args.runs)}"
    path = write_summary(
        runs, args.out, last_k=args.last_k, title=title, smooth=args.smooth, level=args.level
    )
    print(f"wrote {path} ({len(runs)} runs)")
    return 0


def run_report(run_dir: str) -> int:
    """Print one run's report and write its ``report.md`` (and PNGs) in the run directory."""
    from a3po_jax.analysis.run_report import write_run_report

    try:
        report = write_run_report(run_dir)
    except FileNotFoundError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    print(report.terminal())
    return 0


if __name__ == "__main__":
    sys.exit(main())
