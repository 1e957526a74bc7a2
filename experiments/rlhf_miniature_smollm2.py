"""Asynchronous RLHF in miniature: Online DPO, PPO and RLOO against a learned proxy reward.

Command:  the proxy first (pairs from the untrained policy, labelled by the gold verifier; a
          reward model trained on them from the policy's own weights), then the sweep:
          python -m a3po_jax.cli.make_preferences --task basic_arithmetic \
              --task-options "$(python -c 'import experiments.quickstart_a3po as q; \
              print(q.ADDITIONS)')" --model smollm2 --prompts 512 --samples 4 \
              --max-new-tokens 128 --out runs/rlhf_miniature/pairs.jsonl
          python -m a3po_jax.cli.train_reward --pairs runs/rlhf_miniature/pairs.jsonl \
              --model smollm2 --out runs/rlhf_miniature/reward_model --steps 200
          python scripts/run_sweep.py experiments/rlhf_miniature_smollm2.py --subprocess \
              --prune --out runs/rlhf_miniature/runs
          python -m a3po_jax.cli.results runs/rlhf_miniature/runs \
              --out runs/rlhf_miniature/runs
Hardware: a 2-core CPU, embedded inference host: the pairs and the reward model about an
          hour, then 6-8 minutes per run (24 steps of 32 samples, each scored by the
          reward model, and the gold evaluation of 128 test questions at the start and the
          end), about three hours for the 27. The proxy's pairs and record
          (`reward_model.json`: held-out pair accuracy 0.75 on 20 pairs) are in
          results/rlhf_miniature_smollm2/proxy/, the runs in .../runs/; their table, plot
          and verdicts: docs/results.md, "RLHF in miniature".
What it shows: the setting of Noukhovitch et al., "Asynchronous RLHF" (arXiv 2410.18252) at
          the scale of one CPU: the policy is trained against a learned reward model (the
          proxy), never the gold scorer, and judged by the gold scorer on test questions
          training never draws. Per run the record carries the proxy's reward
          (`reward/mean`), the gold scorer's on the same samples
          (`reward/gold_score_mean`: the gap is over-optimisation), the KL to the reference
          (`track_ref_kl`: the paper's x-axis), the held-out gold pass@1 (`eval/accuracy`)
          and the step times (steps per hour). The paper's claims to test: Online DPO the
          most robust to off-policy data, and asynchronous training as good per step while
          faster. Modes: sync, one_step_off (the paper's asynchronous setting, staleness 1)
          and async at η = 4 (further off-policy).
Differences from the paper (say so when citing): a verifiable task stands in for TL;DR so
          that the gold scorer runs offline; the proxy is SmolLM2-135M with a scalar head
          trained on pairs of the untrained policy's answers; "PPO" is the clipped policy
          gradient with group-normalised advantages and no value network, "RLOO" the same
          loss with leave-one-out advantages (experiments/async_rlhf_dpo.py).
Parent:   experiments/quickstart_a3po.py (model, task with its disjoint test split,
          evaluation of 128 test questions at 128 tokens); changes: the reward from the
          proxy (task.reward=model:REWARD_MODEL), temperature 1.0, 2 samples x 16 prompts
          per step, a KL penalty to the reference in the reward, track_ref_kl, 24 steps, no
          checkpoints, per SWEEP the loss, the mode and the seed.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import TrainConfig, load_experiment

REWARD_MODEL = "runs/rlhf_miniature/reward_model"  # what train_reward --out wrote
STEPS = 24
PROMPTS_PER_STEP = 16  # 2 samples each, as Online DPO needs: the same prompts for every loss
KL_COEF = 0.05  # the KL penalty in the reward (RLHF's), against the initial policy
LOSSES = {
    "dpo": {"algo.loss": "dpo", "algo.advantage": "grpo"},
    "ppo": {"algo.loss": "ppo", "algo.advantage": "grpo"},
    "rloo": {"algo.loss": "ppo", "algo.advantage": "rloo"},
}
MODES = {
    "sync": {"system.mode": "sync"},
    "one_step_off": {"system.mode": "one_step_off"},
    "async": {"system.mode": "async", "system.max_staleness": 4},
}
SEEDS = (0, 1, 2)

SWEEP = [
    {**loss, **mode, "seed": seed}
    for seed in SEEDS
    for loss in LOSSES.values()
    for mode in MODES.values()
]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("quickstart_a3po.py"))
    return dataclasses.replace(
        parent,
        task=dataclasses.replace(parent.task, reward=f"model:{REWARD_MODEL}"),
        rollout=dataclasses.replace(
            parent.rollout, temperature=1.0, group_size=2, groups_per_step=PROMPTS_PER_STEP
        ),
        algo=dataclasses.replace(
            parent.algo,
            prox="behav",
            kl_coef=KL_COEF,
            kl_in_reward=True,
            track_ref_kl=True,
            settings={"dpo": {"beta": 0.1}},
        ),
        steps=STEPS,
        checkpoint_every=0,
        run_dir="runs/rlhf_miniature/run",
    )
