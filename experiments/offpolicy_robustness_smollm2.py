"""Asynchronous RLHF's off-policy robustness on SmolLM2-135M: Online DPO vs PPO vs RLOO, N = 1, 4.

Command:  python scripts/run_sweep.py experiments/offpolicy_robustness_smollm2.py \\
              --subprocess --prune
          python -m a3po_jax.cli.results results/offpolicy_robustness_smollm2 \\
              --out results/offpolicy_robustness_smollm2
Hardware: a 2-core CPU, embedded inference host; about 2 minutes per run, 18 runs.
What it shows: the toy sweep's question (experiments/offpolicy_robustness_toy.py, whose
          docstring explains the design) at the smallest real scale: as the data gets
          more off-policy, does Online DPO lose the least reward of Online DPO, PPO and
          RLOO (Noukhovitch et al., arXiv 2410.18252, §3.3)? Off-policyness is the paper's
          N: one generation of N minibatches from the current policy, then N optimizer
          steps on them (synchronous generation, algo.num_minibatches = N), with the
          minibatch (8 prompts x 2 samples) and the number of optimizer steps (UPDATES)
          the same for every N, so only how stale the data is changes. One more step
          samples from the policy after exactly UPDATES updates; rewards are read against
          the version that generated them. algo.track_ref_kl logs kl/ref_k3 (KL to the
          initial policy) for the reward-vs-KL frontier.
The losses:  dpo (Online DPO, β = 0.1, pairs = the 2 samples of a prompt), ppo (decoupled
          clipped loss with the recomputed proximal policy: in synchronous generation the
          N minibatches are clipped against the generating policy, as PPO's are) and
          rloo (the same loss with leave-one-out advantages), as in the toy sweep.
Differences from the paper (say so when citing): SmolLM2-135M-Instruct on 2-term 1-digit
          sums with a verifiable reward instead of Pythia on TL;DR with a reward model;
          UPDATES optimizer steps of 16 sequences; N ∈ {1, 4} (the paper goes to 64); the
          quickstart's learning rate for all three losses (not tuned per loss).
Parent:   experiments/smollm2_chain_sum.py (model, task, lengths, temperature, learning rate,
          shared-prompt packing); changes: 2 samples per prompt, 8·N prompts per step,
          synchronous generation, prox=recompute, UPDATES / N + 1 steps, track_ref_kl,
          no checkpoints, and per SWEEP the loss, N and seed.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, import_experiment, load_experiment

# The toy sweep's design and losses (its offpolicy_sweep), at N = 1 and 4.
TOY = import_experiment(Path(__file__).with_name("offpolicy_robustness_toy.py"))
UPDATES = 16  # optimizer steps per run, the same for every N (as in the paper)
PROMPTS_PER_MINIBATCH = 8  # 16 sequences per optimizer step
SWEEP = TOY.offpolicy_sweep(
    (1, 4), (0, 1, 2), updates=UPDATES, prompts_per_minibatch=PROMPTS_PER_MINIBATCH
)


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("smollm2_chain_sum.py"))
    return dataclasses.replace(
        parent,
        # Without the quickstart's held-out evaluation, as the committed results were run.
        evaluate=False,
        rollout=dataclasses.replace(
            parent.rollout, group_size=2, groups_per_step=PROMPTS_PER_MINIBATCH
        ),
        algo=dataclasses.replace(
            parent.algo,
            loss="ppo",
            prox="recompute",
            settings={"dpo": {"beta": 0.1}},
            track_ref_kl=True,
        ),
        system=dataclasses.replace(parent.system, mode="sync", max_staleness=0),
        steps=UPDATES + 1,
        run_dir="runs/offpolicy_robustness_smollm2",
        checkpoint_every=0,
    )
