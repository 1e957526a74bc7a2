"""Grouped-query attention with its own backward pass (model layer, pure core).

    attend(q [B,T,H,K], key [B,S,N,K], value [B,S,N,K], mask [B,T,S] bool) -> [B,T,H,K]

Query head h = n·G + g attends with kv head n (HF's `repeat_kv`), scores and softmax in
float32 whatever the compute dtype, a masked key gets the finite `MASK_VALUE` (a fully masked
row, a padding query, softmaxes to a uniform distribution instead of NaN).

Two things make it faster than the softmax written out under autodiff on XLA:CPU
(docs/log.md, "Attention with its own backward"):

* *Batch dimensions first.* The G query heads of a kv head are laid out as one [G·T, K]
  block per (row, kv head): q -> [B, N, G·T, K], keys and values -> [B, N, S, K]. Every
  product is then a batched GEMM with (B, N) leading and no transposed copy of a
  [.., T, S] operand around it (XLA:CPU runs a batched dot as one GEMM per batch entry and
  transposes operands whose batch dimensions are not leading).
* *Flash attention's algebra, not autodiff's.* The forward normalises after the
  probabilities-times-values product (o = (e·V) / l with e = exp(s - m), l = Σ e) and keeps
  only the row max m and 1/l for the backward. The backward recomputes p = e / l from the
  scores and takes dv = pᵀ·do, dp = do·Vᵀ, ds = p ∘ (dp - Σ p ∘ dp), dq = ds·K, dk = dsᵀ·q:
  two elementwise passes over the [.., T, S] block where autodiff of the softmax made many.

The values are those of `reference_attend` (the softmax written out) to float rounding; the
tests check values and gradients against it and against `jax.nn.dot_product_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A finite "minus infinity" for masked scores (see the module docstring).
MASK_VALUE = float(np.finfo(np.float32).min)


def _grouped(x: jax.Array, n: int) -> jax.Array:
    """[B, T, N·G, K] -> [B, N, G·T, K]: a kv head's query heads as one block of rows."""
    b, t, h, k = x.shape
    g = h // n
    return x.reshape(b, t, n, g, k).transpose(0, 2, 3, 1, 4).reshape(b, n, g * t, k)


def _ungrouped(x: jax.Array, t: int) -> jax.Array:
    """[B, N, G·T, K] -> [B, T, N·G, K], the inverse of `_grouped`."""
    b, n, gt, k = x.shape
    g = gt // t
    return x.reshape(b, n, g, t, k).transpose(0, 3, 1, 2, 4).reshape(b, t, n * g, k)


def _masked_scores(qg: jax.Array, kn: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 scores [B, N, G·T, S] = q·k / √K with masked keys at MASK_VALUE, and the mask
    broadcast to the scores' rows [B, 1, G·T, S]."""
    b, t, s = mask.shape
    g = qg.shape[2] // t
    scores = jnp.einsum("bnqk,bnsk->bnqs", qg, kn, preferred_element_type=jnp.float32)
    scores = scores * (qg.shape[-1] ** -0.5)
    rows = jnp.broadcast_to(mask[:, None, None], (b, 1, g, t, s)).reshape(b, 1, g * t, s)
    return jnp.where(rows, scores, MASK_VALUE), rows


def _attend_fwd(q, key, value, mask):
    _check(q, key, value, mask)
    n = key.shape[2]
    qg = _grouped(q, n)  # [B, N, G·T, K]
    kn = key.transpose(0, 2, 1, 3)  # [B, N, S, K]
    vn = value.transpose(0, 2, 1, 3)
    scores, _ = _masked_scores(qg, kn, mask)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - row_max)
    inv_sum = 1.0 / jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bnqs,bnsk->bnqk", e.astype(q.dtype), vn, preferred_element_type=jnp.float32)
    out = _ungrouped((o * inv_sum).astype(q.dtype), q.shape[1])
    return out, (qg, kn, vn, mask, row_max, inv_sum)


def _attend_bwd(residuals, d_out):
    qg, kn, vn, mask, row_max, inv_sum = residuals
    t = mask.shape[1]
    dog = _grouped(d_out, kn.shape[1])  # [B, N, G·T, K]
    scores, rows = _masked_scores(qg, kn, mask)
    p = jnp.exp(scores - row_max) * inv_sum  # float32, the forward's probabilities
    dv = jnp.einsum("bnqs,bnqk->bnsk", p.astype(vn.dtype), dog)
    dp = jnp.einsum("bnqk,bnsk->bnqs", dog, vn, preferred_element_type=jnp.float32)
    # A masked score is a constant: no gradient reaches q or k through it (a fully masked
    # row's uniform probabilities are not 0 there).
    ds = jnp.where(rows, p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)), 0.0)
    ds = (ds * (qg.shape[-1] ** -0.5)).astype(qg.dtype)
    dq = jnp.einsum("bnqs,bnsk->bnqk", ds, kn)
    dk = jnp.einsum("bnqs,bnqk->bnsk", ds, qg)
    return (
        _ungrouped(dq, t),
        dk.transpose(0, 2, 1, 3).astype(kn.dtype),
        dv.transpose(0, 2, 1, 3).astype(vn.dtype),
        None,  # the mask has no cotangent
    )


@jax.custom_vjp
def attend(q: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention: q [B,T,H,K], key/value [B,S,N,K], mask [B,T,S] bool ->
    [B,T,H,K] in q's dtype (H a multiple of N). See the module docstring."""
    return _attend_fwd(q, key, value, mask)[0]


attend.defvjp(_attend_fwd, _attend_bwd)


def _check(q, key, value, mask) -> None:
    b, t, h, k = q.shape
    s, n = key.shape[1], key.shape[2]
    if key.shape != (b, s, n, k) or value.shape != key.shape:
        raise ValueError(
            f"attend: key {key.shape} and value {value.shape} must be [B, S, N, K] = "
            f"[{b}, S, N, {k}] for q {q.shape}"
        )
    if h % n:
        raise ValueError(f"attend: {h} query heads is not a multiple of {n} kv heads")
    if mask.shape != (b, t, s) or mask.dtype != jnp.bool_:
        raise ValueError(
            f"attend: mask must be bool [{b}, {t}, {s}], got {mask.dtype} {mask.shape}"
        )


def reference_attend(q: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
    """The same attention as the softmax written out (autodiff's backward): the tests'
    reference for `attend`."""
    b, t, h, k = q.shape
    n = key.shape[2]
    qg = q.reshape(b, t, n, h // n, k)
    scores = jnp.einsum("btngk,bsnk->bngts", qg, key, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * (k**-0.5), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bngts,bsnk->btngk", probs, value).reshape(b, t, h, k)
