"""Periodic Asynchrony vs synchronous training on SmolLM2, 3 seeds (the CPU-scale check).

Command:  python scripts/run_sweep.py experiments/periodic_vs_sync_smollm2.py --subprocess --prune
          python -m a3po_jax.cli.results results/periodic_vs_sync_smollm2 \\
              results/a3po_vs_recompute_smollm2/mode-sync_* --out results/periodic_vs_sync_smollm2
          The synchronous baseline is the sync runs of experiments/a3po_vs_recompute_smollm2.py
          (the same config but system.mode and run_dir, tests/cli/test_experiments.py checks it),
          so this sweep runs only the 3 periodic runs; run that sweep first, or add
          {"system.mode": "sync", "seed": s} entries to SWEEP.
Hardware: a 2-core CPU, embedded inference host; about 3 minutes per run, 3 runs.
What it shows: Periodic Asynchrony (arXiv 2511.18871): weights synced only at the start of
          an iteration and each group folded into the gradient as soon as it finishes, so
          every token is on-policy (staleness 0) and the update equals the synchronous
          one up to summation order: the reward per step should match sync's within the
          seeds' spread. On one CPU generation and training share the same two cores
          (docs/performance.md), so the paper's ~2x throughput cannot show; compare time/step_s
          and time/wait_rollouts_s anyway. The paper-scale file is
          experiments/periodic_vs_sync.py (Qwen2.5-1.5B, GSM8K, two devices).
Parent:   experiments/smollm2_chain_sum.py (model, task, batch, lengths, optimizer, 24 steps);
          on-policy GRPO (algo.prox=behav, η = 0), system.mode=periodic, seed per SWEEP;
          periodic folds one group per packed row (groups_per_row is 1 there).
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

SEEDS = (0, 1, 2)
SWEEP = [{"system.mode": "periodic", "seed": seed} for seed in SEEDS]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    return dataclasses.replace(
        parent,
        # Without the quickstart's held-out evaluation, as the committed results were run.
        evaluate=False,
        algo=dataclasses.replace(parent.algo, prox="behav"),
        system=dataclasses.replace(parent.system, mode="periodic", max_staleness=0),
        run_dir="runs/periodic_vs_sync_smollm2",
        checkpoint_every=0,
    )
