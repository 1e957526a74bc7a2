"""Next-token sampling for a batch of decode slots with per-slot settings.

Inference layer (engine).

Every setting (temperature, top-k, top-p) is an array over slots, so requests with different
settings share one compiled step. PRNG keys are derived from (request seed, sample index,
step), never from a running key, so a sample's tokens do not depend on which other requests
happen to share the batch.

The log-prob returned with each token is the *behaviour* log-prob the trainer needs:

    logp = log_softmax(logits / T)[token]      (T = 1 when greedy, T == 0)

in float32 and *before* top-k / top-p truncation. A trainer reproduces it exactly with
`token_logprobs(logits / T, targets)`; the truncated distribution would need the truncation
replayed, and its log-probs are 0 for the greedy token, which tells the loss nothing.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

# Explicit so that keys (and thus samples) do not change with jax's default PRNG config.
_PRNG_IMPL = "threefry2x32"
# `sample_tokens_vocab_major` reduces down the vocabulary-major columns from this many slots:
# narrower columns have too few lanes to vectorise (docs/performance.md).
MIN_VOCAB_MAJOR_SLOTS = 8


def split_seed(seed: int) -> tuple[int, int]:
    """A non-negative int64 seed as its (high, low) 32-bit words."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def sample_keys(
    seed_hi: jax.Array, seed_lo: jax.Array, sample_index: jax.Array, step: jax.Array
) -> jax.Array:
    """PRNG keys for (seed, sample_index, step) per slot.

    `key(seed)` is threefry's key data `[hi, lo]`, which is what `jax.random.PRNGKey(seed)`
    gives for a 64-bit seed; the sample index and then the step are folded in.

    Args:
      seed_hi, seed_lo: `[N]` uint32 halves of each slot's request seed.
      sample_index: `[N]` int32 sample number within the request.
      step: `[N]` int32 index of the token being drawn (0 = the token after the prompt).

    Returns:
      `[N]` typed PRNG keys.
    """
    chex.assert_rank([seed_hi, seed_lo, sample_index, step], 1)
    chex.assert_equal_shape([seed_hi, seed_lo, sample_index, step])

    def one(hi, lo, i, t):
        key = jax.random.wrap_key_data(jnp.stack([hi, lo]).astype(jnp.uint32), impl=_PRNG_IMPL)
        return jax.random.fold_in(jax.random.fold_in(key, i), t)

    return jax.vmap(one)(seed_hi, seed_lo, sample_index, step)


