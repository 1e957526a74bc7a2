"""A-3PO comparison at paper scale: Qwen2.5-1.5B-Instruct on GSM8K (GPU/TPU).

Command:  a3po-train experiments/a3po_qwen25_1p5b_gsm8k.py \\
              model.name=/path/to/Qwen2.5-1.5B-Instruct
          the other methods, same data and η (one run_dir each):
              ... algo.prox=recompute run_dir=runs/qwen25_gsm8k/recompute   # decoupled PPO
              ... algo.prox=behav run_dir=runs/qwen25_gsm8k/behav           # naive async
              ... system.mode=sync algo.prox=behav run_dir=runs/qwen25_gsm8k/sync_grpo
          or all four: python scripts/run_sweep.py experiments/a3po_qwen25_1p5b_gsm8k.py \\
              model.name=/path/to/Qwen2.5-1.5B-Instruct
          with the inference host on its own GPU: python scripts/launch.py gpu-node
              experiments/a3po_qwen25_1p5b_gsm8k.py --trainer-gpus 0 --inference-gpus 1 \\
              model.name=/path/to/Qwen2.5-1.5B-Instruct
model.name: nothing is downloaded. Point it at your Hugging Face checkpoint directory of
          Qwen/Qwen2.5-1.5B-Instruct (config.json, *.safetensors, tokenizer files); the
          default below is only a placeholder path. GSM8K comes from tensorflow-datasets
          (task "gsm8k"), which downloads it on first use (needs internet once).
Hardware: sized for 2 GPUs of 80 GB (H100/A100), one training and one serving, or a
          TPU v5e/v5p slice with a separate inference VM. The trainer jits on one device
          today (Trainer does not place the model on a mesh yet), so fp32 params + Adam
          (≈ 25 GB) + rematerialised activations in micro-batches of 16 must fit on one
          accelerator. Not run for this repository's results (no GPU here).
Sizes:    after AReaL's GSM8K GRPO example (inclusionAI/AReaL examples/math/gsm8k_grpo.yaml),
          the setup the A-3PO paper (arXiv 2512.06547) builds on: 256 prompts x 4 samples
          per step, 1024 new tokens, temperature 1, Adam lr 1.7e-5, weight decay 0.017,
          clip ε 0.4, importance-weight cap 5, max staleness η = 2, one minibatch per
          batch, ~10 epochs of GSM8K's 7473 training problems (300 steps). AReaL's reward
          scaling (x10, -0.5) is omitted: group-normalised advantages cancel it.
Parent:   the defaults in a3po_jax/training/config.py.
"""

from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    HostsSection,
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


def config() -> TrainConfig:
    return TrainConfig(
        model=ModelSection(
            name="checkpoints/Qwen2.5-1.5B-Instruct",  # override: your HF checkpoint dir
            param_dtype="float32",
            compute_dtype="bfloat16",
            remat=True,
        ),
        task=TaskSection(name="gsm8k", options="{}"),
        rollout=RolloutSection(
            group_size=4,
            groups_per_step=256,
            max_new_tokens=1024,
            temperature=1.0,
            num_slots=256,
            prompt_buckets=(256, 512),
        ),
        algo=AlgoSection(
            prox="a3po",
            advantage="grpo",
            clip_eps=0.4,
            behav_weight_cap=5.0,
            cap_mode="mask",
            num_minibatches=1,
        ),
        optim=OptimSection(learning_rate=1.7e-5, weight_decay=0.017, grad_clip=1.0),
        system=SystemSection(
            mode="async",
            max_staleness=2,
            update_policy="in_flight",
            batch=BatchSection(
                micro_batch_size=16,
                # 1024-token answers in groups of 4: packing saves little, its 4k-token rows'
                # attention costs more (docs/training.md, "Packing and one-pass log-probs")
                packed_prompts=False,
                length_bucket=128,
            ),
            hosts=HostsSection(rollout_timeout_s=3600.0),
        ),
        steps=300,
        seed=1,
        run_dir="runs/a3po_qwen25_1p5b_gsm8k",
        checkpoint_every=25,
        eval_every=25,
        eval_prompts=512,
    )
