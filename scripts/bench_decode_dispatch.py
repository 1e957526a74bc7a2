"""Where a decode step's time goes when it is short (an accelerator): the device's own rate,
the wait for its tokens, and the cost of dispatching a program with the step's arguments.

For each model and batch, on random weights in `--dtype`, an `EngineCore` decode step
(`generate_packed`, window 64) is timed three ways, 50 steps each after 3 warm-up steps:

* pipelined: the steps dispatched back to back, the last one waited for: the device's rate;
* read each step: each step's packed tokens copied to the host before the next is
  dispatched (what a driver that does not overlap pays);
* trivial program: a jitted function over the same arguments (the per-layer weights and the
  donated decode state) that does almost nothing: the dispatch cost alone.

    python scripts/bench_decode_dispatch.py                           # CPU: tiny, float32
    python scripts/bench_decode_dispatch.py --models smollm2,qwen2.5-1.5b --dtype bfloat16  # GPU

Prints one line per (model, batch) and the machine's device.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
from bench_common import CONFIGS  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax import model
from a3po_jax.inference.engine.engine_core import EngineCore


def per_call(fn, n: int) -> float:
    """Mean seconds of n calls of fn(), which returns what to block on (blocked at the end)."""
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def measure(cfg: model.ModelConfig, params, batch: int, steps: int) -> dict[str, float]:
    """Seconds per decode step pipelined / read each step, and per trivial dispatch."""
    core = EngineCore(cfg, num_slots=batch, capacity=128, prefill_buckets=(64,))
    split = core.split_params(params)
    cell = [core.init_decode_state()]

    def step(read: bool):
        cell[0], packed = core.generate_packed(split, cell[0], 64)
        return jax.device_get(packed) if read else packed

    trivial = jax.jit(lambda w, s: (s, w.final_norm[0]), donate_argnums=(1,))

    def dispatch():
        cell[0], x = trivial(split, cell[0])
        return x

    for fn in (lambda: step(False), dispatch):
        per_call(fn, 3)  # compiles and warms up
    return {
        "pipelined": per_call(lambda: step(False), steps),
        "read_each_step": per_call(lambda: step(True), steps),
        "trivial_program": per_call(dispatch, steps),
        "arguments": len(jax.tree.leaves((split, cell[0]))),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny", help="comma-separated bench_common.CONFIGS names")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    for name in args.models.split(","):
        cfg = dataclasses.replace(CONFIGS[name], param_dtype=args.dtype, compute_dtype=args.dtype)
        params = model.init_params(cfg, jax.random.key(0))
        for batch in (int(b) for b in args.batches.split(",")):
            t = measure(cfg, params, batch, args.steps)
            print(
                f"{name} {args.dtype} batch {batch}: step pipelined {t['pipelined'] * 1e3:.2f} "
                f"ms, read each step {t['read_each_step'] * 1e3:.2f} ms, a trivial program over "
                f"the same {t['arguments']} arguments {t['trivial_program'] * 1e3:.3f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
