"""M2PO: the second moment of the log importance ratio as the trust region, for stale data
(``algo.loss=m2po``): maths, term, metrics and registration.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

    log ρ_t = sg(logp_t) - behav_t                   log π_θ/π_behav of token t
    M̂₂ = (1/N) Σ_t (log ρ_t)²                        over the N valid tokens
    mask: sort (log ρ_t)² in decreasing order and drop the largest, one by one, until the
          mean over the kept tokens is < τ (at least one token is kept): M_t ∈ {0, 1}
    ℓ_t = -M_t · exp(logp_t - behav_t) · A_t         no ratio clip
    loss = aggregate(ℓ, m)                           dropped tokens still count (1/Σ|o_i|)

Zheng, Zhao, Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale
Data on LLMs?", arXiv 2510.01161 (τ = 0.04 in all their runs). The drop rule is AReaL's
(``areal/trainer/ppo/actor.py``, ``_get_m2po_loss_mask``): the first k of the sorted
values, k the first index whose suffix mean is < τ, else all but the smallest. The bound
replaces PPO's ε-clip, which under staleness drops the high-entropy tokens that carry the
learning; M2 is non-negative per token, so tokens with ρ > 1 and ρ < 1 cannot cancel as
they do in a KL estimate.

Differences from the references, each deliberate:

* The ratio is measured at the weights being differentiated (the paper's π_θ): AReaL, which
  must build the mask before its forward pass, uses the recomputed prox in its place, the
  same numbers with one minibatch per step.
* The mask is built per micro-batch, as in AReaL's and the authors' verl code (both call
  the loss per micro-batch). With ``system.micro_batch_size=0`` the micro-batch is the
  minibatch, the paper's batch-level M̂₂. With several micro-batches each one's kept
  tokens have a mean < τ (unless only its smallest value is left), so the step's do too,
  but the tokens dropped can differ from one sort of the whole minibatch: the one part of
  this loss that does not add exactly across micro-batches.
* M2PO has no proximal anchor: ``algo.prox`` is not read (any value is accepted and no
  recompute pass runs); ``algo.clip_eps`` and the weight caps are not read either.

Shape letters: B sequences (b in a micro-batch), T tokens, L = b·T.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from a3po_jax.core.aggregation import AGGREGATIONS, aggregate_sum
from a3po_jax.core.checks import check_choice, check_positive, check_rank, check_same_shape
from a3po_jax.core.objectives.ppo import Aggregate
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.stats import Stats, finalized_loss, masked_ess, masked_max, masked_pair

Batch = dict[str, jax.Array]


def m2po_keep(sq_log_ratio: jax.Array, mask: jax.Array, *, tau: float) -> jax.Array:
    """M2PO's mask: the valid tokens kept once the largest squared log-ratios are dropped
    until the mean of the rest is < τ.

    Sort the N valid values decreasing, v_0 ≥ … ≥ v_{N-1}; k is the first i with
    (Σ_{j ≥ i} v_j) / (N - i) < τ, or N - 1 if there is none; the k largest are dropped
    (ties in sort order). Fixed shapes, no Python control flow on values: safe under jit.

    Args:
      sq_log_ratio: ``[B, T]`` (log ρ_t)² ≥ 0.
      mask: ``[B, T]`` 1 for valid tokens.
      tau: τ > 0.

    Returns:
      ``[B, T]`` bool, True for the valid tokens kept.
    """
    check_same_shape("sq_log_ratio", sq_log_ratio, mask=mask)
    valid = (mask > 0).reshape(-1)  # [L]
    v = sq_log_ratio.astype(jnp.float32).reshape(-1)
    # Decreasing order with the invalid positions last (key -inf, negated +inf).
    order = jnp.argsort(-jnp.where(valid, v, -jnp.inf), stable=True)  # [L]
    v_sorted = jnp.where(valid[order], v[order], 0.0)
    n = jnp.sum(valid.astype(jnp.int32))
    i = jnp.arange(v.shape[0])
    suffix = jnp.cumsum(v_sorted[::-1])[::-1]  # Σ_{j ≥ i} v_j (invalid ones add 0)
    below = (suffix / jnp.maximum(n - i, 1).astype(jnp.float32) < tau) & (i < n)
    k = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    rank = jnp.zeros_like(i).at[order].set(i)  # position of each token in the sort
    return (valid & (rank >= k)).reshape(mask.shape)


def m2po_per_token(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token M2PO loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`m2po_loss`.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]`` as for :func:`m2po_loss`.
      tau: τ > 0.

    Returns:
      ``(per_token, diagnostics)``: ``[B, T]`` float32 ℓ_t (0 where masked or dropped) and
      ``[B, T]`` float32 ``"masked"`` (0/1: dropped by the M2 rule), ``"m2"`` ((log ρ_t)²),
      ``"ratio"`` (ρ_t, no gradient).
    """
    check_rank("logp", logp, 2, "[B, T]")
    check_same_shape("logp", logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
    check_positive("tau", tau)
    f32 = jnp.float32
    logp = logp.astype(f32)
    # Behaviour log-probs and advantages are data, never differentiated.
    behav = jax.lax.stop_gradient(behav_logp.astype(f32))
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    valid = mask > 0
    log_ratio = jnp.where(valid, logp - behav, 0.0)  # 0 at padding keeps exp finite there
    sq = jax.lax.stop_gradient(jnp.square(log_ratio))  # the mask is data, not a path
    keep = m2po_keep(sq, mask, tau=tau)
    # where, not a multiply: a dropped token's gradient is exactly 0, whatever its ratio.
    per_token = jnp.where(keep, -jnp.exp(log_ratio) * adv, 0.0)
    diagnostics = {
        "masked": (valid & ~keep).astype(f32),
        "m2": sq,
        "ratio": jax.lax.stop_gradient(jnp.exp(log_ratio)),
    }
    return per_token, diagnostics


def m2po_sums(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregate: Aggregate,
    tau: float,
    staleness: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`m2po_per_token` as ``(loss_sum, count, stats)`` that add across micro-batches
    (given each micro-batch's mask); ``loss = loss_sum / count``.

    Returns:
      ``(loss_sum, count, stats)``: ``m2po/masked_frac`` (valid tokens dropped),
      ``m2po/m2`` (M̂₂ over every valid token), ``m2po/m2_kept`` (over the kept ones,
      < τ), ``is/weight_mean|max`` (ρ), ``mismatch/masked_frac`` (= ``m2po/masked_frac``),
      ``mismatch/ess`` (of ρ·M), with staleness ``staleness/mean|max``.
    """
    per_token, diag = m2po_per_token(logp, behav_logp, advantages, mask, tau=tau)
    loss_sum, count = aggregate(per_token, mask)
    kept = mask * (1.0 - diag["masked"])
    means = {
        "m2po/masked_frac": masked_pair(diag["masked"], mask),
        "m2po/m2": masked_pair(diag["m2"], mask),
        "m2po/m2_kept": masked_pair(diag["m2"], kept),
        "is/weight_mean": masked_pair(diag["ratio"], mask),
        "mismatch/masked_frac": masked_pair(diag["masked"], mask),
    }
    maxima = {"is/weight_max": masked_max(diag["ratio"], mask)}
    if staleness is not None:
        d = staleness.astype(jnp.float32)
        means["staleness/mean"] = masked_pair(d, mask)
        maxima["staleness/max"] = masked_max(d, mask)
    stats = Stats(
        means=means,
        maxima=maxima,
        ess={"mismatch/ess": masked_ess(diag["ratio"] * (1.0 - diag["masked"]), mask)},
    )
    return loss_sum, count, stats


def m2po_term(
    logp: jax.Array,
    mb: Batch,
    *,
    staleness: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    aggregate: Aggregate,
    tau: float,
) -> tuple[jax.Array, jax.Array, Stats]:
    """M2PO on one micro-batch (its own mask): :func:`m2po_sums` of its arrays."""
    del old_logp, ref_logp
    return m2po_sums(
        logp,
        mb["behav_logp"],
        mb["advantages"],
        mb["loss_mask"],
        aggregate=aggregate,
        tau=tau,
        staleness=staleness,
    )


@register("m2po")
def m2po(cfg: Any) -> Term:
    """``algo.loss=m2po``: :func:`m2po_term` with ``algo.m2po_tau`` and the aggregation;
    no prox rule (``algo.prox`` is not read, no recompute pass)."""
    a = cfg.algo
    fn = functools.partial(
        m2po_term,
        aggregate=functools.partial(aggregate_sum, mode=a.aggregation),
        tau=a.m2po_tau,
    )
    return Term(fn)


def m2po_loss(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float = 0.04,
    aggregation: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
    staleness: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """M2PO: the policy gradient on stale data, with the second moment of the log ratio
    bounded by dropping its largest tokens instead of clipping ratios.

    log ρ_t = sg(logp_t) - behav_t
    M_t = 0 for the tokens with the largest (log ρ_t)², dropped until the mean over the
          rest is < τ (see :func:`m2po_keep`), 1 otherwise
    ℓ_t = -M_t · exp(logp_t - behav_t) · A_t
    loss = aggregate(ℓ, m)

    Symbols: logp = log π_θ (differentiated), behav = log π_behav (the policy that sampled
    the data, however stale), A advantages, m the completion mask, τ the bound on M̂₂.
    Zheng, Zhao, Chen, arXiv 2510.01161 (τ = 0.04). The whole batch is one mask here; the
    train step builds one per micro-batch (:func:`m2po_term`). This function is
    ``finalize`` of :func:`m2po_sums`.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]``; behav and advantages carry no
        gradient.
      tau: τ > 0.
      aggregation: one of ``AGGREGATIONS`` (the paper: ``token_mean``).
      denominator: global count for micro-batching; defaults to the local count.
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, for the ``staleness/*`` metrics.

    Returns:
      ``(loss, metrics)``: ``m2po/masked_frac``, ``m2po/m2``, ``m2po/m2_kept``,
      ``is/weight_mean|max``, ``mismatch/masked_frac``, ``mismatch/ess``,
      ``loss/num_tokens`` and, with staleness, ``staleness/mean|max``.
    """
    check_same_shape("logp", logp, staleness=staleness)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    loss_sum, count, stats = m2po_sums(
        logp,
        behav_logp,
        advantages,
        mask,
        aggregate=functools.partial(aggregate_sum, mode=aggregation, max_len=max_len),
        tau=tau,
        staleness=staleness,
    )
    return finalized_loss(loss_sum, count, stats, mask, denominator)
