"""Forward, forward+backward and KV-cache decode throughput of the decoder, and its memory.

Decode is timed twice: `apply` over the stacked layers, and `apply_decode` over the per-layer
weights (`decode_params`, `a3po_jax/inference/engine/decode_layout.py`), which is what the inference
engine runs.

    python scripts/bench_model.py --config tiny --batch 8 --seq 128
    python scripts/bench_model.py --config smollm2 --batch 4 --seq 256 --dtype bfloat16
    python scripts/bench_model.py --config qwen2.5-1.5b --batch 8 --seq 1024 --remat   # GPU/TPU

Weights are random (speed does not depend on their values), so no checkpoint is needed;
the architectures are the real ones. Prints tokens/s for each pass, parameter bytes, what
XLA's `memory_analysis()` reports for the compiled programs (temporaries = activations and
workspace), and the run's peak memory: peak RSS (`getrusage`; on a CPU every array lives
there) and, on an accelerator, the device's `memory_stats()["peak_bytes_in_use"]`; plus one
JSON line (`--json`) for later comparisons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from bench_common import CONFIGS  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax.inference.engine.decode_layout import apply_decode, decode_params
from a3po_jax.model import apply, init_kv_cache, init_params
from a3po_jax.training.metrics import peak_memory


def _time(fn, *args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _memory(compiled) -> dict[str, int] | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if stats is None:
        return None
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    return {name.replace("_size_in_bytes", ""): int(getattr(stats, name, 0)) for name in names}


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--remat", action="store_true", help="rematerialise layers in backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16, help="0 skips the decode bench")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args(argv)

    config = dataclasses.replace(
        CONFIGS[args.config], param_dtype=args.dtype, compute_dtype=args.dtype, remat=args.remat
    )
    b, t = args.batch, args.seq
    params = init_params(config, jax.random.key(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def forward(p, tok, pos):
        return apply(p, tok, pos, config=config)[0]

    def loss(p, tok, pos):
        logits = apply(p, tok, pos, config=config)[0]
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1))

    results: dict = {
        "config": args.config,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "dtype": args.dtype,
        "remat": args.remat,
        "batch": b,
        "seq": t,
        "n_params": config.n_params,
        "param_bytes": param_bytes,
    }
    for name, fn in (("forward", forward), ("forward_backward", jax.value_and_grad(loss))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(params, tokens, positions).compile()
        compile_s = time.perf_counter() - start
        seconds = _time(compiled, params, tokens, positions, repeats=args.repeats)
        results[name] = {
            "compile_s": round(compile_s, 2),
            "step_s": seconds,
            "tokens_per_s": b * t / seconds,
            "memory": _memory(compiled),
        }

    if args.decode_steps:
        capacity = t + args.decode_steps

        def decoder(forward):
            def decode(p, cache):
                def step(carry, _):
                    tok, cache = carry
                    logits, cache = forward(p, tok, cache.lengths[:, None], cache)
                    return (jnp.argmax(logits, -1).astype(jnp.int32), cache), None

                first = jnp.zeros((b, 1), jnp.int32)
                (tok, cache), _ = jax.lax.scan(step, (first, cache), None, length=args.decode_steps)
                return tok, cache

            return decode

        # "decode": `apply` over the stacked layers; "decode_per_layer": `apply_decode` over
        # `decode_params` in the engine's layout for this batch (out-major from two rows up),
        # the inference engine's decode step.
        paths = {
            "decode": (
                lambda p, tok, pos, cache: apply(p, tok, pos, config=config, kv_cache=cache),
                params,
            ),
            "decode_per_layer": (
                lambda p, tok, pos, cache: apply_decode(p, tok, pos, config=config, kv_cache=cache),
                decode_params(params, config, out_major=b > 1),
            ),
        }
        # A cache already holding `seq` tokens, so each step attends a realistic context.
        cache = init_kv_cache(config, b, capacity)._replace(lengths=jnp.full((b,), t, jnp.int32))
        for name, (forward, weights) in paths.items():
            start = time.perf_counter()
            compiled = jax.jit(decoder(forward)).lower(weights, cache).compile()
            compile_s = time.perf_counter() - start
            seconds = _time(compiled, weights, cache, repeats=args.repeats)
            results[name] = {
                "compile_s": round(compile_s, 2),
                "step_s": seconds / args.decode_steps,
                "tokens_per_s": b * args.decode_steps / seconds,
                "kv_cache_bytes": int(cache.k.nbytes + cache.v.nbytes),
                "memory": _memory(compiled),
            }

    print(
        f"{args.config}: {config.n_params / 1e6:.1f} M params ({_mib(param_bytes)} {args.dtype}), "
        f"batch {b} x seq {t}, remat={args.remat}, on {results['backend']} "
        f"({results['device']})"
    )
    for name in ("forward", "forward_backward", "decode", "decode_per_layer"):
        if name not in results:
            continue
        r = results[name]
        mem = r["memory"] or {}
        extra = f", kv cache {_mib(r['kv_cache_bytes'])}" if "kv_cache_bytes" in r else ""
        print(
            f"  {name:17s} {r['tokens_per_s']:>12,.0f} tokens/s  ({r['step_s'] * 1e3:9.2f} ms/step,"
            f" compile {r['compile_s']:.1f} s)  temporaries {_mib(mem.get('temp'))}, "
            f"arguments {_mib(mem.get('argument'))}, outputs {_mib(mem.get('output'))}{extra}"
        )
    memory = peak_memory()
    results["peak_rss_gb"] = memory["mem/peak_rss_gb"]
    results["device_peak_gb"] = memory.get("mem/device_peak_gb")
    device_peak = results["device_peak_gb"]
    print(
        f"  peak RSS {results['peak_rss_gb']:.2f} GiB"
        + ("" if device_peak is None else f", device peak {device_peak:.2f} GiB")
    )
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