def first_argmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jnp.argmax(x, axis)` (the first index of each maximum along `axis`; of the first NaN
    if there is one) as two plain reductions, a max and then a min over the indices that
    reach it. XLA:CPU runs argmax as one variadic (value, index) reduction, which it does not
    vectorise, and these two plain reductions it does (docs/performance.md). Same result,
    including ties and NaNs (XLA's max propagates NaN).

    Args:
      x: floats.
      axis: the axis to reduce (the vocabulary).
    Returns:
      int32 indices, `x`'s shape without `axis`.
    """
    top = jnp.max(x, axis=axis, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[axis]), axis=axis)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.vmap(jax.random.categorical)(keys, logits)`, the same draw, faster on XLA:CPU:
    the Gumbel-max trick with `jax.random.gumbel`'s noise (the numbers `categorical` adds)
    and `first_argmax` in place of argmax. Same tokens for the same keys (a test).

    Args:
      keys: `[N]` PRNG keys.
      logits: `[N, V]` float logits (-inf = never drawn).
    Returns:
      `[N]` int32 tokens.
    """
    V = logits.shape[-1]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), logits.dtype))(keys)  # [N, V]
    return first_argmax(logits + noise)


def truncate_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    Top-p is taken over the distribution renormalised on the top-k set (as in Hugging Face
    and vLLM). The most likely token is always kept. Tokens tied with the last kept value are
    kept too (a threshold, not an index cut).

    Args:
      scaled: `[N, V]` float32 temperature-scaled logits.
      top_k: `[N]` int32, 0 = off.
      top_p: `[N]` float32 in (0, 1], 1 = off.

    Returns:
      `[N, V]` logits with the truncated tokens at -inf.
    """
    chex.assert_rank(scaled, 2)
    N, V = scaled.shape
    chex.assert_shape([top_k, top_p], (N,))
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [N, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)  # [N]
    rank = jnp.arange(V)[None, :]  # [1, V]
    in_top_k = rank < k[:, None]  # [N, V]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)  # [N, V]
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [N, V]
    # A token is in the nucleus if the more likely tokens do not already reach top_p.
    keep = in_top_k & (mass_before < top_p[:, None])  # [N, V]; rank 0 always kept
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # [N]
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)  # [N, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per slot from `[N, V]` logits and returns it with its behaviour
    log-prob: `sample_tokens_vocab_major`'s draw, reduced along the rows as they lie.

    Args:
      logits: `[N, V]` next-token logits (any float dtype; computed in float32).
      keys, temperature, top_k, top_p: as in `sample_tokens_vocab_major`.

    Returns:
      tokens `[N]` int32 and logprobs `[N]` float32 (`sample_tokens_vocab_major`).
    """
    return _sample(logits, 1, keys, temperature, top_k, top_p)


def sample_tokens_vocab_major(
    logits_t: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per slot and returns it with its behaviour log-prob, from the logits
    laid out vocabulary-major: `[V, N]`, one column per slot.

    That is the layout the decode step's lm_head produces (the [V, D] table is the GEMM's
    left operand, `decode_layout.apply_decode(..., vocab_major=True)`), and every reduction over
    the vocabulary then runs down the columns, N contiguous slots at a time, which XLA:CPU
    vectorises; over `[N, V]` rows it reduced each row alone (docs/performance.md). Below
    `MIN_VOCAB_MAJOR_SLOTS` slots a column is too narrow to vectorise, and the few rows are
    reduced instead. Greedy rows take the argmax of the raw logits
    (T := 1 there, the same index); sampled rows are drawn from `[N, V]` rows
    (`categorical`'s Gumbel noise is drawn a row per key), transposed only in that branch.

    Args:
      logits_t: `[V, N]` next-token logits (any float dtype; computed in float32).
      keys: `[N]` PRNG keys (see `sample_keys`).
      temperature: `[N]` float32; 0 = greedy.
      top_k: `[N]` int32; 0 = off.
      top_p: `[N]` float32 in (0, 1]; 1 = off.

    Returns:
      tokens `[N]` int32 and logprobs `[N]` float32, `log_softmax(logits / T)[token]` before
      truncation (T := 1 for greedy rows).
    """
    chex.assert_rank(logits_t, 2)
    # Down the columns from MIN_VOCAB_MAJOR_SLOTS slots; with fewer, a column has too few
    # lanes and each reduction runs one element at a time, so the few rows are reduced.
    if logits_t.shape[1] >= MIN_VOCAB_MAJOR_SLOTS:
        return _sample(logits_t, 0, keys, temperature, top_k, top_p)
    return _sample(logits_t.T, 1, keys, temperature, top_k, top_p)  # free for one slot


def _sample(
    x: jax.Array,
    axis: int,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The draw and log-prob of `sample_tokens_vocab_major` on logits `x` whose vocabulary
    axis is `axis` (0: [V, N], 1: [N, V])."""
    chex.assert_rank(x, 2)
    N = x.shape[1 - axis]
    chex.assert_shape([temperature, top_k, top_p], (N,))
    chex.assert_shape(keys, (N,))
    # Softmax in float32: bfloat16 log-probs are off by ~1e-2, the size of the PPO clip range.
    x = x.astype(jnp.float32)
    greedy = temperature <= 0.0  # [N]
    scale = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)  # [N]
    scale_x = jnp.expand_dims(scale, axis)  # broadcasts against x
    greedy_tokens = first_argmax(x, axis=axis)  # [N]; == that of logits / T on greedy rows

    def draw(x):
        scaled = x / scale_x
        scaled = scaled.T if axis == 0 else scaled  # [N, V]
        # Sorting V per step is the costliest part of sampling: skip it (lax.cond runs one
        # branch) when no sampled slot asks for truncation.
        wants_truncation = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
        candidates = jax.lax.cond(
            wants_truncation, lambda x: truncate_logits(x, top_k, top_p), lambda x: x, scaled
        )  # [N, V]
        return categorical(keys, candidates)  # V random numbers a row

    # An all-greedy batch (evaluation, the benchmarks) reads the logits only to reduce them.
    drawn = jax.lax.cond(jnp.all(greedy), lambda x: greedy_tokens, draw, x)  # [N]
    tokens = jnp.where(greedy, greedy_tokens, drawn).astype(jnp.int32)  # [N]
    # log_softmax(logits / T)[token] without the [V, N] log-probs: the same operations as
    # jax.nn.log_softmax ((x - max) - log(sum(exp(x - max)))) at one index per slot. The
    # maximum of logits / T is the raw maximum / T exactly (x -> x / T is monotone, and so
    # is its rounding), so the max pass is shared with the greedy argmax.
    top = jnp.max(x, axis=axis, keepdims=True) / scale_x
    log_z = jnp.log(jnp.sum(jnp.exp(x / scale_x - top), axis=axis))  # [N]
    picked = jnp.take_along_axis(x, jnp.expand_dims(tokens, axis), axis=axis) / scale_x
    logprobs = jnp.squeeze(picked - top, axis) - log_z  # [N]
    return tokens, logprobs
