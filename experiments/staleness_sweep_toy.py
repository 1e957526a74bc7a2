"""Staleness sweep at toy scale: η ∈ {0, 1, 2, 4, 8} for naive PPO, decoupled PPO and A-3PO.

Command:  python scripts/run_sweep.py experiments/staleness_sweep_toy.py --prune
          python -m a3po_jax.cli.results results/staleness_sweep_toy \
              --out results/staleness_sweep_toy
          (one run: a3po-train experiments/staleness_sweep_toy.py system.max_staleness=8
           algo.prox=behav)
Hardware: a 2-core CPU, no accelerator; 10-20 s per run once run_sweep.py's JAX
          compilation cache is warm (the first run compiles for ~40 s), about 10 minutes
          for the 45 runs.
What it shows: the shape of AReaL's staleness table (arXiv 2505.24298): with PPO clipped
          against the behaviour policy ("naive", algo.prox=behav) the reward should fall
          as η grows, while the decoupled loss (recompute) and A-3PO should stay flatter.
          η = 0 runs in "async" mode with max_staleness 0 (nothing is generated while the
          trainer trains), so only η changes along a row. Seeds 0, 1, 2 (data order and
          sampling; the same initial weights).
Parent:   experiments/a3po_compare_toy.py (same model, task, batch, learning rate and 40
          steps); changes only system.max_staleness, algo.prox and seed, per SWEEP.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

ETAS = (0, 1, 2, 4, 8)
PROXES = ("behav", "recompute", "a3po")
SEEDS = (0, 1, 2)
SWEEP = [
    {"algo.prox": prox, "system.max_staleness": eta, "seed": seed}
    for seed in SEEDS
    for eta in ETAS
    for prox in PROXES
]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_toy.py"))
    return dataclasses.replace(parent, run_dir="runs/staleness_sweep_toy")
