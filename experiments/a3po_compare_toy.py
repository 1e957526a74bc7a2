"""A-3PO comparison at toy scale: sync GRPO vs decoupled PPO vs A-3PO vs naive async PPO.

Command:  python scripts/run_sweep.py experiments/a3po_compare_toy.py --prune
          python -m a3po_jax.cli.results results/a3po_compare_toy --out results/a3po_compare_toy
          (one run: a3po-train experiments/a3po_compare_toy.py algo.prox=recompute)
Hardware: a 2-core CPU, no accelerator; 10-20 s per run once run_sweep.py's JAX
          compilation cache is warm (the first run compiles for ~40 s), about 4 minutes
          for the 12 runs.
What it shows: the A-3PO paper's comparison (arXiv 2512.06547) on a task a random
          2-layer model learns in tens of steps: `letters` (reward = fraction of the
          completion's characters equal to the asked-for letter). Same data order and
          seeds for every method; the asynchronous ones run at the same η = 4:
            * sync GRPO     system.mode=sync algo.prox=behav  (every token fresh)
            * decoupled PPO algo.prox=recompute               (extra forward pass)
            * A-3PO         algo.prox=a3po                    (the base config)
            * naive async   algo.prox=behav                   (PPO clip vs behaviour)
          each with seeds 0, 1 and 2 (data order and sampling; same initial weights).
Parent:   the defaults in a3po_jax/training/config.py; changes: the tiny random model (model.name
          = "tiny", character tokenizer), the toy task, a learning rate sized for a
          random model (3e-3), 8 samples x 4 prompts per step, 12 new tokens, 40 steps,
          η = 4, no checkpoints. Child: experiments/staleness_sweep_toy.py.
"""

from a3po_jax.training.config import (
    AlgoSection,
    ModelSection,
    OptimSection,
    RolloutSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)

SWEEP = [
    {"system.mode": mode, "algo.prox": prox, "seed": seed}
    for seed in (0, 1, 2)
    for mode, prox in (
        ("sync", "behav"),
        ("async", "recompute"),
        ("async", "a3po"),
        ("async", "behav"),
    )
]


def config() -> TrainConfig:
    return TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(name="letters"),
        rollout=RolloutSection(
            group_size=8,
            groups_per_step=4,
            max_new_tokens=12,
            temperature=1.0,
            num_slots=32,
            prompt_buckets=(64,),
        ),
        algo=AlgoSection(prox="a3po", advantage="grpo"),
        optim=OptimSection(learning_rate=3e-3),
        system=SystemSection(mode="async", max_staleness=4, update_policy="in_flight"),
        steps=40,
        seed=0,
        run_dir="runs/a3po_compare_toy",
        checkpoint_every=0,
    )
