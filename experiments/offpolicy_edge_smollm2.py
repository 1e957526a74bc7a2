"""The off-policy edge on SmolLM2-135M: where naive PPO on stale data falls below the start.

Command:  python scripts/run_sweep.py experiments/offpolicy_edge_smollm2.py --subprocess \
              --prune --out runs/edge --only prox-behav_seed-0 prox-behav_seed-1  # the pilot
          python scripts/run_sweep.py experiments/offpolicy_edge_smollm2.py --subprocess \
              --prune --out runs/edge                                    # then every method
          python -m a3po_jax.cli.results runs/edge --out runs/edge
Hardware: a 2-core CPU, embedded inference host; about 10 minutes per run (24 steps of 32
          samples, the evaluation of 128 test questions at the start and the end).
What it shows: whether the methods of experiments/offpolicy_lab_toy.py separate at LLM scale
          on a task whose test questions training never draws (the main job's: 1-2 digit
          additions, a tenth of the space held out), at temperature 1.0, with each generated
          batch trained in N = 4 minibatches and the producer up to η = 8 optimizer updates
          ahead. The point is chosen by a rule fixed before the runs: the first point of
          LADDER (extra overrides, tried in order) where naive PPO (prox = behav) ends below
          the untrained model's held-out pass@1 on both pilot seeds (PILOT) while its answers
          still finish (at least FINISHED_AT_END of them at the end, on both): a fall in what
          the policy answers, not a collapse past the edge for every method. Only there does
          the whole sweep (every method of the toy lab, seeds 0-2, more where seeds overlap)
          say anything about the methods. results.md reports each pilot whichever way it
          falls, and which part of the rule was added after which runs. A point after the
          first runs into its own --out folder, e.g.
          `run_sweep.py experiments/offpolicy_edge_smollm2.py optim.learning_rate=1e-4
          --subprocess --prune --out runs/edge_lr-1e-4 --only prox-behav_seed-0 ...` (the
          overrides before --only, which takes every name after it).
Parent:   experiments/quickstart_a3po.py (model, task, packing, evaluation of 128 test
          questions at 128 tokens); changes: temperature 1.0, 2 samples × 16 prompts per
          step, N = 4 minibatches per batch, η = 8 updates, 24 steps, no checkpoints,
          track_ref_kl, per SWEEP the method (offpolicy_lab_toy.METHODS and M2PO's two other
          readings) and the seed.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, import_experiment, load_experiment

TOY = import_experiment(Path(__file__).with_name("offpolicy_lab_toy.py"))
MINIBATCHES = 4  # optimizer updates per generated batch
MAX_STALENESS = 8  # η in optimizer updates: about two batches
STEPS = 24
PROMPTS_PER_STEP = 16  # 32 samples per generated batch, 8 per update
# The toy lab's methods, and M2PO's two other readings (losses.md: M2PO), as options.
METHODS = {
    **TOY.METHODS,
    "m2po_clip_side": {"algo.loss": "m2po", "algo.m2po.reading": "clip_side_mask"},
    "m2po_derived_clip": {"algo.loss": "m2po", "algo.m2po.reading": "derived_clip"},
}
SEEDS = (0, 1, 2)
PILOT_SEEDS = (0, 1)
# The points the pilot tries, in order: this file's settings, a learning rate 3x higher, then
# one between them (added, with FINISHED_AT_END, after every method collapsed at the second).
LADDER = ({}, {"optim.learning_rate": 1e-4}, {"optim.learning_rate": 5e-5})
FINISHED_AT_END = 0.9  # the rule's share of naive PPO's held-out answers that still finish

SWEEP = [{**overrides, "seed": seed} for seed in SEEDS for overrides in METHODS.values()]
# The runs the rule reads (run_sweep.py --only takes these names).
PILOT = [f"prox-behav_seed-{seed}" for seed in PILOT_SEEDS]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("quickstart_a3po.py"))
    return dataclasses.replace(
        parent,
        # 2 samples per prompt for every method, as Online DPO needs: the same prompts for all.
        rollout=dataclasses.replace(
            parent.rollout, temperature=1.0, group_size=2, groups_per_step=PROMPTS_PER_STEP
        ),
        algo=dataclasses.replace(
            parent.algo,
            num_minibatches=MINIBATCHES,
            track_ref_kl=True,
            settings={"dpo": {"beta": 0.1}},
        ),
        system=dataclasses.replace(parent.system, max_staleness=MAX_STALENESS),
        steps=STEPS,
        checkpoint_every=0,
        run_dir="runs/offpolicy_edge_smollm2",
    )
