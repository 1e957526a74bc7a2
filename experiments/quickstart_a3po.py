"""Quickstart (the README's main job): asynchronous A-3PO on SmolLM2-135M-Instruct, CPU.

Command:  a3po-train experiments/quickstart_a3po.py
Hardware: a 2-core laptop/CI CPU, embedded inference host in the same process; about
          4 minutes for 24 steps and the two held-out evaluations, loading and compiling
          included, about 4 GiB of memory (the figures: README, docs/performance.md).
          On a GPU add rollout.groups_per_step=32 and more steps.
What it shows: sums of two numbers of one or two digits (reasoning-gym basic_arithmetic,
          "+" only) trained asynchronously (η = 2, in-flight weight updates) with A-3PO's
          interpolated proximal policy (no extra forward pass; most trained tokens are two
          versions old, where α = 1/2). Greedy pass@1 on 128 test questions that training
          never draws (a tenth of the problem space, kept by a hash of the expression),
          before training and after the last step, through the run's own inference host,
          at a 128-token budget where the untrained model finishes over 90 % of its answers:
          the rise is answering right, not only answering (README, results/quickstart_a3po).
          It ends with the run's report (printed, and runs/quickstart_a3po/report.md with
          its plots).
Parent:   the defaults in a3po_jax/training/config.py; changes the model size- and
          memory-dependent knobs only, picks the task and η, and turns the held-out evaluation on.
"""

from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ModelSection,
    OptimSection,
    RolloutSection,
    RunSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)

# Sums of two numbers of one or two digits (about 10,000 questions); a tenth of them, chosen
# by a hash of the expression, is kept for the test split alone (docs/tasks.md).
ADDITIONS = (
    '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],'
    ' "allow_parentheses": false, "allow_negation": false, "holdout": 0.1}'
)


def config() -> TrainConfig:
    return TrainConfig(
        # Recompute each layer's activations in the backward pass: about 40 % less step memory
        # at the same speed on a CPU, which keeps the run at about 3.7 GiB (docs/performance.md).
        model=ModelSection(name="smollm2", remat=True),
        task=TaskSection(name="basic_arithmetic", options=ADDITIONS, format_reward=0.1),
        rollout=RolloutSection(
            group_size=4,
            groups_per_step=8,
            max_new_tokens=40,
            temperature=0.7,
            num_slots=16,
            prompt_buckets=(64, 128),
        ),
        algo=AlgoSection(prox="a3po", advantage="grpo"),
        optim=OptimSection(learning_rate=3e-5, warmup_steps=2),
        # Shared-prompt packing: each group's ~57-token prompt is encoded once for its 4
        # samples; two groups per row pad less when their lengths differ (docs/training.md).
        system=SystemSection(
            mode="async",
            # η = 2: tokens two versions old get A-3PO's α = 1/2 (at η = 1 it trains as naive PPO).
            max_staleness=2,
            update_policy="in_flight",
            batch=BatchSection(length_bucket=64, packed_prompts=True, groups_per_row=2),
            # Freed heap handed back four times as often as the default: a lower, steadier peak
            # for a few per cent more seconds per step (docs/performance.md, docs/log.md).
            run=RunSection(trim_heap_every_s=0.25),
        ),
        steps=24,
        seed=0,
        run_dir="runs/quickstart_a3po",
        checkpoint_every=10,
        # Greedy pass@1 on 128 test questions at step 0 and after step 24 (eval/*, report.md),
        # at a budget where the untrained model finishes over 90 % of its answers.
        evaluate=True,
        eval_prompts=128,
        eval_max_new_tokens=128,
    )
