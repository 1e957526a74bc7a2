"""Benchmark: steps per hour of sync, periodic, one_step_off and async (A-3PO and recompute)
on one workload, with generation beside training (shared) or on cores of its own (split).

    python scripts/bench_modes.py                                  # tiny model, both placements
    python scripts/bench_modes.py --experiment experiments/smollm2_chain_sum.py --steps 12 \\
        --placement split                                          # SmolLM2, split cores

Each mode runs as its own ``a3po-train EXPERIMENT`` process (same model, task, batch and
seed; ``system.mode`` and, for async, ``system.max_staleness`` and ``algo.prox`` differ):

* ``shared``: the embedded host, generation and training take turns on every core;
* ``split``: ``system.placement.inference_cores=N``, a local host process on N cores and the
  trainer on the rest, weights pushed in the background (docs/scale-out.md).

The first ``--warmup`` steps (compilation) are left out. Per mode it prints steps per hour,
generated and trained tokens per second, each side's busy fraction (trainer: train seconds
over wall time; host: its serving loop's working seconds over wall time), the seconds a step
is held by the weight push and the seconds a push takes to land, and the speed-up over the
sync run of the same placement. Beside them, the overlap bound from the sync run's own phases,
(G + T + P) / max(G, T + P): P the seconds a push takes to land, G the seconds a sync step
waits for its rollouts once the push has landed, T its train seconds (a sync step is
P + G + T; perfect overlap of generation with training and pushing would take the larger of
G and T + P). Then one JSON line with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import describe_machine  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# (label, overrides): the modes compared; async's η is --eta.
MODES = (
    ("sync", ("system.mode=sync",)),
    ("periodic", ("system.mode=periodic", "system.max_staleness=0")),
    ("one_step_off", ("system.mode=one_step_off",)),
    ("async a3po", ("system.mode=async", "algo.prox=a3po")),
    ("async recompute", ("system.mode=async", "algo.prox=recompute")),
)


def run_mode(args, placement: str, label: str, overrides: tuple[str, ...], tmp: Path) -> dict:
    """Runs one mode to completion in a child process; returns its summary."""
    run_dir = tmp / f"{placement}-{label.replace(' ', '-')}"
    extra = [f"system.placement.inference_cores={args.host_cores}"] if placement == "split" else []
    if "system.mode=async" in overrides:
        extra.append(f"system.max_staleness={args.eta}")
    cmd = [
        sys.executable, "-m", "a3po_jax.cli.train", args.experiment, *overrides, *extra,
        f"steps={args.steps}", "checkpoint_every=0", "evaluate=false", "eval_every=0",
        f"run_dir={run_dir}",
        *args.overrides,
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if done.returncode:
        sys.exit(f"{placement} {label} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir)[args.warmup :]
    first, last = records[0], records[-1]
    wall = sum(r["time/step_s"] for r in records)

    def delta(key: str) -> float:  # a cumulative counter over the timed steps
        return float(last.get(key, 0.0)) - float(first.get(key, 0.0))

    mean = lambda key: statistics.mean(float(r.get(key, 0.0)) for r in records)  # noqa: E731
    # What a push costs the step: the trainer is held for it (shared: the whole push).
    push_s = mean("host/push_s") if placement == "split" else mean("time/weight_push_s")
    return {
        "steps_per_hour": 3600.0 * len(records) / wall,
        "step_s": wall / len(records),
        "generated_tokens_per_s": delta("queue/generated_tokens") / wall,
        "trained_tokens_per_s": delta("queue/consumed_tokens") / wall,
        "trainer_busy": sum(r["time/train_s"] for r in records) / wall,
        "host_busy": delta("host/busy_s") / wall,
        "wait_rollouts_s": mean("time/wait_rollouts_s"),
        "train_s": mean("time/train_s"),
        "push_held_s": mean("time/weight_push_s"),
        "push_s": push_s,
        "staleness_max": max(r["staleness/max_observed"] for r in records),
        "staleness_tokens": staleness_histogram(records),
        "reward_mean": statistics.mean(r["reward/mean"] for r in records),
    }


def staleness_histogram(records: list[dict]) -> dict[str, int]:
    """Trained tokens per staleness value (versions), summed over ``records``."""
    total: dict[str, int] = {}
    for r in records:
        tokens = r.get("staleness/tokens") or {"values": [], "counts": []}
        for value, count in zip(tokens["values"], tokens["counts"], strict=True):
            total[str(value)] = total.get(str(value), 0) + int(count)
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", default="experiments/smoke_tiny.py")
    p.add_argument("--placement", default="shared,split", help="shared, split or both")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compilation)")
    p.add_argument("--eta", type=int, default=2, help="async's system.max_staleness")
    p.add_argument("--host-cores", type=int, default=1, help="split: the host's cores")
    p.add_argument("--modes", default=",".join(label for label, _ in MODES))
    p.add_argument("overrides", nargs="*", help="extra section.field=value for every run")
    args = p.parse_args(argv)
    wanted = args.modes.split(",")
    unknown = sorted(set(wanted) - {label for label, _ in MODES})
    if unknown or "sync" not in wanted:
        p.error(f"--modes takes sync and any of {[m for m, _ in MODES]}; got {unknown or wanted}")

    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement in args.placement.split(","):
            results[placement] = {}
            for label, overrides in MODES:
                if label in wanted:
                    summary = run_mode(args, placement, label, overrides, Path(tmp))
                    results[placement][label] = summary
                    print(f"{placement} {label}: {summary}", file=sys.stderr, flush=True)

    machine = describe_machine()
    print(
        f"{args.experiment}, {args.steps} steps ({args.warmup} left out), async η = {args.eta}; "
        f"{machine['cpu']} ({', '.join(machine['isa'])}), {os.cpu_count()} cores"
    )
    bounds = {}
    for placement, by_mode in results.items():
        sync = by_mode["sync"]
        t, push = sync["train_s"], sync["push_s"]
        # The wait starts once the push call returned; the push lands first, then generation.
        g = max(0.0, sync["wait_rollouts_s"] - (push - sync["push_held_s"]))
        bounds[placement] = (g + t + push) / max(g, t + push)
        where = f"host on {args.host_cores} core(s)" if placement == "split" else "one host"
        print(
            f"\n{placement} ({where}): sync phases G = {g:.2f} s, T = {t:.2f} s, "
            f"push P = {push:.2f} s; bound (G + T + P) / max(G, T + P) = {bounds[placement]:.2f}"
        )
        head = ("mode", "steps/h", "vs sync", "gen tok/s", "train tok/s", "trainer", "host")
        head += ("held s", "push s", "max d")
        print("".join(f"{h:>12}" if i else f"{h:<16}" for i, h in enumerate(head)))
        for label, r in by_mode.items():
            cells = (
                f"{r['steps_per_hour']:.0f}",
                f"{r['steps_per_hour'] / sync['steps_per_hour']:.2f}",
                f"{r['generated_tokens_per_s']:.0f}",
                f"{r['trained_tokens_per_s']:.0f}",
                f"{r['trainer_busy']:.0%}",
                f"{r['host_busy']:.0%}",
                f"{r['push_held_s']:.3f}",
                f"{r['push_s']:.3f}",
                f"{r['staleness_max']:.0f}",
            )
            print(f"{label:<16}" + "".join(f"{c:>12}" for c in cells))
    report = {"results": results, "bounds": bounds, "machine": machine, "args": vars(args)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
