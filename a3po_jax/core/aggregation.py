"""Aggregation: per-token values to one number, reduced once (design.md §3).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

:func:`aggregate_sum` returns a ``(numerator, count)`` pair that adds across micro-batches,
minibatches and arriving groups; :func:`aggregate` divides once. The modes are a table
(:data:`AGGREGATORS`), so a caller resolves a name once (the train step binds ``mode`` with
``functools.partial(aggregate_sum, mode=...)``) and no string is compared inside the math.

Shape letters: B sequences, T tokens.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from a3po_jax.core.checks import check_choice, check_positive, check_rank, check_same_shape

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

# Added to a count so an all-masked batch reduces to 0 rather than 0/0 = NaN.
TINY = 1e-8


def _token_mean(values, mask, max_len):
    del max_len
    return jnp.sum(values), jnp.sum(mask)


def _seq_mean_token_mean(values, mask, max_len):
    del max_len
    tokens_per_seq = jnp.sum(mask, axis=-1)  # [B]
    per_seq = jnp.sum(values, axis=-1) / (tokens_per_seq + TINY)
    return jnp.sum(per_seq), jnp.sum(tokens_per_seq > 0).astype(jnp.float32)


def _seq_mean_token_sum_norm(values, mask, max_len):
    norm = jnp.shape(values)[-1] if max_len is None else max_len
    check_positive("max_len", norm)
    per_seq = jnp.sum(values, axis=-1) / norm
    return jnp.sum(per_seq), jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


# Each maps (masked values [B, T], mask [B, T], max_len) to (numerator, count).
AGGREGATORS = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}
AGGREGATIONS: tuple[str, ...] = tuple(AGGREGATORS)


def aggregate_sum(
    values: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "token_mean",
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token values as a ``(numerator, count)`` pair: ``aggregate = numerator / count``.

    token_mean:              (Σ_bt m·x,                   Σ_bt m)
    seq_mean_token_mean:     (Σ_b [Σ_t m·x / Σ_t m],      #seqs with ≥ 1 valid token)
    seq_mean_token_sum_norm: (Σ_b [Σ_t m·x / max_len],    #seqs with ≥ 1 valid token)

    Both parts add across micro-batches (and across arriving groups), so a caller that
    splits a batch sums the pairs and divides once, at the top: the result equals the
    full batch's ``aggregate`` exactly. Dr.GRPO's constant normaliser: arXiv 2503.20783.

    Args:
      values: ``[B, T]`` per-token values (may be 0 where a valid token was dropped, e.g. by
        the importance-weight cap: the count comes from ``mask`` alone, so dropped tokens
        still count, as design.md §3 requires).
      mask: ``[B, T]`` validity (1 = completion token).
      mode: one of ``AGGREGATIONS`` (a key of ``AGGREGATORS``).
      max_len: Dr.GRPO's constant normaliser; defaults to T.

    Returns:
      (numerator, count): float32 scalars.
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    check_rank("values", values, 2, "[B, T]")
    check_same_shape("values", values, mask=mask)
    mask = mask.astype(jnp.float32)
    return AGGREGATORS[mode](values.astype(jnp.float32) * mask, mask, max_len)


def aggregate(
    values: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
) -> jax.Array:
    """Reduce per-token values to a scalar, once.

    token_mean:              Σ_bt m·x / Σ_bt m                     (global valid-token count)
    seq_mean_token_mean:     Σ_b [Σ_t m·x / Σ_t m] / #seqs          (sequences with ≥1 valid token)
    seq_mean_token_sum_norm: Σ_b [Σ_t m·x / max_len] / #seqs        (Dr.GRPO, arXiv 2503.20783)

    ``values`` may already be zero where a token was dropped after validity (e.g. by the
    importance-weight cap): the denominator is computed from ``mask`` alone, so dropped
    tokens still count, as design.md §3 requires. ``aggregate_sum`` gives the two parts.

    Args:
      values: ``[B, T]`` per-token values.
      mask: ``[B, T]`` validity (1 = completion token).
      mode: one of ``AGGREGATIONS``.
      denominator: override of the count (valid tokens for ``token_mean``, sequences for
        the others). Pass the *whole batch's* count when reducing micro-batches, then add.
      max_len: Dr.GRPO's constant normaliser; defaults to T.

    Returns:
      scalar float32.
    """
    numerator, count = aggregate_sum(values, mask, mode=mode, max_len=max_len)
    # A caller-given denominator is used as is (it is the whole batch's count); the local
    # count gets TINY so an all-masked batch reduces to 0, not 0/0.
    return numerator / (count + TINY if denominator is None else denominator)
