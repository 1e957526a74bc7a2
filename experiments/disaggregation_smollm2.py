"""The papers' speed claims on one CPU: every training mode with generation on a core of its
own (split cores), 3 seeds each, and once each with generation beside training (shared).

Command:  python scripts/run_sweep.py experiments/disaggregation_smollm2.py --subprocess --prune
          python -m a3po_jax.cli.results results/disaggregation_smollm2 \\
              --out results/disaggregation_smollm2 --level 0.65
Hardware: a 2-core CPU. Split: the inference host is a local process pinned to core 0 and
          the trainer to core 1 (system.placement.inference_cores=1), weights pushed over the host's
          weight port in the background. Shared: the embedded host, both on both cores.
          4-9 minutes per run (split sync and periodic the longest), 20 runs.
What it shows: A-3PO (arXiv 2512.06547), Periodic Asynchrony (arXiv 2511.18871) and
          Asynchronous RLHF (arXiv 2410.18252) get their speed from overlapping generation
          with training on separate hardware. Per mode: steps per hour, reward against
          wall-clock time and the time to a fixed reward, with the seeds' spread; and the
          shared placement's figures on the same machine (docs/results.md).
Parent:   experiments/smollm2_chain_sum.py (model, task, batch, lengths, optimizer, 24 steps);
          per SWEEP: system.mode, algo.prox, system.max_staleness, the placement and seed.
          sync and periodic train on-policy GRPO (prox=behav, η = 0); one_step_off has η = 1
          by construction; async runs η = 1 as the quickstart does.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

SEEDS = (0, 1, 2)
MODES = (
    {"system.mode": "sync", "algo.prox": "behav", "system.max_staleness": 0},
    {"system.mode": "periodic", "algo.prox": "behav", "system.max_staleness": 0},
    {"system.mode": "one_step_off", "algo.prox": "a3po", "system.max_staleness": 1},
    {"system.mode": "async", "algo.prox": "a3po", "system.max_staleness": 1},
    {"system.mode": "async", "algo.prox": "recompute", "system.max_staleness": 1},
)
# Seed-major (an interrupted sweep holds whole seeds of every mode); the shared runs last.
CORES = "system.placement.inference_cores"
SWEEP = [{**mode, CORES: 1, "seed": seed} for seed in SEEDS for mode in MODES] + [
    {**mode, CORES: 0, "seed": 0} for mode in MODES
]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    # Without the quickstart's held-out evaluation, as the committed results were run.
    return dataclasses.replace(
        parent, run_dir="runs/disaggregation_smollm2", checkpoint_every=0, evaluate=False
    )
