"""scripts/bench_common.py's per-op profile: the ops of a compiled program, timed by the JAX
profiler and named by the program's own instructions."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_common import op_profile  # noqa: E402


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the profile reads XLA:CPU's trace (op_profile)"
)
def test_op_profile_names_and_times_the_programs_matmul():
    a = jnp.ones((256, 512), jnp.float32)
    b = jnp.ones((512, 128), jnp.float32)
    fn = jax.jit(lambda a, b: jnp.tanh(jnp.einsum("ik,kj->ij", a, b)) + 1.0)
    hlo = fn.lower(a, b).compile().as_text()
    ops = op_profile(lambda: jax.block_until_ready(fn(a, b)), hlo, calls=2)
    assert ops, "no op of the program was found in the trace"
    dots = [o for o in ops if "dot_general" in o["op"]]
    assert len(dots) == 1, ops
    (dot,) = dots
    assert dot["shape"] == "f32[256,128]"
    assert dot["op"].startswith("ik,kj->ij")  # the einsum's name, without the jit scope
    assert dot["count"] == 1 and dot["ms"] > 0
    assert ops == sorted(ops, key=lambda o: -o["ms"])
