"""Shared pieces of the benchmark scripts: model shapes and synthetic rollouts.

Speed does not depend on weight values, so benchmarks use randomly initialised models with
the real architectures' shapes and random token rollouts (`synthetic_groups`, from
`tests/helpers/factories.py`).
"""

from __future__ import annotations

import collections
import math
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The synthetic-group factory is shared with the tests (tests/helpers/factories.py);
# benchmarks, like tests, run from a checkout of the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
from helpers.factories import synthetic_groups  # noqa: E402

from a3po_jax import model  # noqa: E402
from a3po_jax.model.assets import smollm2_config  # noqa: E402

__all__ = [
    "CONFIGS",
    "describe_machine",
    "dot_flops",
    "matmul_size",
    "op_profile",
    "synthetic_groups",
]

CONFIGS = {
    "tiny": model.ModelConfig.tiny(max_seq_len=4096),
    "small": model.ModelConfig(
        vocab_size=8192,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=768,
        max_seq_len=4096,
    ),
    "smollm2": smollm2_config(),
    # Qwen2.5-1.5B-Instruct's shapes (the GSM8K experiments' model): an accelerator's size.
    "qwen2.5-1.5b": model.ModelConfig(
        vocab_size=151936,
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        ffn_dim=8960,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
        max_seq_len=32768,
    ),
    "llama3-8b": model.ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=14336,
        rope_theta=500_000.0,
        tie_embeddings=False,
        max_seq_len=8192,
    ),
}


def matmul_size() -> int:
    """n of the n x n x n matmul that measures a device's peak: 2048 on a CPU (0.05-0.1 s), 8192
    on an accelerator (a 2048^3 product is launch-bound on a GPU)."""
    return 2048 if jax.default_backend() == "cpu" else 8192


# An HLO instruction line of a compiled program's text: its name, its result shape and the
# op_name the tracer left in its metadata (the jax function and primitive it came from).
_HLO_LINE = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+) = (\S+) .*?op_name="([^"]*)"')


def _hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (op label, result shape without layout)} of a compiled program.

    The label is the op_name metadata without its "jit(...)" scopes, e.g.
    "btngk,bsnk->bngts/dot_general" for an einsum's dot, "dot_general" for a plain one."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if m:
            name, shape, op_name = m.groups()
            label = "/".join(p for p in op_name.split("/") if not p.startswith("jit(")) or op_name
            ops[name] = (label, re.sub(r"\{[^}]*\}", "", shape))
    return ops


def op_profile(run_once: Callable[[], Any], hlo_text: str, *, calls: int = 3) -> list[dict]:
    """Per-op times of a compiled program, from the JAX profiler.

    `run_once()` runs the program once and blocks until it is done (a closure, so a program
    with donated state can be fed its own output); `hlo_text` is its compiled text
    (`jitted.lower(...).compile().as_text()`), which names the ops the profiler times.
    Runs it `calls` times under `jax.profiler.trace`, reads the trace back
    (`jax.profiler.ProfileData`) and sums the time of every event named after one of the
    program's instructions (fusions, dots, copies; the executor's own events are left out),
    grouped by the instruction's op label and result shape.

    Returns [{"op", "shape", "count", "ms"}] per call, largest first. Ops on two threads
    can overlap, so the sum can exceed the wall time a little. CPU only: on a GPU the
    kernels' events are not named after the instructions (neither their names nor an
    "hlo_op" stat matched; docs/log.md), so nothing is found there.
    """
    from jax.profiler import ProfileData

    ops = _hlo_ops(hlo_text)
    run_once()  # compiled and warm before the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                run_once()
        (xplane,) = Path(trace_dir).rglob("*.xplane.pb")
        data = ProfileData.from_file(str(xplane))
    ns: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in ops:
                    ns[ops[event.name]] += event.duration_ns
                    count[ops[event.name]] += 1
    return [
        {"op": key[0], "shape": key[1], "count": count[key] // calls, "ms": t / calls / 1e6}
        for key, t in ns.most_common()
    ]


# A computation's header line ("%name (params) -> result {", "ENTRY %name ... {"), an
# instruction line ("%name = type op(operands), attributes"; a tuple type has spaces), and
# an array type's dimensions.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_DIMS = re.compile(r"^\w+\[([\d,]*)\]")


def _dims(shape: str) -> list[int] | None:
    m = _DIMS.match(shape)
    return None if m is None else [int(d) for d in m.group(1).split(",") if d]


def dot_flops(hlo_text: str) -> float:
    """Matmul FLOPs a compiled program executes: 2 · |output| · |contracted dims| summed over
    every dot instruction (in fusions too), each loop body counted `known_trip_count` times.

    What the program really multiplies, recomputation included (rematerialised layers, a
    chunked lm_head's logits recomputed in its backward pass), unlike an analytical count
    of the model's matmuls; elementwise work is not counted. Of a conditional's branches
    the costliest is counted. `hlo_text` is `jitted.lower(...).compile().as_text()`.
    Raises ValueError on a loop without a known trip count (its count would be a guess).
    """
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    if entry is None:
        raise ValueError("dot_flops: no ENTRY computation in the HLO text")

    def called(name: str, op: str, rest: str) -> list[tuple[float, list[str]]]:
        """(multiplier, computations) this instruction runs."""
        if op == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
            if trips is None:
                raise ValueError(f"dot_flops: loop {name} has no known trip count")
            return [(float(trips.group(1)), re.findall(r"body=%([\w.\-]+)", rest))]
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches:
            return [(1.0, [max(re.findall(r"%([\w.\-]+)", branches.group(1)), key=total)])]
        pair = re.findall(r"(?:true|false)_computation=%([\w.\-]+)", rest)
        if pair:
            return [(1.0, [max(pair, key=total)])]
        # fusion (calls=), call (to_apply=; a reduce's to_apply holds no dot and adds 0)
        return [(1.0, re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest))]

    memo: dict[str, float] = {}

    def total(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        shapes, flops = {}, 0.0
        for line in computations[comp]:
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            name, shape, op, rest = m.groups()
            shapes[name] = _dims(shape)
            if op == "dot":
                lhs = shapes[re.match(r"%([\w.\-]+)", rest).group(1)]
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
                k = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
                flops += 2.0 * math.prod(shapes[name]) * k
            for times, callees in called(name, op, rest):
                flops += times * sum(total(c) for c in callees)
        memo[comp] = flops
        return flops

    return total(entry)


def describe_machine() -> dict:
    """The CPU (model, cores, the ISA flags XLA's and PyTorch's kernels depend on) and the
    JAX device the benchmark runs on."""
    cpu_model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and cpu_model is None:
                    cpu_model = value.strip()
                elif key in ("flags", "features"):  # x86 / ARM
                    flags.update(value.split())
    except OSError:  # not Linux
        pass
    listed = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma", "neon", "asimd")
    device = jax.devices()[0]
    return {
        "cpu": cpu_model or platform.processor() or platform.machine(),
        "cpu_arch": platform.machine(),
        "cores": os.cpu_count(),
        "isa": [flag for flag in listed if flag in flags],
        "device": f"{device.device_kind} ({device.platform})",
        "jax": jax.__version__,
    }
