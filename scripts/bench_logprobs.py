"""Micro-benchmark: target log-probs + entropy from hidden states, plain vs chunked.

Two ways of computing ``(logp, entropy)`` of ``softmax(h @ W / T)`` for N = B·T tokens:

* ``plain``: full [B, T, V] float32 logits, then ``losses.token_logprobs`` /
  ``losses.entropy`` (what ``logprobs.forward_logprobs`` does after the layer stack);
* ``chunked``: ``core.logprobs.chunked_token_logprobs``, C tokens at a time (one entry per
  ``--chunk-sizes`` value), both passes taking the vocabulary in blocks of Vb columns (one
  entry per ``--vocab-chunk-sizes`` value: ``auto`` the library's choice, ``0`` whole rows,
  i.e. one block of V, as an accelerator runs it and as the CPU did before the blocks,
  docs/log.md).

Each runs jitted two ways: ``forward`` (the values) and ``grad`` (forward + backward of a
masked sum of both outputs, gradients w.r.t. h and W, what the policy pass needs). Reported
per case: median seconds of ``--repeats`` runs after a warm-up (compilation excluded, each
run ended by ``block_until_ready``; the cases take turns within a repeat so a shared
machine's load affects them alike) and the compiled program's temporary buffer size from
XLA's ``memory_analysis()`` (the memory a case needs beyond its inputs and outputs: the
figure the chunking is meant to cut). Also the process's peak RSS at the end, and on an
accelerator the device's ``peak_bytes_in_use``. One JSON object is printed, with the CPU
model from /proc/cpuinfo.

    python scripts/bench_logprobs.py                        # SmolLM2 head, 4096 tokens
    python scripts/bench_logprobs.py --chunk-sizes 256,512,1024,2048
    python scripts/bench_logprobs.py --batch 10 --vocab-chunk-sizes auto,0,1024,2048,4096
    python scripts/bench_logprobs.py --batch 2 --seq 64 --vocab 4096 --repeats 1   # smoke

Defaults: SmolLM2-135M's head (D=576, V=49152, float32) at B=32, T=128 (4096 tokens).
Speed does not depend on the values, so inputs are random.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import jax
import jax.numpy as jnp
from bench_common import CONFIGS  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax.core import losses
from a3po_jax.core.logprobs import DEFAULT_CHUNK_SIZE, chunked_token_logprobs

TEMPERATURE = 0.7  # != 1, so the division by T is part of the work timed


def cpu_model() -> str:
    """The 'model name' line of /proc/cpuinfo (platform.processor() where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plain_logprobs(hidden, head, targets):
    """The [B, T, V] path: full logits, then the losses module's log-softmax."""
    logits = jnp.einsum("btd,dv->btv", hidden, head) / TEMPERATURE  # [B, T, V] float32
    return losses.token_logprobs(logits, targets), losses.entropy(logits)


def chunked_logprobs(chunk_size, vocab_chunk_size=None):
    def fn(hidden, head, targets):
        return chunked_token_logprobs(
            hidden,
            head,
            targets,
            temperature=TEMPERATURE,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
        )

    return fn


def vocab_blocks(spec: str, vocab: int) -> dict[str, int | None]:
    """``--vocab-chunk-sizes`` as {case suffix: vocab_chunk_size}: auto -> None (the
    library's choice), 0 -> V (whole rows), n -> n."""
    out = {}
    for item in spec.split(","):
        item = item.strip()
        if item == "auto":
            out["auto"] = None
        elif item.isdigit():
            out[f"vb{item}" if int(item) else "rows"] = int(item) or vocab
        else:
            raise SystemExit(f"--vocab-chunk-sizes: {item!r} is not 'auto' or an integer >= 0")
    return out


def forward_and_grad(fn):
    """(jit forward, jit grad w.r.t. h and W of Σ mask·(logp + 0.01·entropy))."""

    def objective(hidden, head, targets, mask):
        logp, ent = fn(hidden, head, targets)
        return jnp.sum(mask * (logp + 0.01 * ent))

    forward = jax.jit(lambda h, w, tgt, mask: fn(h, w, tgt))
    grad = jax.jit(jax.grad(objective, argnums=(0, 1)))
    return {"forward": forward, "grad": grad}


def temp_bytes(jitted, args) -> int:
    """Temporary buffer bytes of the compiled program (XLA's memory analysis)."""
    stats = jitted.lower(*args).compile().memory_analysis()
    return int(stats.temp_size_in_bytes) if stats is not None else -1


def main(argv: list[str] | None = None) -> None:
    smollm2 = CONFIGS["smollm2"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=32, help="B (default 32)")
    parser.add_argument("--seq", type=int, default=128, help="T (default 128; B·T = 4096)")
    parser.add_argument("--d-model", type=int, default=smollm2.d_model, help="D (576)")
    parser.add_argument("--vocab", type=int, default=smollm2.vocab_size, help="V (49152)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="h and W dtype"
    )
    parser.add_argument(
        "--chunk-sizes",
        default=str(DEFAULT_CHUNK_SIZE),
        help=f"comma-separated C values to run (default {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument(
        "--vocab-chunk-sizes",
        default="auto,0",
        help="comma-separated vocabulary blocks: auto (the library's), 0 (whole rows), "
        "or columns (default auto,0)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    args = parser.parse_args(argv)
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]

    b, t, d, v = args.batch, args.seq, args.d_model, args.vocab
    dtype = jnp.dtype(args.dtype)
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (b, t, d), jnp.float32).astype(dtype)
    head = (0.02 * jax.random.normal(kw, (d, v), jnp.float32)).astype(dtype)
    targets = jax.random.randint(kt, (b, t), 0, v, jnp.int32)
    mask = jnp.ones((b, t), jnp.float32)
    inputs = (hidden, head, targets, mask)

    cases = {"plain": forward_and_grad(plain_logprobs)}
    for c in chunk_sizes:
        for suffix, vb in vocab_blocks(args.vocab_chunk_sizes, v).items():
            cases[f"chunked_c{c}_{suffix}"] = forward_and_grad(chunked_logprobs(c, vb))

    records = {}
    for name, fns in cases.items():
        for kind, fn in fns.items():
            jax.block_until_ready(fn(*inputs))  # compile + warm-up
            records[(name, kind)] = {"temp_bytes": temp_bytes(fn, inputs), "times": []}
    for _ in range(args.repeats):
        for (name, kind), rec in records.items():
            start = time.perf_counter()
            jax.block_until_ready(cases[name][kind](*inputs))
            rec["times"].append(time.perf_counter() - start)

    results = []
    for (name, kind), rec in records.items():
        plain = records[("plain", kind)]
        median = statistics.median(rec["times"])
        results.append(
            {
                "case": name,
                "pass": kind,
                "median_s": round(median, 5),
                "min_s": round(min(rec["times"]), 5),
                "temp_bytes": rec["temp_bytes"],
                "temp_gib": round(rec["temp_bytes"] / 2**30, 4),
                "speedup_vs_plain": round(statistics.median(plain["times"]) / median, 3),
                "temp_vs_plain": round(rec["temp_bytes"] / max(plain["temp_bytes"], 1), 4),
            }
        )

    device = jax.devices()[0]
    device_stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    report = {
        "benchmark": "logprobs",
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": f"{device.platform}:{device.device_kind}",
        "jax": jax.__version__,
        "shapes": {"B": b, "T": t, "N": b * t, "D": d, "V": v, "dtype": args.dtype},
        "temperature": TEMPERATURE,
        "repeats": args.repeats,
        "full_logits_bytes": b * t * v * 4,
        "results": results,
        # Whole process (every case and its compilation): an upper bound, not per case.
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "device_peak_bytes": (device_stats or {}).get("peak_bytes_in_use"),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
