"""Benchmark: end-to-end steps per hour of sync, periodic, one_step_off and async (η = 2).

Same model, task, batch and hardware split for every mode; the first ``--warmup`` steps
(compilation) are excluded. Next to the measured speed-ups it prints the pipelining bound
``(G + T) / max(G, T)`` from the generate time G (what a sync step waits for rollouts) and
the train time T measured in the sync run (design §6).

    python scripts/bench_modes.py                        # tiny random model, CPU, ~3 min
    python scripts/bench_modes.py --model smollm2 --steps 6 --groups 4

On a CPU-only machine generation and training share the same cores, so overlap buys
little there (design §6); the bound shows what split devices could reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import numpy as np

from a3po_jax.training.config import (
    AlgoSection,
    ModelSection,
    RolloutSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

MODES = (("sync", 0), ("periodic", 0), ("one_step_off", 1), ("async", 2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | checkpoint path")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded (compilation)")
    p.add_argument("--groups", type=int, default=4, help="groups (prompts) per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prox", default="a3po")
    args = p.parse_args()

    base = TrainConfig(
        model=ModelSection(name=args.model),
        task=TaskSection(
            name="chain_sum",
            options='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        ),
        rollout=RolloutSection(
            group_size=args.group_size,
            groups_per_step=args.groups,
            max_new_tokens=args.max_new_tokens,
            num_slots=args.groups * args.group_size,
            prompt_buckets=(128, 256),
        ),
        algo=AlgoSection(prox=args.prox),
        system=SystemSection(length_bucket=128),
        steps=args.steps,
        checkpoint_every=0,
    )
    policy = load_policy(base.model)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, eta in MODES:
            cfg = dataclasses.replace(
                base,
                system=dataclasses.replace(base.system, mode=mode, max_staleness=eta),
                run_dir=f"{tmp}/{mode}",
            )
            Trainer(cfg, policy, console=False).run()
            records = read_metrics(cfg.run_dir)[args.warmup :]
            step_s = float(np.mean([r["time/step_s"] for r in records]))
            results[mode] = {
                "step_s": step_s,
                "steps_per_hour": 3600.0 / step_s,
                "wait_s": float(np.mean([r["time/wait_rollouts_s"] for r in records])),
                "train_s": float(np.mean([r["time/train_s"] for r in records])),
                "staleness_max": max(r["staleness/max_observed"] for r in records),
            }
            print(f"{mode}: {results[mode]}", flush=True)

    g = results["sync"]["wait_s"]  # a sync step waits for the whole batch to generate
    t = results["sync"]["train_s"]
    bound = (g + t) / max(g, t)
    print(
        f"\nmodel {args.model}; {args.groups}x{args.group_size} samples/step, "
        f"{args.max_new_tokens} new tokens; G = {g:.2f}s, T = {t:.2f}s (sync run)"
    )
    print(f"{'mode':<14}{'steps/hour':>12}{'vs sync':>10}{'max staleness':>15}")
    for mode, r in results.items():
        speedup = r["steps_per_hour"] / results["sync"]["steps_per_hour"]
        print(f"{mode:<14}{r['steps_per_hour']:>12.0f}{speedup:>10.2f}{r['staleness_max']:>15.0f}")
    print(f"pipelining bound (G + T) / max(G, T) = {bound:.2f}")
    print(json.dumps({"results": results, "bound": bound}))


if __name__ == "__main__":
    main()
