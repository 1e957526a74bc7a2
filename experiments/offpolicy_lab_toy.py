"""The off-policy lab at toy scale: stale data, several minibatches per batch, every method.

Command:  nice -n 5 python scripts/run_sweep.py experiments/offpolicy_lab_toy.py --prune
          python -m a3po_jax.cli.results results/offpolicy_lab_toy --out results/offpolicy_lab_toy
          (one run: a3po-train experiments/offpolicy_lab_toy.py algo.prox=behav)
Hardware: a 2-core CPU, no accelerator; 20-60 s per run once run_sweep.py's JAX
          compilation cache is warm.
What it shows: a stress regime in which asynchronous methods can be told apart. Each
          generated batch of 8·N prompts is trained in N = 4 minibatches (4 optimizer
          updates), the producer runs up to η = 4N - 1 = 15 updates ahead (about three
          batches), and the learning rate is high enough that the policy moves a lot
          between the batch that generated the data and the minibatch that trains on it.
          Every method sees the same prompts (2 samples per prompt, as Online DPO needs):
            * sync          system.mode=sync, prox=recompute (fresh data; the reference)
            * naive         async, prox=behav        (PPO clipped against the behaviour policy)
            * recompute     async, prox=recompute    (decoupled PPO, extra forward pass)
            * a3po          async, prox=a3po         (d in training steps, the paper's)
            * a3po_update   async, prox=a3po, a3po_staleness_unit=update (d in updates)
            * dpo           async, loss=dpo          (Online DPO, reference = initial policy)
            * m2po          async, loss=m2po         (second-moment mask, τ = 0.04, no clip)
            * gspo          async, loss=gspo, prox=recompute (sequence ratio and clip)
            * icepop        async, loss=icepop, prox=recompute (decoupled PPO with
                            IcePop's two-sided mask of π_prox/π_behav, [0.5, 5])
          seeds 0, 1 and 2 (data order and sampling; the same initial weights).
          algo.track_ref_kl logs kl/ref_k3, the KL to the initial policy (a metric only).
Parent:   experiments/a3po_compare_toy.py (model, task, 12 new tokens, temperature 1);
          changes: 2 samples x 8·N prompts per step, N = 4 minibatches, η = 15, the
          learning rate (LEARNING_RATE), UPDATES / N + 1 steps, track_ref_kl, per SWEEP the
          method and the seed.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import (
    AlgoSection,
    OptimSection,
    SystemSection,
    TrainConfig,
    load_experiment,
)

MINIBATCHES = 4  # optimizer updates per generated batch
PROMPTS_PER_MINIBATCH = 8  # 16 sequences per update
UPDATES = 48  # optimizer updates per run
LEARNING_RATE = 1e-2
MAX_STALENESS = 4 * MINIBATCHES - 1  # in optimizer versions: about three batches
METHODS = {
    "sync": {"system.mode": "sync", "system.max_staleness": 0, "algo.prox": "recompute"},
    "naive": {"algo.prox": "behav"},
    "recompute": {"algo.prox": "recompute"},
    "a3po": {"algo.prox": "a3po"},
    "a3po_update": {"algo.prox": "a3po", "algo.a3po_staleness_unit": "update"},
    "dpo": {"algo.loss": "dpo"},
    "m2po": {"algo.loss": "m2po"},
    "gspo": {"algo.loss": "gspo", "algo.prox": "recompute"},
    "icepop": {"algo.loss": "icepop", "algo.prox": "recompute"},
}
SEEDS = (0, 1, 2)

SWEEP = [{**overrides, "seed": seed} for seed in SEEDS for overrides in METHODS.values()]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_toy.py"))
    return dataclasses.replace(
        parent,
        rollout=dataclasses.replace(
            parent.rollout,
            group_size=2,
            groups_per_step=PROMPTS_PER_MINIBATCH * MINIBATCHES,
        ),
        algo=AlgoSection(
            loss="ppo",
            prox="a3po",
            advantage="grpo",
            settings={"dpo": {"beta": 0.1}},
            num_minibatches=MINIBATCHES,
            track_ref_kl=True,
        ),
        optim=OptimSection(learning_rate=LEARNING_RATE),
        system=SystemSection(mode="async", max_staleness=MAX_STALENESS, update_policy="in_flight"),
        steps=UPDATES // MINIBATCHES + 1,
        run_dir="runs/offpolicy_lab_toy",
    )
