"""Staleness sweep at local scale: η ∈ {0, 1, 2, 4, 8} × {naive, decoupled, A-3PO} on
SmolLM2-135M-Instruct and 1-digit sums.

Command:  python scripts/run_sweep.py experiments/staleness_sweep_local.py
          python -m a3po_jax.cli.results results/staleness_sweep_local \
              --out results/staleness_sweep_local
          (one run: a3po-train experiments/staleness_sweep_local.py system.max_staleness=4
           algo.prox=behav run_dir=runs/sweep_local/behav_4)
Hardware: a 2-core CPU, no accelerator: 15 runs of 20 steps at roughly 30 s per step
          (the quickstart's rate) is about 2.5 hours; not run for the committed results
          (see experiments/staleness_sweep_toy.py for the toy-scale version that is). On
          one GPU with a separate inference host (scripts/launch.py gpu-node) the same
          sweep takes minutes and staleness then arises from real overlap.
What it shows: the shape of AReaL's staleness table (arXiv 2505.24298) on a real
          pretrained model: naive PPO (clip vs behaviour) expected to degrade with η,
          decoupled PPO and A-3PO expected to stay flatter.
Parent:   experiments/a3po_compare_local.py; changes steps 30 → 20 (the sweep has 15
          runs) and, per SWEEP, system.max_staleness and algo.prox.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

ETAS = (0, 1, 2, 4, 8)
PROXES = ("behav", "recompute", "a3po")
SWEEP = [{"algo.prox": prox, "system.max_staleness": eta} for eta in ETAS for prox in PROXES]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_local.py"))
    return dataclasses.replace(
        parent,
        # 15 runs must fit in about an hour on a 2-core CPU: half the batch, 8 steps.
        rollout=dataclasses.replace(parent.rollout, groups_per_step=4),
        steps=8,
        run_dir="runs/staleness_sweep_local",
    )
