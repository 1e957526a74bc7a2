"""A-3PO comparison at local scale: SmolLM2-135M-Instruct on 1-digit sums, on a CPU.

Command:  python scripts/run_sweep.py experiments/a3po_compare_local.py
          or one method at a time (each writes its own run_dir):
            a3po-train experiments/a3po_compare_local.py                      # A-3PO
            a3po-train experiments/a3po_compare_local.py algo.prox=recompute \\
                run_dir=runs/a3po_compare_local/recompute                    # decoupled PPO
            a3po-train experiments/a3po_compare_local.py algo.prox=behav \\
                run_dir=runs/a3po_compare_local/behav                        # naive async PPO
            a3po-train experiments/a3po_compare_local.py system.mode=sync algo.prox=behav \\
                run_dir=runs/a3po_compare_local/sync_grpo                    # sync GRPO
          then  python -m a3po_jax.cli.results runs/a3po_compare_local --out runs/a3po_compare_local
Hardware: a 2-core CPU, no accelerator, embedded inference host. The chain_sum workload (same
          model, task and batch) takes about 15 minutes for 30 steps there, so the
          4-run sweep is about an hour. Not run for the results committed in results/
          (those are the toy-scale files); on a GPU add rollout.groups_per_step=32.
What it shows: the A-3PO paper's comparison (arXiv 2512.06547) at the smallest real
          scale: same data order, seed and η = 2 for decoupled PPO (extra forward pass),
          A-3PO (interpolated proximal policy) and naive async PPO (clip vs behaviour),
          plus synchronous GRPO. SmolLM2 is right ~11 % of the time at temperature 1 on
          2-term 1-digit sums, so reward has room to rise.
Parent:   experiments/smollm2_chain_sum.py (model, task, batch, learning rate); changes η
          from 1 to 2, drops checkpoints, and adds SWEEP.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

SWEEP = [
    {"system.mode": "sync", "algo.prox": "behav"},
    {"system.mode": "async", "algo.prox": "recompute"},
    {"system.mode": "async", "algo.prox": "a3po"},
    {"system.mode": "async", "algo.prox": "behav"},
]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    return dataclasses.replace(
        parent,
        # Without the quickstart's held-out evaluation, as the committed results were run.
        evaluate=False,
        # Keep the parent's packing and length bucket: unpacked rows pay for every padded
        # token (docs/performance.md).
        system=dataclasses.replace(parent.system, max_staleness=2),
        steps=12,
        run_dir="runs/a3po_compare_local",
        checkpoint_every=0,
    )
