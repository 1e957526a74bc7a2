"""Target log-probs and entropies of ``softmax(h W / T)`` without ``[B, T, V]`` logits (core).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

The plain path (``model.apply`` logits, then ``losses.token_logprobs`` / ``losses.entropy``)
holds float32 logits of shape [B, T, V], their softmax and, under ``jax.grad``, their
cotangent: 0.8 GB each for 4096 tokens of SmolLM2's 49152-token vocabulary. Here the tokens
are cut into chunks of C; each chunk's [C, V] logits live only inside one iteration of a
``lax.scan``, and a ``jax.custom_vjp`` recomputes them in the backward pass instead of
saving them, so neither pass holds more than one chunk of the vocabulary (plus the [D, V]
head gradient it accumulates). The values and gradients equal the plain path's to float
rounding (tests/test_logprobs.py).

Shape letters: B batch, T time, D model width, V vocab, N = B·T tokens, C chunk, K chunks.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

# Default tokens per chunk (C). Two costs pull in opposite directions:
# * memory: one [C, V] float32 buffer of 4·C·V bytes per pass (the forward's logits; the
#   backward's logits turned in place into their cotangent) plus, in the backward, the
#   [D, V] float32 head gradient. XLA's memory analysis of the jitted function at SmolLM2's
#   head (D=576, V=49152) and 4096 tokens, temporaries in MiB, forward / forward+backward:
#   plain 1536 / 2304; C=256 49 / 157; C=512 97 / 205; C=1024 194 / 302; C=2048 389 / 497.
# * speed: every chunk streams the whole head W ([D, V]) through the matmul, so a chunk does
#   2·C·D·V FLOPs per 4·D·V bytes of W read: C/2 FLOP/byte, and the backward's dW += hᵀ·dz
#   reads and writes the accumulator too (C/4). A CPU is compute-bound from about 15
#   FLOP/byte (300 GFLOP/s over ~20 GB/s), an H100 in bfloat16 only from about 300
#   (990 TFLOP/s over 3.35 TB/s), i.e. C ≳ 600; 1024 is the next power of two.
# At 1024 the vocabulary work stays at matmul speed on both kinds of machine while the
# memory is already 7-8x below the plain path at 4096 tokens. A caller short on memory (a
# large vocabulary on a small machine) passes a smaller chunk_size; a CPU is still
# compute-bound at 256. `scripts/bench_logprobs.py --chunk-sizes ...` measures both.
DEFAULT_CHUNK_SIZE = 1024


def chunked_token_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Per-token target log-prob and entropy of ``softmax(hidden @ head / temperature)``,
    computed C tokens at a time so no [B, T, V] array exists in the forward or backward.

        z[b, t]    = hidden[b, t] · head / temperature                 (float32, [V])
        logp[b, t] = z[b, t, targets[b, t]] - logsumexp_v z[b, t, v]
        H[b, t]    = -Σ_v p_v log p_v,    p = softmax(z[b, t])

    the same as ``losses.token_logprobs(logits / temperature, targets)`` and
    ``losses.entropy(logits / temperature)`` with ``logits = hidden @ head``, which is how
    the decoder makes its logits from its final-norm hidden states (float32, no softcap).

    Matmuls run in the inputs' promoted dtype with float32 accumulation (the decoder passes
    float32 states and a float32 head); everything after the matmul is float32, because the
    log-probs feed importance ratios exp(a - b) that bfloat16 rounding would show in.

    Masking is the caller's: every token, padding included, gets a finite value, and a token
    whose outputs the caller multiplies by 0 contributes exactly 0 to both gradients.
    Targets outside [0, V) (none are produced by batching or packing, which pad with 0) pick
    no logit: their logp is -logsumexp, finite.

    Args:
      hidden: [B, T, D] final-norm hidden states (float32 or bfloat16); position t predicts
        ``targets[:, t]``.
      head: [D, V] output projection. Untied models pass ``params["lm_head"]["kernel"]``;
        tied ones the embedding table transposed; ``model.lm_head_kernel(params, config)``
        returns either, as float32, and its gradient flows back to the parameter.
      targets: [B, T] integer token ids.
      temperature: T > 0 (static), the sampling temperature the behaviour log-probs used.
      chunk_size: C > 0 (static), tokens per chunk; see ``DEFAULT_CHUNK_SIZE``. A token
        count that C does not divide ends with one shorter chunk (no padded work).

    Returns:
      (logp [B, T], entropy [B, T]), float32.
    """
    chex.assert_rank(hidden, 3)
    chex.assert_rank(head, 2)
    chex.assert_rank(targets, 2)
    b, t, d = hidden.shape
    chex.assert_shape(head, (d, None))
    chex.assert_shape(targets, (b, t))
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

    n = b * t
    logp, ent = _flat_logprobs(
        hidden.reshape(n, d), head, targets.reshape(n).astype(jnp.int32), temperature, chunk_size
    )
    return logp.reshape(b, t), ent.reshape(b, t)


