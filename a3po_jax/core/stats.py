"""Metrics that combine exactly across micro-batches, minibatches and arriving groups.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Reduction happens once, at the top (design.md §3): a loss term reports its metrics as
:class:`Stats` (sums with their counts, totals, maxima, minima, histograms, effective
sample sizes), which
:func:`combine` merges and :func:`finalize` turns into scalars with one division each.
Averaging per micro-batch and then again would weight micro-batches, not tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core import importance
from a3po_jax.core.aggregation import TINY


class Stats(NamedTuple):
    """Metrics in a form that adds across micro-batches, minibatches and arriving groups.

    ``means`` hold ``(Σ value, count)`` and report Σ / count; ``totals`` are sums reported
    as is; ``maxima`` / ``minima`` combine by max / min; ``histograms`` are ``[K]`` counts of
    log importance weights (:func:`a3po_jax.core.importance.log_weight_histogram`) that add
    and report their quantiles as ``<name>_p01|p50|p99``; ``ess`` hold ``(Σ w, Σ w², n)``
    of importance weights (:func:`masked_ess`) and report the normalised effective sample
    size (Σ w)² / (n · Σ w²). A metric's kind is its place here, never its name.
    """

    means: dict[str, tuple[jax.Array, jax.Array]] = {}
    totals: dict[str, jax.Array] = {}
    maxima: dict[str, jax.Array] = {}
    minima: dict[str, jax.Array] = {}
    histograms: dict[str, jax.Array] = {}
    ess: dict[str, tuple[jax.Array, jax.Array, jax.Array]] = {}


# Identities of max / min for "no valid token in this micro-batch"; finalize reports 0.
_NO_MAX = float(jnp.finfo(jnp.float32).min)
_NO_MIN = float(jnp.finfo(jnp.float32).max)


def masked_pair(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(Σ m·x, Σ m)`` in float32, the parts of a masked mean."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * m), jnp.sum(m)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(mask > 0, x.astype(jnp.float32), _NO_MAX))


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.min(jnp.where(mask > 0, x.astype(jnp.float32), _NO_MIN))


def masked_ess(w: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(Σ m·w, Σ m·w², Σ m)`` in float32: the parts of the normalised effective sample
    size (Σ w)² / (n · Σ w²) of importance weights ``w`` over the positions ``mask`` keeps.

    The three sums add across micro-batches, minibatches and arriving groups, so the ESS of
    a whole step is exact (a mean of per-micro-batch ESS would not be). 1 when every weight
    is equal; 1/n when one weight carries everything; a weight of 0 (a dropped token) counts
    in n and lowers it.
    """
    m = mask.astype(jnp.float32)
    w = jnp.where(m > 0, w.astype(jnp.float32), 0.0)
    return jnp.sum(w), jnp.sum(jnp.square(w)), jnp.sum(m)


def staleness_stats(staleness: jax.Array | None, mask: jax.Array) -> Stats:
    """``staleness/mean|max`` of ``[b, T]`` d_t over the tokens ``mask`` keeps (none
    without staleness)."""
    if staleness is None:
        return Stats()
    d = staleness.astype(jnp.float32)
    return Stats(
        means={"staleness/mean": masked_pair(d, mask)},
        maxima={"staleness/max": masked_max(d, mask)},
    )


def combine(a: Stats, b: Stats) -> Stats:
    """Merge two :class:`Stats`: pairs and totals add, maxima max, minima min; a metric in
    only one of them is kept as is."""

    def merge(x, y, op):
        return {k: op(x[k], y[k]) if k in x and k in y else x.get(k, y.get(k)) for k in {**x, **y}}

    def add(u, v):
        return jax.tree.map(jnp.add, u, v)

    return Stats(
        means=merge(a.means, b.means, add),
        totals=merge(a.totals, b.totals, add),
        maxima=merge(a.maxima, b.maxima, jnp.maximum),
        minima=merge(a.minima, b.minima, jnp.minimum),
        histograms=merge(a.histograms, b.histograms, jnp.add),
        ess=merge(a.ess, b.ess, add),
    )


def finalize(stats: Stats) -> dict[str, jax.Array]:
    """Scalars to report: Σ / count for means (0 when the count is 0), totals, maxima and
    minima (0 when no token was valid anywhere), histogram quantiles, and the effective
    sample sizes (Σ w)² / (n · Σ w²) (0 when no token was valid or every weight was 0)."""
    out = {k: s / jnp.maximum(n, TINY) for k, (s, n) in stats.means.items()}
    out.update(stats.totals)
    out.update({k: jnp.where(v == _NO_MAX, 0.0, v) for k, v in stats.maxima.items()})
    out.update({k: jnp.where(v == _NO_MIN, 0.0, v) for k, v in stats.minima.items()})
    names, qs = tuple(importance.QUANTILES), tuple(importance.QUANTILES.values())
    for key, counts in stats.histograms.items():
        values = importance.histogram_quantiles(counts, qs)
        out.update({f"{key}_{name}": values[i] for i, name in enumerate(names)})
    for key, (s1, s2, n) in stats.ess.items():
        # (Σw / Σw²) · Σw / n: never squares a sum, so large weights do not overflow float32;
        # no TINY floor on Σw², which small weights (1e-5 each) legitimately go under.
        w_over_w2 = jnp.where(s2 > 0, s1 / jnp.where(s2 > 0, s2, 1.0), 0.0)
        out[key] = w_over_w2 * s1 / jnp.maximum(n, 1.0)
    return out


def finalized_loss(
    loss_sum: jax.Array,
    count: jax.Array,
    stats: Stats,
    mask: jax.Array,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A whole batch's sums as a public loss's ``(loss, metrics)``: ``loss_sum`` over the
    count (or over a caller-given ``denominator``, the whole batch's count, so that
    micro-batch losses add up), the metrics finalized, and ``loss/num_tokens`` = Σ mask."""
    loss = loss_sum / (count + TINY if denominator is None else denominator)
    metrics = finalize(stats)
    metrics["loss/num_tokens"] = jnp.sum(mask.astype(jnp.float32))
    return loss, metrics
