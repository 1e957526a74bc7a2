"""A-3PO vs decoupled PPO (recompute) vs naive async PPO vs sync GRPO, SmolLM2, 3 seeds.

Command:  python scripts/run_sweep.py experiments/a3po_vs_recompute_smollm2.py --subprocess --prune
          python -m a3po_jax.cli.results results/a3po_vs_recompute_smollm2 \\
              --out results/a3po_vs_recompute_smollm2
Hardware: a 2-core CPU, embedded inference host; about 3 minutes per run, 21 runs
          (sync once per seed, the three asynchronous losses at η = 2 and η = 4).
What it shows: the A-3PO paper's comparison (Li, Wu and Shen, arXiv 2512.06547) at the
          smallest real scale, with seeds: reward per step and its area for A-3PO
          (proximal log-prob interpolated with α = 1/d), decoupled PPO (proximal policy
          from an extra forward pass), naive async PPO (clip against the behaviour policy)
          and synchronous GRPO; the realised staleness (staleness/mean, staleness/counts)
          and the train-phase time (time/train_s) of each, so that a3po / recompute is
          measured inside the same runs (the benchmark measures it side by side:
          scripts/bench_train_step.py). Same seed: same prompts and sampling seeds.
Parent:   experiments/smollm2_chain_sum.py (model, task, batch, lengths, optimizer, 24 steps);
          changes system.mode, algo.prox, system.max_staleness and seed, per SWEEP, and
          drops checkpoints.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

SEEDS = (0, 1, 2)
ETAS = (2, 4)
PROXES = ("a3po", "recompute", "behav")
# Seed-major, so an interrupted sweep holds whole seeds of every method.
SWEEP = [
    entry
    for seed in SEEDS
    for entry in (
        [{"system.mode": "sync", "algo.prox": "behav", "system.max_staleness": 0, "seed": seed}]
        + [
            {"system.mode": "async", "algo.prox": prox, "system.max_staleness": eta, "seed": seed}
            for eta in ETAS
            for prox in PROXES
        ]
    )
]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    # Without the quickstart's held-out evaluation, as the committed results were run.
    return dataclasses.replace(
        parent, run_dir="runs/a3po_vs_recompute_smollm2", checkpoint_every=0, evaluate=False
    )
