"""Asynchronous RLHF's one-step-off training vs synchronous training, SmolLM2, 3 seeds.

Command:  python scripts/run_sweep.py experiments/one_step_off_vs_sync.py --subprocess --prune
          python -m a3po_jax.cli.results results/one_step_off_vs_sync \\
              --out results/one_step_off_vs_sync
Hardware: a 2-core CPU, embedded inference host; about 3 minutes per run, 6 runs.
What it shows: the claim of Noukhovitch et al., "Asynchronous RLHF" (arXiv 2410.18252),
          that generating batch t+1 while training on batch t (staleness exactly 1)
          reaches the same reward per step as synchronous training, at lower wall-clock.
          Compare reward/mean per step (same seeds: same prompts, same sampling seeds) and
          per wall-clock second (time/step_s). On one CPU generation and training share
          the same two cores (docs/performance.md), so the wall-clock gain cannot be the paper's.
          With one minibatch and d <= 1, A-3PO's proximal policy is the behaviour policy,
          so both modes train plain clipped PPO on group-normalised advantages.
Parent:   experiments/smollm2_chain_sum.py (model, task, batch, lengths, optimizer, 24 steps);
          changes only system.mode and seed, per SWEEP.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

MODES = ("sync", "one_step_off")
SEEDS = (0, 1, 2)
SWEEP = [{"system.mode": mode, "seed": seed} for seed in SEEDS for mode in MODES]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    # Without the quickstart's held-out evaluation, as the committed results were run.
    return dataclasses.replace(
        parent, run_dir="runs/one_step_off_vs_sync", checkpoint_every=0, evaluate=False
    )
