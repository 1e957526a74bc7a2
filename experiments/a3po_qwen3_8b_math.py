"""A-3PO comparison at paper scale: Qwen3-8B on DAPO-style math (GPU/TPU).

Command:  a3po-train experiments/a3po_qwen3_8b_math.py model.name=/path/to/Qwen3-8B
          the other methods: algo.prox=recompute | algo.prox=behav |
          system.mode=sync algo.prox=behav (each with its own run_dir=...), or all four
          with python scripts/run_sweep.py experiments/a3po_qwen3_8b_math.py model.name=...
model.name: nothing is downloaded. Point it at your Hugging Face checkpoint directory of
          Qwen/Qwen3-8B; the default below is a placeholder path.
Data:     DAPO-style math as JSONL files you prepare (task "jsonl"): one record per line
          with "prompt" (the problem, or chat messages) and "answer" (the gold number or
          expression). The defaults point at data/dapo_math_17k.jsonl (train, e.g. an export
          of DAPO-Math-17k) and data/aime_2024.jsonl (test, 30 problems); change them with
          task.options='{"path": {"train": "...", "test": "..."}, "prompt_field": "prompt",
          "answer_field": "answer"}'. Completions are scored on their final answer
          (boxed, "Answer:", else the last number).
Hardware: sized for an 8-GPU node or a TPU slice, inference on its own devices. The
          trainer jits on one device today (Trainer does not place the model on a mesh
          yet), which is why params are stored in bfloat16 here: 8 B params + Adam moments
          in bf16 + gradients ≈ 64 GB before activations, just inside one 80 GB device
          with remat and micro-batches of 2 sequences; fp32 master weights need the
          sharded trainer. Not run for this repository's results (no GPU here).
Sizes:    after AReaL's larger math recipe (examples/math/boba_grpo.yaml: 16 samples per
          prompt, 32 prompts per step, 8192 new tokens, 4 minibatches per batch, clip 0.4
          → here DAPO's clip-higher 0.2/0.28, importance-weight cap 5, η = 4); lr 1e-6 as
          DAPO (arXiv 2503.14476) uses for its larger model; token-mean aggregation
          (DAPO's token-level loss); 32 concurrent decodes (the KV cache of 8704 tokens
          per slot is ≈ 1.3 GB at bf16).
Parent:   experiments/a3po_qwen25_1p5b_gsm8k.py in spirit (same comparison, SWEEP);
          built from the defaults.
"""

import json

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
    {"system.mode": "sync", "algo.prox": "behav"},
    {"system.mode": "async", "algo.prox": "recompute"},
    {"system.mode": "async", "algo.prox": "a3po"},
    {"system.mode": "async", "algo.prox": "behav"},
]

TASK_OPTIONS = {
    "path": {"train": "data/dapo_math_17k.jsonl", "test": "data/aime_2024.jsonl"},
    "prompt_field": "prompt",
    "answer_field": "answer",
    "name": "dapo_math",
}


def config() -> TrainConfig:
    return TrainConfig(
        model=ModelSection(
            name="checkpoints/Qwen3-8B",  # override: your HF checkpoint dir
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            remat=True,
        ),
        task=TaskSection(name="jsonl", options=json.dumps(TASK_OPTIONS)),
        rollout=RolloutSection(
            group_size=16,
            groups_per_step=32,
            max_new_tokens=8192,
            temperature=1.0,
            num_slots=32,
            prompt_buckets=(256, 512),
        ),
        algo=AlgoSection(
            prox="a3po",
            advantage="grpo",
            aggregation="token_mean",
            clip_eps=0.2,
            clip_eps_high=0.28,
            behav_weight_cap=5.0,
            num_minibatches=4,
        ),
        optim=OptimSection(learning_rate=1e-6, weight_decay=0.01, grad_clip=1.0),
        system=SystemSection(
            mode="async",
            max_staleness=4,
            update_policy="in_flight",
            micro_batch_size=2,
            length_bucket=512,
            rollout_timeout_s=7200.0,
        ),
        steps=400,
        seed=1,
        run_dir="runs/a3po_qwen3_8b_math",
        checkpoint_every=20,
        eval_every=20,
        eval_prompts=30,
    )
