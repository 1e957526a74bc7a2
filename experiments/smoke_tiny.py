"""Smoke run: a tiny random model on 1-digit sums, seconds on a laptop CPU.

Command:  a3po-train experiments/smoke_tiny.py [system.mode=sync|periodic|one_step_off|async]
Hardware: any CPU. Checks the whole pipeline (host, queue, staleness, train step); the
random model learns nothing meaningful. Parent: none (the defaults in a3po_jax/training/config.py).
"""

from a3po_jax.training.config import (
    AlgoSection,
    ModelSection,
    RolloutSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)


def config() -> TrainConfig:
    return TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(
            name="chain_sum",
            options='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        ),
        rollout=RolloutSection(
            group_size=4, groups_per_step=2, max_new_tokens=8, num_slots=8, prompt_buckets=(256,)
        ),
        algo=AlgoSection(prox="a3po"),
        system=SystemSection(mode="async", max_staleness=2),
        steps=3,
        run_dir="runs/smoke_tiny",
        checkpoint_every=0,
    )
