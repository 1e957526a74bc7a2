"""Benchmark: what reproducibility costs, steps per hour of one workload with and without
``rollout.batch_invariant=true system.consume_order=admission`` (docs/reproducibility.md).

    python scripts/bench_reproducible.py                                 # the quickstart
    python scripts/bench_reproducible.py --experiment experiments/smoke_tiny.py --steps 12

Each run is its own ``a3po-train EXPERIMENT`` process (`bench_modes.run_mode`: checkpoints
and evaluation off, the first ``--warmup`` steps left out). The two settings run in turn,
off then on, ``--rounds`` times, so that drift in the machine's speed moves both alike; it
prints each pair's steps per hour and ratio (on / off), the median ratio, and one JSON line
with the machine.
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

REPRODUCIBLE = ("rollout.batch_invariant=true", "system.consume_order=admission")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", default="experiments/quickstart_a3po.py")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compilation)")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("overrides", nargs="*", help="extra section.field=value for every run")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    args.host_cores, args.eta = 1, None  # run_mode's split-placement and async knobs: unused

    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            pair = {}
            for label, overrides in (("off", ()), ("on", REPRODUCIBLE)):
                pair[label] = run_mode(args, "shared", f"{label}-{i}", overrides, Path(tmp))
                print(
                    f"round {i + 1} {label}: {pair[label]['steps_per_hour']:.0f} steps/h",
                    file=sys.stderr,
                    flush=True,
                )
            pairs.append(pair)

    machine = describe_machine()
    print(
        f"{args.experiment}, {args.steps} steps ({args.warmup} left out), {args.rounds} rounds; "
        f"{machine['cpu']} ({', '.join(machine['isa'])}), {os.cpu_count()} cores"
    )
    head = (("off steps/h", 14), ("on steps/h", 14), ("on / off", 10), ("gen tok/s off/on", 20))
    print(f"{'round':<8}" + "".join(f"{h:>{w}}" for h, w in head))
    ratios = []
    for i, pair in enumerate(pairs):
        off, on = pair["off"], pair["on"]
        ratios.append(on["steps_per_hour"] / off["steps_per_hour"])
        gen = f"{off['generated_tokens_per_s']:.0f}/{on['generated_tokens_per_s']:.0f}"
        print(
            f"{i + 1:<8}{off['steps_per_hour']:>14.0f}{on['steps_per_hour']:>14.0f}"
            f"{ratios[-1]:>10.2f}{gen:>20}"
        )
    print(f"median on / off: {statistics.median(ratios):.2f}")
    report = {"pairs": pairs, "ratios": ratios, "machine": machine, "args": vars(args)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
