"""Run an experiment file's SWEEP, one run after another, each in its own run directory.

    python scripts/run_sweep.py experiments/staleness_sweep_toy.py
    python scripts/run_sweep.py experiments/staleness_sweep_toy.py --out results/x --dry-run
    python scripts/run_sweep.py experiments/a3po_compare_toy.py --only prox-a3po_seed-0
    python scripts/run_sweep.py experiments/a3po_compare_toy.py steps=10   # extra overrides

Each SWEEP entry (see ``a3po_jax.analysis.sweeps``) runs as ``a3po-train EXPERIMENT <entry
overrides> <extra overrides> run_dir=OUT/<name>``, in this process, through
``a3po_jax.cli.train.main``. OUT defaults to ``results/<experiment file stem>``.

Resumable: a run whose ``metrics.jsonl`` already reaches ``steps`` is skipped; an
unfinished run continues from its last checkpoint (``--resume``) if it has one, and
otherwise starts over (its partial metrics and TensorBoard events are deleted first).
A failed run is reported and the sweep goes on; the exit status is 1 if any run failed.

``--subprocess`` runs each run in a child process instead, which gives its memory back when
it ends (use it for real models: SmolLM2 runs in one process grew it ~2.5 GB per run).

``--prune`` keeps only ``config.json`` and ``metrics.jsonl`` of each finished run (what the
repository commits under ``results/``). JAX's persistent compilation cache
(``--compile-cache``, or each run's own ``system.run.compile_cache_dir``) lets every run
after the first reuse the compiled train step and inference kernels: on a 2-core CPU that
cuts a tiny-model run's start-up from about a minute to about 20 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from a3po_jax.analysis.sweeps import completed_steps, is_complete, load_sweep, resolve
from a3po_jax.cli.train import LOG_LEVELS
from a3po_jax.training import compilation
from a3po_jax.training.config import ConfigError

KEEP_WHEN_PRUNED = ("config.json", "metrics.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run_sweep.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("experiment", help="experiment file with config() and SWEEP")
    parser.add_argument("overrides", nargs="*", help="extra section.field=value for every run")
    parser.add_argument("--out", default=None, help="parent of the run dirs (results/<stem>)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these run names")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--prune", action="store_true", help="keep only config.json + metrics.jsonl per run"
    )
    parser.add_argument(
        "--compile-cache",
        default=compilation.DEFAULT_DIR,
        help="JAX persistent compilation cache dir of every run ('' = each run's own "
        "system.run.compile_cache_dir); default %(default)s",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="passed to a3po-train",
    )
    parser.add_argument(
        "--subprocess",
        action="store_true",
        help="run each run in its own process (returns its memory when it ends: with "
        "SmolLM2, runs in one process grew it by ~2.5 GB each)",
    )
    return parser.parse_intermixed_args(argv)


def _run_in_subprocess(argv_run: list[str], cache_dir: str) -> int:
    """`a3po-train argv_run` in a child process sharing the persistent compile cache."""
    import subprocess

    env = dict(os.environ)
    if cache_dir:
        env.update(compilation.environment(Path(os.path.expanduser(cache_dir))))
    child = subprocess.Popen([sys.executable, "-m", "a3po_jax.cli.train", *argv_run], env=env)

    def forward(signum, frame):  # the run checkpoints and stops; the sweep stops after it
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_over(run_dir: Path) -> None:
    """Remove what an unfinished run without checkpoints left, so the new one starts clean."""
    for name in ("metrics.jsonl", "config.json"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)


def _prune(run_dir: Path) -> None:
    for child in run_dir.iterdir():
        if child.name in KEEP_WHEN_PRUNED:
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or Path("results") / Path(args.experiment).stem)
    try:
        runs = load_sweep(args.experiment)
    except ConfigError as err:
        print(f"run_sweep: {err}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {r.name for r in runs})
        if unknown:
            names = ", ".join(r.name for r in runs)
            print(f"run_sweep: unknown run(s) {unknown}; this sweep has: {names}", file=sys.stderr)
            return 2
        runs = [r for r in runs if r.name in args.only]

    # Validate every run before starting any: a typo in the last entry should not surface
    # an hour into the sweep.
    plans = []
    for run in runs:
        try:
            cfg, overrides = resolve(args.experiment, run, out, tuple(args.overrides))
        except ConfigError as err:
            print(f"run_sweep: {run.name}: config error: {err}", file=sys.stderr)
            return 2
        plans.append((run, cfg, overrides))

    # In this process only when the runs are: with --subprocess the children get the cache
    # through their environment, and this process (a test's, say) keeps its own settings.
    if not args.dry_run and args.compile_cache and not args.subprocess:
        compilation.enable(args.compile_cache, setting="--compile-cache")

    from a3po_jax.cli import train

    failed: list[str] = []
    sweep_start = time.perf_counter()
    for index, (run, cfg, overrides) in enumerate(plans, start=1):
        run_dir = Path(cfg.run_dir)
        tag = f"[{index}/{len(plans)}] {run.name}"
        if is_complete(cfg):
            print(f"{tag}: complete ({cfg.steps} steps), skipped", flush=True)
            continue
        # The same read-only test a3po-train refuses a fresh run with.
        resume = cfg.checkpoint_every > 0 and train.latest_checkpoint_step(run_dir) > 0
        argv_run = [args.experiment, *overrides]
        if args.log_level != "WARNING":
            argv_run += ["--log-level", args.log_level]
        if resume:
            argv_run.append("--resume")
        command = "a3po-train " + " ".join(argv_run)
        if args.dry_run:
            state = "resume" if resume else f"new (logged {completed_steps(run_dir)} steps)"
            print(f"{tag}: {state}\n  {command}", flush=True)
            continue
        if not resume and run_dir.exists():
            _start_over(run_dir)
        print(f"{tag}: {'resuming' if resume else 'starting'}\n  {command}", flush=True)
        start = time.perf_counter()
        try:
            if args.subprocess:
                status = _run_in_subprocess(argv_run, args.compile_cache)
            else:
                status = train.main(argv_run)
        except Exception as err:  # one bad run must not lose the rest of the sweep
            print(f"{tag}: FAILED with {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            status = 1
        elapsed = time.perf_counter() - start
        if status == 0 and is_complete(cfg):
            if args.prune:
                _prune(run_dir)
            print(f"{tag}: done in {elapsed:.0f}s", flush=True)
        elif status == 0:
            # A run that ends cleanly before its last step was stopped (SIGTERM): so is the
            # sweep. Running it again resumes (from the run's checkpoint if it has one).
            print(f"{tag}: stopped after {elapsed:.0f}s; sweep stopped", flush=True)
            failed.append(run.name)
            break
        else:
            print(f"{tag}: FAILED (status {status}) after {elapsed:.0f}s", flush=True)
            failed.append(run.name)
    if not args.dry_run:
        total = time.perf_counter() - sweep_start
        print(
            f"sweep finished in {total:.0f}s: {len(plans) - len(failed)} ok, {len(failed)} failed"
        )
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
