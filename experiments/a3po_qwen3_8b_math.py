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
          trainer shards the model over its devices (system.mesh.fsdp=-1: every device
          the host does not take); params are stored in bfloat16 so that the state (8 B
          params + Adam moments in bf16 + gradients ≈ 64 GB before activations) also fits
          one 80 GB device with remat and micro-batches of 2 sequences. Not run for this
          repository's results (no GPU or TPU here).
Sizes:    after AReaL's larger math recipe (examples/math/boba_grpo.yaml: 16 samples per
          prompt, 32 prompts per step, 8192 new tokens, 4 minibatches per batch, clip 0.4
          → here DAPO's clip-higher 0.2/0.28, importance-weight cap 5, η = 4); lr 1e-6 as
          DAPO (arXiv 2503.14476) uses for its larger model; token-mean aggregation
          (DAPO's token-level loss); 32 concurrent decodes (the KV cache of 8704 tokens
          per slot is ≈ 1.3 GB at bf16).
Parent:   experiments/a3po_qwen25_1p5b_gsm8k.py: the same comparison (its SWEEP of four
          methods, A-3PO as the base run, remat, the importance-weight cap 5 in "mask"
          mode, grad clip 1, seed 1, in-flight updates). Changes: the model (Qwen3-8B,
          bf16 params), the task (jsonl math instead of GSM8K), the sizes above (16 x 32
          samples, 8192 new tokens, 4 minibatches, micro-batches of 2, 32 slots), clip
          0.2/0.28, lr 1e-6, weight decay 0.01, η = 4, 400 steps, length buckets of 512,
          a 2 h rollout timeout, checkpoints and 30-problem evaluations every 20 steps.
"""

import dataclasses
import json
from pathlib import Path

from a3po_jax.training.config import TrainConfig, import_experiment, load_experiment

PARENT = Path(__file__).with_name("a3po_qwen25_1p5b_gsm8k.py")
SWEEP = import_experiment(PARENT).SWEEP

TASK_OPTIONS = {
    "path": {"train": "data/dapo_math_17k.jsonl", "test": "data/aime_2024.jsonl"},
    "prompt_field": "prompt",
    "answer_field": "answer",
    "name": "dapo_math",
}


def config() -> TrainConfig:
    parent = load_experiment(PARENT)
    replace = dataclasses.replace
    return replace(
        parent,
        model=replace(
            parent.model,
            name="checkpoints/Qwen3-8B",  # override: your HF checkpoint dir
            param_dtype="bfloat16",
        ),
        task=replace(parent.task, name="jsonl", options=json.dumps(TASK_OPTIONS)),
        rollout=replace(
            parent.rollout, group_size=16, groups_per_step=32, max_new_tokens=8192, num_slots=32
        ),
        algo=replace(parent.algo, clip_eps=0.2, clip_eps_high=0.28, num_minibatches=4),
        optim=replace(parent.optim, learning_rate=1e-6, weight_decay=0.01),
        system=replace(
            parent.system,
            max_staleness=4,
            batch=replace(parent.system.batch, micro_batch_size=2, length_bucket=512),
            hosts=replace(parent.system.hosts, rollout_timeout_s=7200.0),
        ),
        steps=400,
        run_dir="runs/a3po_qwen3_8b_math",
        checkpoint_every=20,
        eval_every=20,
        eval_prompts=30,
    )
