"""Benchmark: time of one training step with prox = recompute vs a3po vs behav, side by side.

Same rollouts, same model, same jitted step; the only difference is where the proximal
log-prob comes from. ``recompute`` adds one no-grad forward pass over the batch (decoupled
PPO); ``a3po`` interpolates it (no pass); ``behav`` is naive PPO (no pass). Design §6 puts
the ideal ratio a3po / recompute at ≈ 3/4 (fwd+bwd ≈ 3 forward-equivalents, +1 for the pass).

    python scripts/bench_train_step.py                       # small random model, CPU-sized
    python scripts/bench_train_step.py --config smollm2 --batch 16 --seq 256
    python scripts/bench_train_step.py --config smollm2 --batch 64 --seq 512   # a GPU

Speed does not depend on weight values, so models are randomly initialised with the real
architecture's shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import CONFIGS, synthetic_groups  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax import model
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.training import step_builder
from a3po_jax.training.config import AlgoSection, RolloutSection, TrainConfig


def time_fn(fn, args, repeats):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--response-len", type=int, default=160)
    p.add_argument("--micro-batch", type=int, default=0, help="0 = whole batch at once")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    mcfg = dataclasses.replace(
        CONFIGS[args.config], param_dtype=args.dtype, compute_dtype=args.dtype
    )
    groups = synthetic_groups(
        args.batch // args.group_size,
        args.group_size,
        args.prompt_len,
        args.response_len,
        mcfg.vocab_size,
        versions=lambda g, i: g % 3,  # staleness 0-2 across groups: a3po's α paths all run
    )
    batch = build_batch(groups, advantage="grpo", length_bucket=64)
    arrays = {k: jnp.asarray(v) for k, v in batch.arrays().items()}
    n_tok = int(batch.loss_mask.sum())
    params = model.init_params(mcfg, jax.random.key(0))
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), host "
        f"{platform.processor() or platform.machine()}; model {args.config} "
        f"({mcfg.n_params / 1e6:.1f}M params, {args.dtype}); batch {batch.shape} "
        f"({n_tok} completion tokens); micro-batch {args.micro_batch or batch.shape[0]}"
    )

    forward = jax.jit(
        lambda prm, b: ts.forward_logprobs(prm, b, model_config=mcfg, temperature=1.0)[0]
    )
    t_fwd = time_fn(forward, (params, arrays), args.repeats)

    results = {"forward_only": t_fwd}
    for prox in ("recompute", "a3po", "behav"):
        cfg = TrainConfig(
            rollout=RolloutSection(
                group_size=args.group_size, groups_per_step=args.batch // args.group_size
            ),
            algo=AlgoSection(prox=prox),
        )
        settings = dataclasses.replace(
            step_builder.step_settings(cfg), micro_batch_size=args.micro_batch
        )
        opt = step_builder.optimizer(cfg)
        step = jax.jit(
            functools.partial(
                ts.train_step,
                algo=ts.build_algorithm(settings),
                model_config=mcfg,
                optimizer=opt,
                grad_clip=1.0,
            )
        )
        state = ts.init_train_state(params, opt)
        # No donation here: the same state is reused for every repeat.
        results[prox] = time_fn(step, (state, arrays, None), args.repeats)

    print(f"{'what':<24}{'time/step':>12}{'tokens/s':>12}{'vs recompute':>14}")
    for name, t in results.items():
        print(f"{name:<24}{t * 1e3:>10.1f}ms{n_tok / t:>12.0f}{t / results['recompute']:>14.3f}")
    ratio = results["a3po"] / results["recompute"]
    ideal = (results["recompute"] - t_fwd) / results["recompute"]
    print(
        f"a3po / recompute = {ratio:.3f} (ideal from the measured forward: {ideal:.3f}; "
        f"design §6's 3/4 rule: 0.750; issue 6 target: <= 0.80)"
    )
    print(
        json.dumps(
            {
                "config": args.config,
                "batch": list(batch.shape),
                "seconds": results,
                "a3po_over_recompute": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
