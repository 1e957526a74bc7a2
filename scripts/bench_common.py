"""Shared pieces of the benchmark scripts: model shapes and synthetic rollouts.

Speed does not depend on weight values, so benchmarks use randomly initialised models with
the real architectures' shapes and random token rollouts (`synthetic_groups`, from
`tests/factories.py`).
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The synthetic-group factory is shared with the tests (tests/factories.py); benchmarks, like
# tests, run from a checkout of the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
from factories import synthetic_groups  # noqa: E402

from a3po_jax import model  # noqa: E402
from a3po_jax.model.assets import smollm2_config  # noqa: E402

__all__ = ["CONFIGS", "matmul_size", "op_profile", "synthetic_groups"]

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
    kernels' events are not named after the instructions (tried on an H200, 2026-11-26:
    neither their names nor an "hlo_op" stat matched), so nothing is found there.
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