# ---------------------------------------------------------------------------------------------
# One chunk, forward and backward. Both build the chunk's [C, V] logits from h and W the same
# way, so the backward's recomputation gives the forward's numbers.


def _scales_states(h: jax.Array, w: jax.Array) -> bool:
    """Whether 1/temperature is applied to the [C, D] states rather than the [C, V] logits.

    For a float32 matmul it is: (h / T)·W equals (h·W) / T to float32 rounding, and XLA:CPU
    does not fuse a scale into a dot's output, so scaling the logits kept a second [C, V]
    buffer per chunk (twice the memory, one more pass over it). For bfloat16 inputs the
    float32 product is divided instead: dividing bf16 states would round them once more.
    """
    return jnp.finfo(jnp.result_type(h, w)).bits >= 32


def _scaled(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
    """[C, D] h / temperature in the matmul's (promoted, float32) dtype: a bf16 h with a
    float32 head is promoted first, not divided in bf16."""
    return h.astype(jnp.result_type(h, w)) / temperature


def _chunk_logits(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
    """[C, V] float32 z = h·W / temperature."""
    if _scales_states(h, w):
        return jnp.dot(_scaled(h, w, temperature), w, preferred_element_type=jnp.float32)
    return jnp.dot(h, w, preferred_element_type=jnp.float32) / temperature


def _pick(z: jax.Array, tgt: jax.Array) -> jax.Array:
    """[C] z[c, tgt[c]], 0 for an id outside [0, V); a gather of C values (a one-hot select
    would be one more [C, V] buffer)."""
    v = z.shape[-1]
    picked = jnp.take_along_axis(z, jnp.clip(tgt, 0, v - 1)[:, None], axis=-1)[:, 0]
    return jnp.where((tgt >= 0) & (tgt < v), picked, 0.0)


def _chunk_forward(h, w, tgt, temperature):
    """(logp [C], entropy [C], logsumexp [C]) of one chunk; only z is a [C, V] buffer, the
    rest are reductions fused over it.

    One exponential per logit: with m = max z, y = z - m <= 0, e = exp(y), S = Σ e and
    U = Σ e·y,
        lse = m + log S,    H = -Σ p log p = -Σ p (y - log S) = log S - U / S
    (in the shifted y, so a peaked softmax does not subtract two numbers of z's size).
    `jax.nn.logsumexp` and then `losses.entropy`'s -Σ p log p took two passes of exp over
    the [C, V] logits; on XLA:CPU that was a third of the head's forward (SmolLM2 head,
    1024 tokens: 759 -> 631 ms, the matmul alone 370 ms). Equal to those to float rounding
    (tests/test_logprobs.py).
    """
    z = _chunk_logits(h, w, temperature)  # [C, V]
    m = jnp.max(z, axis=-1)  # [C]
    y = z - m[:, None]  # [C, V], fused with exp into the two sums (no buffer)
    e = jnp.exp(y)
    total = jnp.sum(e, axis=-1)
    log_total = jnp.log(total)
    lse = m + log_total
    ent = log_total - jnp.sum(e * y, axis=-1) / total
    logp = _pick(z, tgt) - lse  # as losses.token_logprobs
    return logp, ent, lse


def _chunk_backward(h, w, tgt, lse, ent, g_logp, g_ent, temperature):
    """(dh [C, D] float32, dW [D, V] float32) of one chunk, its logits recomputed.

    With p = softmax(z), log p = z - lse:
        d logp_t / dz_k = δ_kt - p_k
        d H / dz_k      = -p_k (log p_k + H)
    so dz_k = g_logp δ_kt - p_k (g_logp + g_H (log p_k + H)); z = (h / T)·W gives
    dW = (h / T)ᵀ·dz and dh = (dz·Wᵀ) / T, wherever the 1/T was applied.
    """
    z = _chunk_logits(h, w, temperature)  # [C, V]
    logp_all = z - lse[:, None]
    p = jnp.exp(logp_all)
    is_target = jnp.arange(z.shape[-1])[None, :] == tgt[:, None]
    dz = jnp.where(is_target, g_logp[:, None], 0.0) - p * (
        g_logp[:, None] + g_ent[:, None] * (logp_all + ent[:, None])
    )  # [C, V]
    if _scales_states(h, w):
        h_scaled = _scaled(h, w, temperature)  # [C, D], as in the forward
        dh = jnp.dot(dz, w.T, preferred_element_type=jnp.float32) / temperature  # [C, D]
        dw = jnp.dot(h_scaled.T, dz, preferred_element_type=jnp.float32)  # [D, V]
    else:
        d_logits = dz / temperature  # [C, V]
        dh = jnp.dot(d_logits, w.T, preferred_element_type=jnp.float32)
        dw = jnp.dot(h.T, d_logits, preferred_element_type=jnp.float32)
    return dh, dw


# ---------------------------------------------------------------------------------------------
# All N tokens: K full chunks under lax.scan, then the remainder (N mod C tokens) as one
# shorter chunk, so no padded token is ever computed.


def _chunk_len(n: int, chunk_size: int) -> int:
    """C actually used: at most the token count (one chunk when N <= chunk_size), at least 1."""
    return max(1, min(chunk_size, n))


def _split(x: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """[N, ...] -> ([K, C, ...] full chunks, [R, ...] remainder), K = N // C, R = N mod C."""
    k = x.shape[0] // chunk
    return x[: k * chunk].reshape(k, chunk, *x.shape[1:]), x[k * chunk :]


def _forward_all(h, w, tgt, temperature, chunk_size):
    """(logp [N], entropy [N], logsumexp [N])."""
    n = h.shape[0]
    chunk = _chunk_len(n, chunk_size)
    h_full, h_rest = _split(h, chunk)
    t_full, t_rest = _split(tgt, chunk)

    def body(carry, xs):
        h_c, tgt_c = xs
        return carry, _chunk_forward(h_c, w, tgt_c, temperature)

    _, full = jax.lax.scan(body, None, (h_full, t_full))  # 3 x [K, C]
    outs = [x.reshape(-1) for x in full]
    if h_rest.shape[0]:
        rest = _chunk_forward(h_rest, w, t_rest, temperature)  # 3 x [R]
        outs = [jnp.concatenate([a, r]) for a, r in zip(outs, rest, strict=True)]
    return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flat_logprobs(h, w, tgt, temperature, chunk_size):
    """(logp [N], entropy [N]) of N flattened tokens; h [N, D], w [D, V], tgt [N] int32."""
    logp, ent, _ = _forward_all(h, w, tgt, temperature, chunk_size)
    return logp, ent


def _flat_logprobs_fwd(h, w, tgt, temperature, chunk_size):
    logp, ent, lse = _forward_all(h, w, tgt, temperature, chunk_size)
    # Residuals are the inputs (already alive in the caller) and two [N] vectors; the
    # [N, V] logits are recomputed chunk by chunk in the backward, never saved.
    return (logp, ent), (h, w, tgt, lse, ent)


def _flat_logprobs_bwd(temperature, chunk_size, residuals, cotangents):
    h, w, tgt, lse, ent = residuals
    g_logp, g_ent = cotangents  # [N] each
    n = h.shape[0]
    chunk = _chunk_len(n, chunk_size)
    xs_full, xs_rest = zip(
        *(_split(x, chunk) for x in (h, tgt, lse, ent, g_logp, g_ent)), strict=True
    )

    def body(dw_acc, xs):
        h_c, tgt_c, lse_c, ent_c, gl_c, ge_c = xs
        dh, dw = _chunk_backward(h_c, w, tgt_c, lse_c, ent_c, gl_c, ge_c, temperature)
        return dw_acc + dw, dh

    # dW is summed over chunks in float32 in the scan carry ([D, V], the size of the head).
    dw_acc, dh_full = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs_full)
    dh = dh_full.reshape(-1, h.shape[1])
    if xs_rest[0].shape[0]:
        h_r, tgt_r, lse_r, ent_r, gl_r, ge_r = xs_rest
        dh_r, dw_r = _chunk_backward(h_r, w, tgt_r, lse_r, ent_r, gl_r, ge_r, temperature)
        dh = jnp.concatenate([dh, dh_r])
        dw_acc = dw_acc + dw_r
    # Integer targets take a float0 cotangent (no gradient).
    d_tgt = np.zeros(tgt.shape, jax.dtypes.float0)
    return dh.astype(h.dtype), dw_acc.astype(w.dtype), d_tgt


_flat_logprobs.defvjp(_flat_logprobs_fwd, _flat_logprobs_bwd)
