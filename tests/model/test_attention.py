"""`model.attention.attend` (grouped-query attention with its own backward) against the
softmax written out under autodiff (`reference_attend`) and against JAX's own
`jax.nn.dot_product_attention`: values and gradients, every mask the model builds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax.model import attention, layers


def _inputs(b, t, s, h, n, k, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, k), dtype)
    key = jax.random.normal(ks[1], (b, s, n, k), dtype)
    value = jax.random.normal(ks[2], (b, s, n, k), dtype)
    d_out = jax.random.normal(ks[3], (b, t, h, k), dtype)  # a cotangent for the gradients
    return q, key, value, d_out


# Masks, and values with gradients below, as one compiled program each: eagerly every
# primitive compiles its own.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _packed_mask(b, t):
    """Two segments per row and a padded tail (segment 0): the packed rows' mask, whose
    padding queries attend to nothing."""
    seg = np.zeros((b, t), np.int32)
    for row in range(b):
        cut, end = t // 3 + row, t - 2 - row
        seg[row, :cut], seg[row, cut:end] = 1, 2
    return layers.causal_segment_mask(t, jnp.asarray(seg), b)


def _window_mask(b, t, s):
    """A decode/prefill step's mask over a cache window: slot <= each query's position."""
    lengths = jnp.arange(b) % (s - t) + 1  # different cache fill per row
    write_pos = lengths[:, None] + jnp.arange(t)[None, :]
    return jnp.arange(s)[None, None, :] <= write_pos[:, :, None]


MASKS = {
    name: jax.jit(fn, static_argnums=(0, 1, 2))
    for name, fn in {
        "causal": lambda b, t, s: layers.causal_segment_mask(t, None, b),
        "packed": lambda b, t, s: _packed_mask(b, t),
        "window": _window_mask,
    }.items()
}
# (B, T, S, H, N, K): SmolLM2's 9 query heads on 3 kv heads, plain multi-head, multi-query,
# and a one-token decode step over a window.
SHAPES = {
    "gqa": (2, 12, 12, 9, 3, 16),
    "mha": (2, 10, 10, 4, 4, 8),
    "mqa": (3, 9, 9, 6, 1, 8),
}


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, q, key, value, mask, d_out):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, key, value)
    return out, vjp(d_out)


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_values_and_gradients_equal_the_softmax_written_out(shape_name, mask_name):
    b, t, s, h, n, k = SHAPES[shape_name]
    if mask_name == "window":
        s = t + 5
    q, key, value, d_out = _inputs(b, t, s, h, n, k)
    mask = MASKS[mask_name](b, t, s)
    out, grads = jax.jit(lambda *a: _value_and_grads(attention.attend, *a))(
        q, key, value, mask, d_out
    )
    ref_out, ref_grads = jax.jit(lambda *a: _value_and_grads(attention.reference_attend, *a))(
        q, key, value, mask, d_out
    )
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("shape_name", ["gqa", "mqa"])
def test_equals_jax_dot_product_attention(shape_name):
    # An independent implementation: JAX's own GQA attention, with the same boolean mask.
    b, t, s, h, n, k = SHAPES[shape_name]
    q, key, value, d_out = _inputs(b, t, s, h, n, k, seed=3)
    mask = _packed_mask(b, t)
    valid = mask.any(axis=-1)  # JAX's attention gives padding queries 0s, ours their mean
    out, grads = _value_and_grads(
        attention.attend, q, key, value, mask, d_out * valid[..., None, None]
    )

    def theirs(q, key, value, mask):
        return jax.nn.dot_product_attention(q, key, value, mask=mask[:, None], implementation="xla")

    ref_out, ref_grads = _value_and_grads(
        theirs, q, key, value, mask, d_out * valid[..., None, None]
    )
    np.testing.assert_allclose(
        out * valid[..., None, None], ref_out * valid[..., None, None], atol=2e-5
    )
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5, err_msg=name)


def test_a_fully_masked_query_averages_the_values_with_finite_gradients():
    b, t, s, h, n, k = 1, 4, 4, 2, 1, 8
    q, key, value, d_out = _inputs(b, t, s, h, n, k, seed=5)
    mask = np.zeros((b, t, s), bool)
    mask[0, 1:, 0] = True  # query 0 attends to nothing
    mask = jnp.asarray(mask)
    out, grads = _value_and_grads(attention.attend, q, key, value, mask, d_out)
    # The checks in NumPy: eagerly every jnp slice and reduction compiles its own program.
    o, v = np.asarray(out), np.asarray(value)
    np.testing.assert_allclose(o[0, 0, 0], v[0, :, 0].mean(axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o[0, 1:, 0], np.broadcast_to(v[0, 0, 0], (t - 1, k)), atol=1e-6)
    assert all(bool(np.isfinite(g).all()) for g in grads)
    _, ref_grads = _value_and_grads(attention.reference_attend, q, key, value, mask, d_out)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_bfloat16_keeps_its_dtype_and_follows_float32():
    b, t, s, h, n, k = SHAPES["gqa"]
    q, key, value, d_out = _inputs(b, t, s, h, n, k, seed=7)
    mask = _packed_mask(b, t)
    low = [x.astype(jnp.bfloat16) for x in (q, key, value, d_out)]
    out, grads = _value_and_grads(attention.attend, *low[:3], mask, low[3])
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    ref_out, ref_grads = _value_and_grads(
        attention.reference_attend,
        *[x.astype(jnp.float32) for x in low[:3]],
        mask,
        low[3].astype(jnp.float32),
    )
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=3e-2, rtol=3e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g.astype(jnp.float32), r, atol=6e-2, rtol=6e-2)


def test_under_a_checkpointed_scan_as_the_layer_stack_runs_it():
    # The decoder scans its layers under jax.checkpoint with a policy that saves only the
    # weight matmuls' outputs: the custom backward must compose with that rematerialisation.
    b, t, s, h, n, k = SHAPES["gqa"]
    q, key, value, _ = _inputs(b, t, s, h, n, k, seed=9)
    mask = _packed_mask(b, t)
    weights = jax.random.normal(jax.random.key(11), (3, h * k, h * k)) / (h * k)

    def stack(fn, q, weights):
        def layer(x, w):
            y = fn((x.reshape(b, t, -1) @ w).reshape(x.shape), key, value, mask)
            return x + y, None

        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        x, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), q, weights)
        return jnp.sum(x**2)

    ours = jax.jit(jax.grad(lambda q, w: stack(attention.attend, q, w), argnums=(0, 1)))
    ref = jax.jit(jax.grad(lambda q, w: stack(attention.reference_attend, q, w), argnums=(0, 1)))
    for g, r in zip(ours(q, weights), ref(q, weights), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(key=(2, 12, 3, 8)), "key"),
        (dict(value=(2, 11, 3, 16)), "value"),
        (dict(q=(2, 12, 8, 16)), "query heads"),
        (dict(mask=(2, 12, 11)), "mask"),
    ],
)
def test_bad_shapes_name_the_input(bad, field):
    shapes = dict(q=(2, 12, 9, 16), key=(2, 12, 3, 16), value=(2, 12, 3, 16), mask=(2, 12, 12))
    shapes.update(bad)
    args = [jnp.zeros(shapes[name]) for name in ("q", "key", "value")]
    with pytest.raises(ValueError, match=field):
        attention.attend(*args, jnp.ones(shapes["mask"], bool))
