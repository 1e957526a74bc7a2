"""Asynchronous RLHF: Online DPO vs PPO vs RLOO at increasing off-policyness.

Command:  python scripts/run_sweep.py experiments/async_rlhf_dpo.py
          one run: a3po-train experiments/async_rlhf_dpo.py algo.num_minibatches=4 \\
              run_dir=runs/async_rlhf_dpo/dpo_n4
          then  python -m a3po_jax.cli.results results/async_rlhf_dpo --out results/async_rlhf_dpo
Hardware: a 2-core CPU runs it (SmolLM2-135M, embedded inference host) at roughly
          10-20 s per step, so the 15-run sweep takes several hours; not run for the
          committed results. On a GPU add rollout.groups_per_step=64.
What it shows: the off-policy robustness result of Noukhovitch et al., "Asynchronous
          RLHF" (arXiv 2410.18252): Online DPO degrades least as the data gets more
          off-policy. Off-policyness is the paper's N: each generated batch is split into
          N minibatches, one optimizer step each, so minibatch k trains on data k
          versions old (algo.num_minibatches = N ∈ {1, 2, 4, 8}, synchronous generation).
          The paper's asynchronous setting (generate batch t+1 while training on batch
          t, staleness exactly 1) is the extra system.mode=one_step_off run per loss.
Differences from the paper (say so when citing): a verifiable reward (1-digit sums,
          reasoning-gym chain_sum) replaces TL;DR with a learned reward model, which
          cannot ship offline; "PPO" is the clipped policy-gradient loss against the
          behaviour policy with group-normalised advantages and no value network;
          "RLOO" is the same clipped loss with leave-one-out advantages (as in TRL's
          RLOOTrainer). With 2 samples per prompt (what DPO needs; kept for all three so
          they see the same data) those two advantages differ only in scale: GRPO gives
          ±1, RLOO ±(R_i − R_j).
Parent:   experiments/a3po_compare_local.py (model, task, learning rate); changes: 2
          samples x 8 prompts per step, synchronous generation, 30 steps, and per
          SWEEP the loss / advantage, algo.num_minibatches and system.mode.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import AlgoSection, SystemSection, TrainConfig, load_experiment

LOSSES = {
    "dpo": {"algo.loss": "dpo", "algo.advantage": "grpo"},
    "ppo": {"algo.loss": "ppo", "algo.advantage": "grpo"},
    "rloo": {"algo.loss": "ppo", "algo.advantage": "rloo"},
}
OFF_POLICYNESS = (1, 2, 4, 8)
SWEEP = [
    {**loss, "system.mode": "sync", "algo.num_minibatches": n}
    for n in OFF_POLICYNESS
    for loss in LOSSES.values()
] + [{**loss, "system.mode": "one_step_off", "algo.num_minibatches": 1} for loss in LOSSES.values()]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_compare_local.py"))
    return dataclasses.replace(
        parent,
        rollout=dataclasses.replace(parent.rollout, group_size=2, groups_per_step=8, num_slots=16),
        algo=AlgoSection(
            loss="dpo", prox="behav", advantage="grpo", settings={"dpo": {"beta": 0.1}}
        ),
        system=SystemSection(mode="sync", max_staleness=0),
        steps=30,
        run_dir="runs/async_rlhf_dpo",
    )
