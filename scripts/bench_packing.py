"""Benchmark: train-step time of shared-prompt packed vs unpacked batches, side by side.

The step is forward + backward of a masked log-prob sum (the model work of a training step;
the optimizer update is the same for every layout and left out). For each (P, R, G) the
same N groups of G responses of length R to one prompt of length P run three ways:

* ``unpacked``: ``build_batch`` rows ``[prompt | response_i]`` and
  ``logprobs.forward_logprobs`` (lm_head over all B·T positions), what the trainer does;
* ``unpacked+head``: the same rows, but the lm_head only on completion positions (packing
  of one sample per row), to separate the lm_head saving from the prompt sharing;
* ``packed``: one row ``[prompt | response_1 | … | response_G]`` per group,
  ``packing.packed_token_logprobs``.

Next to them: the ideal ratio ``G·(P+R) / (P+G·R)`` (token work without prompt sharing over
token work with it, design §6), and the slot ratio actually run (B·T / N·L after length
buckets). tokens/s counts the B·(P+R) sample tokens of the batch for every layout, so
tokens/s ratios are speed-ups. Times are medians of ``--repeats`` runs after a warm-up
(compilation excluded), each ended by ``block_until_ready``; the three layouts take turns
within each repeat so a shared machine's load affects them alike.

    python scripts/bench_packing.py                      # small random model, 2 CPU cores: ~3 min
    python scripts/bench_packing.py --config tiny
    python scripts/bench_packing.py --config smollm2 --groups 4 --shapes 512x64x8,256x128x8

Speed does not depend on weight values, so models are randomly initialised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import CONFIGS, synthetic_groups  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax import model
from a3po_jax.core import logprobs, packing
from a3po_jax.core.batching import build_batch
from a3po_jax.core.types import RolloutGroup


def singleton_groups(groups):
    """Every sample as its own group of 1: packing then lays out exactly the unpacked rows."""
    out = []
    for group in groups:
        for r in group.rollouts:
            gid = len(out)
            single = dataclasses.replace(r, group_id=gid, sample_index=0)
            out.append(RolloutGroup(r.prompt_id, gid, [single], admitted_at_version=0))
    return out


def grad_step(forward, config):
    """jit(value_and_grad(Σ loss_mask · logp)): forward + backward of the model."""

    def loss(params, arrays):
        logp, _ = forward(params, arrays, model_config=config, temperature=1.0)
        return jnp.sum(logp * arrays["loss_mask"])

    return jax.jit(jax.value_and_grad(loss))


def time_interleaved(calls, repeats):
    """Median seconds of each ``(fn, args)``; the calls take turns within every repeat, so
    load from other processes on a shared machine hits every layout alike."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))  # compile + warm-up, not timed
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        p, r, g = (int(x) for x in item.lower().split("x"))
        shapes.append((p, r, g))
    return shapes


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument(
        "--shapes", default="256x32x8,128x64x4,64x128x4", help="PxRxG,... (prompt, response, G)"
    )
    parser.add_argument("--groups", type=int, default=1, help="N groups per batch")
    parser.add_argument("--length-bucket", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = dataclasses.replace(
        CONFIGS[args.config], param_dtype=args.dtype, compute_dtype=args.dtype
    )
    params = model.init_params(config, jax.random.key(0))
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), host "
        f"{platform.processor() or platform.machine()}; model {args.config} "
        f"({config.n_params / 1e6:.1f}M params, {args.dtype}); {args.groups} group(s) per "
        f"batch; median of {args.repeats} after warm-up"
    )
    steps = {
        "unpacked": grad_step(logprobs.forward_logprobs, config),
        "packed": grad_step(packing.packed_token_logprobs, config),
    }
    header = (
        f"{'P':>5}{'R':>5}{'G':>4} {'layout':<15}{'shape':>12}{'ms/step':>10}{'tok/s':>10}"
        f"{'speed-up':>10}{'slots':>8}{'ideal':>8}"
    )
    print(header)
    print("-" * len(header))
    records = []
    for p, r, g in parse_shapes(args.shapes):
        groups = synthetic_groups(args.groups, g, p, r, config.vocab_size)
        unpacked = build_batch(groups, advantage="grpo", length_bucket=args.length_bucket)
        head_only = packing.pack_groups(singleton_groups(groups), length_bucket=args.length_bucket)
        packed = packing.pack_groups(groups, length_bucket=args.length_bucket)
        sample_tokens = args.groups * g * (p + r)
        ideal = g * (p + r) / (p + g * r)
        runs = [
            ("unpacked", steps["unpacked"], unpacked.arrays(), unpacked.tokens.shape),
            ("unpacked+head", steps["packed"], head_only.arrays(), head_only.shape),
            ("packed", steps["packed"], packed.arrays(), packed.shape),
        ]
        device_args = [
            (params, {k: jnp.asarray(v) for k, v in arrays.items()}) for _, _, arrays, _ in runs
        ]
        seconds_all = time_interleaved(
            [(fn, a) for (_, fn, _, _), a in zip(runs, device_args, strict=True)], args.repeats
        )
        base = seconds_all[0]
        for (name, _, _, shape), seconds in zip(runs, seconds_all, strict=True):
            slots = unpacked.tokens.size / (shape[0] * shape[1])
            print(
                f"{p:>5}{r:>5}{g:>4} {name:<15}{str(tuple(shape)):>12}{seconds * 1e3:>10.1f}"
                f"{sample_tokens / seconds:>10.0f}{base / seconds:>10.2f}{slots:>8.2f}"
                f"{ideal:>8.2f}"
            )
            records.append(
                dict(P=p, R=r, G=g, layout=name, shape=list(shape), seconds=seconds, ideal=ideal)
            )
    print(json.dumps({"config": args.config, "groups": args.groups, "runs": records}))


if __name__ == "__main__":
    main()
