"""scripts/bench_common.py's per-op profile (the ops of a compiled program, timed by the JAX
profiler and named by the program's own instructions) and its count of the matmul FLOPs a
compiled program executes."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_common import dot_flops, op_profile  # noqa: E402


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


def _flops(fn, *args) -> float:
    return dot_flops(jax.jit(fn).lower(*args).compile().as_text())


def test_dot_flops_counts_a_matmul_and_a_batched_einsum():
    a, b = jnp.ones((64, 48)), jnp.ones((48, 32))
    assert _flops(lambda a, b: jnp.tanh(a @ b) + 1.0, a, b) == 2 * 64 * 48 * 32
    x, y = jnp.ones((3, 5, 7, 4)), jnp.ones((3, 7, 4, 6))  # two contracted dims (7, 4)
    assert _flops(lambda x, y: jnp.einsum("bikl,bklj->bij", x, y), x, y) == 2 * 3 * 5 * 6 * 7 * 4


def test_dot_flops_counts_a_loop_body_once_per_trip():
    w = jnp.ones((16, 16)) * 0.1

    def five_layers(x, w):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=5)[0]

    one = 2 * 8 * 16 * 16
    assert _flops(five_layers, jnp.ones((8, 16)), w) == 5 * one
    # its gradient in x and w, the layer under jax.checkpoint (nothing saved): per trip the
    # forward product, the same product again in the backward pass, and the products for
    # the two gradients
    layer = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

    def loss(x, w):
        return jnp.sum(jax.lax.scan(lambda h, _: (layer(h, w), None), x, None, length=5)[0])

    assert _flops(jax.grad(loss, argnums=(0, 1)), jnp.ones((8, 16)), w) == 5 * 4 * one


def test_dot_flops_refuses_a_loop_of_unknown_length():
    def until_small(x):
        return jax.lax.while_loop(lambda h: jnp.sum(h) > 1.0, lambda h: h @ h * 0.5, x)

    with pytest.raises(ValueError, match="trip count"):
        _flops(until_small, jnp.ones((4, 4)))
