"""Asynchronous RLHF's off-policy robustness at toy scale: Online DPO vs PPO vs RLOO at N = 1..8.

Command:  nice -n 5 python scripts/run_sweep.py experiments/offpolicy_robustness_toy.py --prune
          python -m a3po_jax.cli.results results/offpolicy_robustness_toy \
              --out results/offpolicy_robustness_toy
          (one run: a3po-train experiments/offpolicy_robustness_toy.py algo.loss=dpo \
           algo.num_minibatches=4 rollout.groups_per_step=32 steps=9)
Hardware: a 2-core CPU (shared with other jobs), no accelerator; 3-15 s per run once
          run_sweep.py's JAX compilation cache is warm: 2 min 40 s for the 36 runs.
What it shows: the claim of Noukhovitch et al., "Asynchronous RLHF" (arXiv 2410.18252,
          §3.3): as the data gets more off-policy, Online DPO loses the least reward of
          Online DPO, PPO and RLOO. Off-policyness is the paper's N: one generation of
          N minibatches from the current policy, then N optimizer steps on them, so
          minibatch k is trained on data k - 1 versions old. As in the paper the
          minibatch (8 prompts x 2 samples = 16 sequences) and the total number of
          optimizer steps (UPDATES = 32) are the same for every N: a run generates 8·N
          prompts per step for UPDATES / N steps, so every run trains on the same number
          of prompts (256 before the last step) with the same 32 optimizer steps; only
          how stale the data is changes with N (synchronous generation,
          algo.num_minibatches = N; not the η of the asynchronous modes). One more step
          (UPDATES / N + 1 in all) samples from the policy after exactly 32 updates, so
          every N's reward curve, read against the version that generated it
          (a3po_jax.analysis.offpolicy.generating_versions), ends at the same policy
          version; the final reward is the mean over the samples generated at versions
          24-32, the area under the curve is over versions 0-32.
          algo.track_ref_kl logs kl/ref_k3, the k3 estimate of KL(π_θ ‖ π_init) on the
          trained tokens, for the paper's reward-vs-KL frontier; it is a metric only (no
          KL term in any loss here).
The losses:
            * dpo   Online DPO (algo.loss=dpo, β = 0.1, reference = the initial policy),
                    pairs = the 2 samples of each prompt, chosen = the higher reward.
                    Two samples per prompt (rollout.group_size = 2), not best/worst of a
                    larger group: the DPO batching (core.batching.build_batch) takes
                    groups of exactly 2, and the paper's Online DPO samples 2 per prompt.
                    Pairs with equal rewards carry no preference and are masked.
            * ppo   PPO with the recomputed proximal policy (algo.prox=recompute, the
                    decoupled loss: prox = the step's starting weights, one extra
                    no-grad forward), group-normalised advantages, no value network. In
                    synchronous generation the step's starting weights generated the
                    batch, so the N minibatches are clipped against the generating
                    policy, as PPO's N minibatches are in the paper.
            * rloo  the same decoupled clipped loss with leave-one-out advantages
                    (algo.advantage=rloo; with 2 samples these are ±(R_i − R_j)).
          All three see the same prompts (group_size 2, kept for PPO and RLOO too).
          Seeds 0, 1, 2 (data order and sampling; the same initial weights).
Differences from the paper (say so when citing): a tiny random 2-layer model and the
          `letters` toy task with a verifiable reward (fraction of the completion's
          characters equal to the asked-for letter) replace Pythia on TL;DR with a learned
          reward model; no SFT start; 32 optimizer steps of 16 samples; N up to 8, not 64;
          the same learning rate for the three losses (not tuned per loss).
Parent:   experiments/a3po_compare_toy.py (model, task, max_new_tokens, temperature);
          changes: 2 samples per prompt, 8·N prompts per step, synchronous generation
          (system.mode=sync, max_staleness 0), prox=recompute, UPDATES / N + 1 steps,
          algo.track_ref_kl, per SWEEP the loss, N and seed. The learning rate stays
          3e-3: at N = 1 the reward climbs from 0.01 to about 0.5 in 32 updates (1e-3
          reached only 0.09), neither at 0 nor saturated.
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

UPDATES = 32  # optimizer steps per run, the same for every N (as in the paper)
PROMPTS_PER_MINIBATCH = 8  # 16 sequences per optimizer step
LOSSES = {
    "dpo": {"algo.loss": "dpo", "algo.advantage": "grpo"},
    "ppo": {"algo.loss": "ppo", "algo.advantage": "grpo"},
    "rloo": {"algo.loss": "ppo", "algo.advantage": "rloo"},
}
OFF_POLICYNESS = (1, 2, 4, 8)
SEEDS = (0, 1, 2)


def offpolicy_sweep(
    off_policyness: tuple[int, ...],
    seeds: tuple[int, ...],
    *,
    updates: int,
    prompts_per_minibatch: int,
) -> list[dict]:
    """Every loss × N × seed (seed-major), with the minibatch (prompts_per_minibatch
    prompts) and the number of optimizer steps (updates) the same for every N, plus one
    step that samples from the policy after the last update. Shared with
    experiments/offpolicy_robustness_smollm2.py."""
    return [
        {
            **overrides,
            "algo.num_minibatches": n,
            "rollout.groups_per_step": prompts_per_minibatch * n,
            "steps": updates // n + 1,
            "seed": seed,
        }
        for seed in seeds
        for n in off_policyness
        for overrides in LOSSES.values()
    ]


SWEEP = offpolicy_sweep(
    OFF_POLICYNESS, SEEDS, updates=UPDATES, prompts_per_minibatch=PROMPTS_PER_MINIBATCH
)


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_toy.py"))
    return dataclasses.replace(
        parent,
        rollout=dataclasses.replace(
            parent.rollout, group_size=2, groups_per_step=PROMPTS_PER_MINIBATCH
        ),
        algo=AlgoSection(
            loss="ppo",
            prox="recompute",
            advantage="grpo",
            settings={"dpo": {"beta": 0.1}},
            track_ref_kl=True,
        ),
        optim=OptimSection(learning_rate=3e-3),
        system=SystemSection(mode="sync", max_staleness=0),
        steps=UPDATES + 1,
        run_dir="runs/offpolicy_robustness_toy",
    )
