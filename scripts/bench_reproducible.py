"""Benchmark: what reproducibility costs (docs/reproducibility.md). One workload, three ways:

* ``timed``: as configured, the host in a thread of its own;
* ``invariant``: ``rollout.batch_invariant=true system.consume_order=admission`` (bitwise
  reproducible in sync, periodic and one_step_off);
* ``lockstep``: ``system.lockstep_decode_steps=N`` (``--lockstep-steps``), the trainer
  driving its host: bitwise reproducible in every mode but periodic, async included.

    python scripts/bench_reproducible.py                                 # the SmolLM2 workload
    python scripts/bench_reproducible.py --experiment experiments/smoke_tiny.py --steps 12

Each run is its own ``a3po-train EXPERIMENT`` process (`bench_modes.run_mode`: checkpoints
and evaluation off, the first ``--warmup`` steps left out). The settings run in turn,
``--rounds`` times, so that drift in the machine's speed moves all alike. Per round it
prints steps per hour and the ratio to ``timed``; then the median ratios and the trained
tokens per staleness value of each setting (summed over the rounds: what asynchrony the
run kept), and one JSON line with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_common import describe_machine  # noqa: E402  (scripts/ is on sys.path)
from bench_modes import run_mode  # noqa: E402

INVARIANT = ("rollout.batch_invariant=true", "system.consume_order=admission")


def settings(lockstep_steps: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return (
        ("timed", ()),
        ("invariant", INVARIANT),
        ("lockstep", (f"system.lockstep_decode_steps={lockstep_steps}",)),
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", default="experiments/smollm2_chain_sum.py")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compilation)")
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, in turn")
    p.add_argument(
        "--lockstep-steps", type=int, default=64, help="decode steps per train step (lockstep)"
    )
    p.add_argument("overrides", nargs="*", help="extra section.field=value for every run")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    args.host_cores, args.eta = 1, None  # run_mode's split-placement and async knobs: unused

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            results = {}
            for label, overrides in settings(args.lockstep_steps):
                results[label] = run_mode(args, "shared", f"{label}-{i}", overrides, Path(tmp))
                rate = results[label]["steps_per_hour"]
                print(f"round {i + 1} {label}: {rate:.0f} steps/h", file=sys.stderr, flush=True)
            rounds.append(results)

    machine = describe_machine()
    print(
        f"{args.experiment}, {args.steps} steps ({args.warmup} left out), {args.rounds} rounds, "
        f"lockstep {args.lockstep_steps} decode steps per train step; {machine['cpu']} "
        f"({', '.join(machine['isa'])}), {os.cpu_count()} cores"
    )
    labels = [label for label, _ in settings(args.lockstep_steps)]
    print(f"{'round':<8}" + "".join(f"{label + ' steps/h':>20}" for label in labels))
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    for i, results in enumerate(rounds):
        base = results["timed"]["steps_per_hour"]
        cells = []
        for label in labels:
            rate = results[label]["steps_per_hour"]
            ratios[label].append(rate / base)
            cells.append(f"{rate:.0f} ({rate / base:.2f})")
        print(f"{i + 1:<8}" + "".join(f"{c:>20}" for c in cells))
    summary = {}
    for label in labels:
        tokens: dict[str, int] = {}
        for results in rounds:
            for value, count in results[label]["staleness_tokens"].items():
                tokens[value] = tokens.get(value, 0) + count
        summary[label] = {"median_ratio": statistics.median(ratios[label]), "staleness": tokens}
        print(
            f"{label}: median {summary[label]['median_ratio']:.2f} x timed; trained tokens by "
            f"staleness {tokens}"
        )
    report = {"rounds": rounds, "summary": summary, "machine": machine, "args": vars(args)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
