"""Smoke run: a tiny random model learns the toy `letters` task in about ten seconds.

Command:  a3po-train experiments/smoke_tiny.py [system.mode=sync|one_step_off|async]
          (periodic: system.mode=periodic system.max_staleness=0)
Hardware: any CPU (about 10 s on a laptop, most of it compiling). Checks the whole pipeline
          (host, queue, staleness, train step) and that it learns: the random 2-layer
          model's reward (the fraction of completion characters that are the letter the
          prompt asks for) starts near 0.01 (uniform over ~99 characters) and climbs to
          ~0.15 in 20 steps; loss and gradient norm are non-zero from the first step (a
          reward spread within each group gives non-zero GRPO advantages).
Parent:   experiments/a3po_compare_toy.py (the tiny model, the `letters` task, 8 samples x
          4 prompts, 12 new tokens, learning rate 3e-3); changes: 20 steps instead of 40,
          η = 2 instead of 4, its own run_dir.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_toy.py"))
    return dataclasses.replace(
        parent,
        system=dataclasses.replace(parent.system, max_staleness=2),
        steps=20,
        run_dir="runs/smoke_tiny",
    )
