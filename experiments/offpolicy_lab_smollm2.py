"""The off-policy lab on SmolLM2-135M: the toy lab's stress regime on one-digit additions.

Command:  nice -n 5 python scripts/run_sweep.py experiments/offpolicy_lab_smollm2.py --subprocess \\
              --prune --out runs/offpolicy_lab_smollm2
          python -m a3po_jax.cli.results runs/offpolicy_lab_smollm2 --out runs/offpolicy_lab_smollm2
          (one run: a3po-train experiments/offpolicy_lab_smollm2.py algo.prox=behav \\
              run_dir=runs/offpolicy_lab_smollm2/naive)
Hardware: a 2-core CPU, embedded inference host; 9-12 minutes per run (13 steps of 64
          samples, held-out evaluation at the start and the end), so the 27-run sweep is
          4-5 hours there; on a GPU raise PROMPTS_PER_MINIBATCH.
What it shows: whether the methods of experiments/offpolicy_lab_toy.py separate at LLM
          scale: each generated batch of 8·N prompts × 2 samples trains in N = 4
          minibatches and the producer runs up to η = 15 optimizer updates ahead, so the
          policy moves between the batch that generated the data and the minibatch that
          trains on it; the learning rate is the quickstart's (at 1e-4, tried on seed 0,
          naive and recompute both lose held-out accuracy: docs/results.md). Same METHODS and
          SEEDS as the toy lab; held-out greedy pass@1 (eval/accuracy) at the end and
          kl/ref_k3 compare them (docs/results.md).
Parent:   experiments/quickstart_a3po.py (model, lengths, temperature, packing, held-out
          evaluation); changes: the task of its committed runs (sums of two numbers from 0
          to 10, whose 64 test prompts share their questions with training), 64 evaluation
          prompts at the rollouts' budget, 2 samples × 8·N prompts per step, N = 4
          minibatches, η = 15, UPDATES / N + 1 steps, no checkpoints,
          track_ref_kl, per SWEEP the method (offpolicy_lab_toy.METHODS) and the seed.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TaskSection, TrainConfig, import_experiment, load_experiment

TOY = import_experiment(Path(__file__).with_name("offpolicy_lab_toy.py"))
MINIBATCHES = TOY.MINIBATCHES
PROMPTS_PER_MINIBATCH = TOY.PROMPTS_PER_MINIBATCH
UPDATES = TOY.UPDATES
METHODS = TOY.METHODS
SEEDS = TOY.SEEDS

# The task of the committed runs: sums of two numbers from 0 to 10 (121 questions), whose
# test split shares its questions with training (docs/results.md says what that means).
ADDITIONS_0_TO_10 = TaskSection(
    name="basic_arithmetic",
    options='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],'
    ' "allow_parentheses": false, "allow_negation": false}',
    format_reward=0.1,
)

SWEEP = [{**overrides, "seed": seed} for seed in SEEDS for overrides in METHODS.values()]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("quickstart_a3po.py"))
    toy = TOY.config()
    return dataclasses.replace(
        parent,
        rollout=dataclasses.replace(
            parent.rollout, group_size=2, groups_per_step=PROMPTS_PER_MINIBATCH * MINIBATCHES
        ),
        task=ADDITIONS_0_TO_10,
        algo=toy.algo,
        system=dataclasses.replace(parent.system, max_staleness=toy.system.max_staleness),
        steps=toy.steps,
        checkpoint_every=0,
        eval_prompts=64,
        eval_max_new_tokens=0,
        run_dir="runs/offpolicy_lab_smollm2",
    )
