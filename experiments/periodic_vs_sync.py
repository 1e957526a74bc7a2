"""Periodic Asynchrony vs synchronous training: throughput at equal accuracy.

Command:  inference host on its own GPU, trainer on another (where the gain can show):
            python scripts/launch.py gpu-node experiments/periodic_vs_sync.py \\
                --trainer-gpus 0 --inference-gpus 1 model.name=/path/to/Qwen2.5-1.5B-Instruct
            python scripts/launch.py gpu-node experiments/periodic_vs_sync.py \\
                --trainer-gpus 0 --inference-gpus 1 system.mode=sync \\
                run_dir=runs/periodic_vs_sync/sync model.name=/path/to/Qwen2.5-1.5B-Instruct
          both in one go (embedded host): python scripts/run_sweep.py
              experiments/periodic_vs_sync.py model.name=/path/to/Qwen2.5-1.5B-Instruct
          CPU check of correctness only (2-core CPU, SmolLM2; see Hardware):
            python scripts/run_sweep.py experiments/periodic_vs_sync.py model.name=smollm2 \\
              task.name=chain_sum \\
              'task.options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}' \\
              rollout.groups_per_step=4 rollout.max_new_tokens=40 rollout.num_slots=16 \\
              rollout.prompt_buckets=64,128 system.batch.micro_batch_size=0 steps=20 \\
              eval_every=10 eval_prompts=32
What it shows: Periodic Asynchrony (arXiv 2511.18871, seeds 002/003): weights are synced
          only at the start of an iteration and the trainer folds each group into the
          gradient as soon as it finishes, so training overlaps the long tail of
          generation while every token stays on-policy: the update equals the
          synchronous one up to summation order, hence equal accuracy (compare the
          eval curves), and the time per step should drop (compare time/step_s and
          time/wait_rollouts_s; the paper reports ~2x from asynchrony on NPUs and GPUs).
          On one CPU both phases share the same cores, so expect no speed-up there
          (docs/performance.md): the CPU run checks correctness, not throughput.
Hardware: sized for 2 GPUs of 80 GB (one training, one serving) or a TPU slice with an
          inference VM. Not run for this repository's results (no GPU here). The CPU
          check takes about 15 minutes per mode on a 2-core CPU.
Parent:   experiments/a3po_qwen25_1p5b_gsm8k.py (model, GSM8K, batch, lengths, optimizer);
          changes: on-policy GRPO (algo.prox=behav, η = 0), mode "periodic" (SWEEP adds
          "sync"), micro-batches of 4 sequences (one group), 100 steps, evaluation every 20.
"""

import dataclasses
from pathlib import Path

from a3po_jax.training.config import (
    BatchSection,
    HostsSection,
    SystemSection,
    TrainConfig,
    load_experiment,
)

SWEEP = [{"system.mode": "periodic"}, {"system.mode": "sync"}]


def config() -> TrainConfig:
    parent = load_experiment(Path(__file__).with_name("a3po_qwen25_1p5b_gsm8k.py"))
    return dataclasses.replace(
        parent,
        algo=dataclasses.replace(parent.algo, prox="behav"),
        system=SystemSection(
            mode="periodic",
            max_staleness=0,
            # Periodic mode folds in one group (4 sequences) at a time, so a micro-batch
            # must divide the group, not just the batch.
            batch=BatchSection(micro_batch_size=4, length_bucket=parent.system.batch.length_bucket),
            hosts=HostsSection(rollout_timeout_s=parent.system.hosts.rollout_timeout_s),
        ),
        steps=100,
        eval_every=20,
        run_dir="runs/periodic_vs_sync",
    )
