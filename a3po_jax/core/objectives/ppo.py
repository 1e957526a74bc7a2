"""Decoupled PPO (the clip family: A-3PO, recompute, naive PPO): maths, term, metrics.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

    r_t = exp(logp_t - prox_t),  w_t = sg(exp(prox_t - behav_t))
    ℓ_t = w_t · max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))

Hilton et al., "Batch size-invariance for policy optimization", arXiv 2110.00641; AReaL,
arXiv 2505.24298; A-3PO's prox, arXiv 2512.06547 (:mod:`a3po_jax.core.prox`).

One road from the per-token maths to both callers:

* :func:`decoupled_ppo_per_token`: ℓ_t and per-token diagnostics, unreduced;
* :func:`decoupled_ppo_sums`: their ``(loss_sum, count, Stats)``, which add across
  micro-batches, minibatches and arriving groups;
* :func:`ppo`: the train step's term for one micro-batch: the prox rule, then the sums
  (:func:`a3po_jax.core.objectives.spec.token_term`);
* :func:`decoupled_ppo_loss` / :func:`ppo_clip_loss`: the public losses, the sums of a
  whole batch finalized (``loss = loss_sum / count``, metrics divided once).

The objective ``ppo`` (``algo.loss=ppo``) binds the prox rule (``algo.prox``), the caps and
the aggregation from its :class:`~a3po_jax.core.objectives.spec.ObjectiveSpec` once, in
:func:`ppo`; it has no settings of its own (the clip is ``algo.clip_eps`` and its kin).

Shape letters: B sequences (b in a micro-batch), T tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core import importance
from a3po_jax.core.aggregation import AGGREGATIONS, aggregate_sum
from a3po_jax.core.checks import check_choice, check_positive, check_rank, check_same_shape
from a3po_jax.core.importance import SequenceCorrection
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.objectives.spec import ObjectiveSpec
from a3po_jax.core.stats import (
    Stats,
    combine,
    finalized_loss,
    masked_ess,
    masked_max,
    masked_min,
    masked_pair,
    staleness_stats,
)

Aggregate = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]

# Token-level cap of the behaviour weight w (Yao et al. 2025, TIS/MIS): over = w > cap
# (valid tokens only) -> (weight, keep, masked, truncated). Chosen by table lookup when the
# loss is traced; no string is compared inside the math.
_TOKEN_CAPS = {
    "mask": lambda weight, keep, over, cap: (weight, keep & ~over, over, jnp.zeros_like(over)),
    "truncate": lambda weight, keep, over, cap: (
        jnp.minimum(weight, cap),
        keep,
        jnp.zeros_like(over),
        over,
    ),
}
CAP_MODES: tuple[str, ...] = tuple(_TOKEN_CAPS)


def check_token_arrays(
    logp: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array, advantages: jax.Array, mask
) -> None:
    """The ``[B, T]`` arrays of a token-level objective: rank 2, one shape."""
    check_rank("logp", logp, 2, "[B, T]")
    others = {"prox_logp": prox_logp, "behav_logp": behav_logp, "advantages": advantages}
    check_same_shape("logp", logp, **others, mask=mask)


class Diagnostics(NamedTuple):
    """Per-token diagnostics of :func:`decoupled_ppo_per_token`: ``[B, T]`` float32 each,
    meaningful where the mask is 1 (a pytree: it may cross ``jit``)."""

    clipped: jax.Array  # 0/1: the ε-clip binds
    dual_clipped: jax.Array  # 0/1: the dual clip binds
    capped: jax.Array  # 0/1: a cap (token or sequence) acted on the token
    masked: jax.Array  # 0/1: the token left the loss (a cap, or IcePop's band)
    truncated: jax.Array  # 0/1: its weight was lowered to the cap
    is_weight: jax.Array  # the weight the loss applies
    log_is_weight: jax.Array  # log w_t = prox - behav, before any cap
    kl_behav_k3: jax.Array  # k3 estimate of KL(π_behav ‖ π_θ)
    # With a sequence-level correction, [B]: log W_b before the cap, and 0/1 per sequence.
    seq_log_weight: jax.Array | None = None
    seq_masked: jax.Array | None = None
    seq_truncated: jax.Array | None = None


# --------------------------------------------------------------------------------------
# Per-token maths.
# --------------------------------------------------------------------------------------


def decoupled_ppo_per_token(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = None,
    cap_mode: str = "mask",
    seq_correction: Callable[[jax.Array, jax.Array], SequenceCorrection] | None = None,
) -> tuple[jax.Array, Diagnostics]:
    """Per-token decoupled PPO loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`decoupled_ppo_loss` (``aggregate`` of
    this ℓ); a micro-batched step reduces these values once, not averaging averages.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for
        :func:`decoupled_ppo_loss`.
      clip_eps, clip_eps_high, dual_clip, behav_weight_cap, cap_mode: as there.
      seq_correction: sequence-level weights from
        :func:`a3po_jax.core.importance.make_sequence_correction` (seq-TIS / seq-MIS), which
        replace the token weight w_t by the capped sequence weight ω_b on every token of
        sequence b; None keeps the token-level w_t. Not together with ``behav_weight_cap``.

    Returns:
      ``(per_token, diagnostics)``: ``per_token`` ``[B, T]`` float32 ℓ_t (0 where masked or
      dropped by the cap); ``diagnostics`` a :class:`Diagnostics`, its ``seq_*`` fields set
      with ``seq_correction``.
    """
    check_token_arrays(logp, prox_logp, behav_logp, advantages, mask)
    check_positive("clip_eps", clip_eps)
    check_positive("clip_eps_high", clip_eps_high)
    check_positive("dual_clip", dual_clip, minimum=1.0)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    valid = mask.astype(bool)
    logp = logp.astype(jnp.float32)
    # The anchor and the behaviour policy are data, never differentiated.
    prox = jax.lax.stop_gradient(prox_logp.astype(jnp.float32))
    behav = jax.lax.stop_gradient(behav_logp.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))

    # Log-ratios are masked to 0 before exp so padding (where log-probs may be garbage or
    # -inf) cannot create inf * 0 = NaN in the sums.
    log_r = jnp.where(valid, logp - prox, 0.0)
    log_w = jnp.where(valid, prox - behav, 0.0)
    ratio = jnp.exp(log_r)
    caps = _capped_weight(log_w, valid, behav_weight_cap, cap_mode, seq_correction)
    weight, keep, masked, truncated, capped, seq_diag = caps

    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg = jnp.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped) & valid
    dual_hit = jnp.zeros_like(valid)
    if dual_clip is not None:
        bound = -dual_clip * adv  # positive where adv < 0
        dual_hit = (adv < 0) & (pg > bound) & valid
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    per_token = jnp.where(keep, weight * pg, 0.0)

    x = behav - logp  # k3 estimator of KL(π_behav ‖ π_θ) on samples from π_behav
    k3 = jnp.where(valid, jnp.expm1(jnp.where(valid, x, 0.0)) - x, 0.0)
    f32 = jnp.float32
    diagnostics = Diagnostics(
        clipped=clip_hit.astype(f32),
        dual_clipped=dual_hit.astype(f32),
        capped=capped.astype(f32),
        masked=masked.astype(f32),
        truncated=truncated.astype(f32),
        is_weight=weight,
        log_is_weight=log_w,
        kl_behav_k3=jax.lax.stop_gradient(k3),
        **seq_diag,
    )
    return per_token, diagnostics


def _capped_weight(
    log_w: jax.Array,
    valid: jax.Array,
    behav_weight_cap: float | None,
    cap_mode: str,
    seq_correction: Callable[[jax.Array, jax.Array], SequenceCorrection] | None,
) -> tuple[Any, ...]:
    """The weight w_t = exp(log_w) after the token or the sequence cap (or none), as
    ``(weight, keep, masked, truncated, capped, seq_diag)``: ``[B, T]`` arrays (bool but
    the weight) and the sequence cap's ``[B]`` diagnostics (a dict, empty without it)."""
    check_positive("behav_weight_cap", behav_weight_cap)
    check_choice("cap_mode", cap_mode, CAP_MODES)
    weight = jnp.exp(log_w)
    keep = valid
    none = jnp.zeros_like(valid)
    masked = truncated = capped = none
    seq_diag: dict[str, jax.Array] = {}
    if seq_correction is not None and behav_weight_cap is not None:
        raise ValueError(
            "behav_weight_cap (token-level) and seq_correction (sequence-level) are "
            "alternatives: set one of them"
        )
    if seq_correction is not None:
        corr = seq_correction(log_w, valid)
        weight = corr.token_weight
        keep = valid & corr.seq_keep[:, None]
        masked = valid & ~corr.seq_keep[:, None]
        truncated = valid & corr.seq_truncated[:, None]
        capped = masked | truncated
        seq_diag = {
            "seq_log_weight": corr.log_seq_weight,
            "seq_masked": (~corr.seq_keep).astype(jnp.float32),
            "seq_truncated": corr.seq_truncated.astype(jnp.float32),
        }
    elif behav_weight_cap is not None:
        capped = (weight > behav_weight_cap) & valid
        weight, keep, masked, truncated = _TOKEN_CAPS[cap_mode](
            weight, keep, capped, behav_weight_cap
        )
    return weight, keep, masked, truncated, capped, seq_diag


# --------------------------------------------------------------------------------------
# Sums and metrics that add across micro-batches.
# --------------------------------------------------------------------------------------


def decoupled_ppo_sums(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregate: Aggregate,
    staleness: jax.Array | None = None,
    **clip: Any,
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`decoupled_ppo_per_token` reduced by ``aggregate`` into ``(loss_sum, count)``,
    with its metrics as :class:`~a3po_jax.core.stats.Stats`; ``loss = loss_sum / count``.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for
        :func:`decoupled_ppo_loss`.
      aggregate: ``(per_token [B, T], mask [B, T]) -> (numerator, count)``, e.g.
        ``functools.partial(aggregation.aggregate_sum, mode="token_mean")``.
      staleness: ``[B, T]`` d_t, for the ``staleness/*`` and fresh-token metrics, or None.
      clip: ``clip_eps``, ``clip_eps_high``, ``dual_clip``, ``behav_weight_cap``,
        ``cap_mode``, ``seq_correction`` of :func:`decoupled_ppo_per_token`.

    Returns:
      ``(loss_sum, count, stats)``: ``loss/clipfrac``, ``loss/dual_clipfrac``,
      ``is/weight_mean|max|min``, ``is/capped_frac``, ``kl/behav_k3``, with staleness
      ``staleness/mean|max``, and the ``mismatch/*`` metrics of :func:`mismatch_stats`.
    """
    per_token, diag = decoupled_ppo_per_token(logp, prox_logp, behav_logp, advantages, mask, **clip)
    loss_sum, count = aggregate(per_token, mask)
    return loss_sum, count, token_stats(logp, behav_logp, staleness, mask, diag)


def token_stats(
    logp: jax.Array,
    behav_logp: jax.Array,
    staleness: jax.Array | None,
    mask: jax.Array,
    diag: Diagnostics,
) -> Stats:
    """The metrics of :func:`decoupled_ppo_sums` from :func:`decoupled_ppo_per_token`'s
    diagnostics (or IcePop's, its band as ``masked``): ``loss/clipfrac``,
    ``loss/dual_clipfrac``, ``is/*``, ``kl/behav_k3``, ``staleness/*`` and
    :func:`mismatch_stats`.

    Args:
      logp, behav_logp: ``[b, T]`` current and behaviour log-probs.
      staleness: ``[b, T]`` d_t, or None.
      mask: ``[b, T]`` loss mask.
      diag: the per-token diagnostics.
    """
    stats = Stats(
        means={
            "loss/clipfrac": masked_pair(diag.clipped, mask),
            "loss/dual_clipfrac": masked_pair(diag.dual_clipped, mask),
            "is/weight_mean": masked_pair(diag.is_weight, mask),
            "is/capped_frac": masked_pair(diag.capped, mask),
            "kl/behav_k3": masked_pair(diag.kl_behav_k3, mask),
        },
        maxima={"is/weight_max": masked_max(diag.is_weight, mask)},
        minima={"is/weight_min": masked_min(diag.is_weight, mask)},
    )
    stats = combine(stats, staleness_stats(staleness, mask))
    return combine(stats, mismatch_stats(logp, behav_logp, staleness, mask, diag))


def mismatch_stats(
    logp: jax.Array,
    behav_logp: jax.Array,
    staleness: jax.Array | None,
    mask: jax.Array,
    diag: Diagnostics,
) -> Stats:
    """The train-inference mismatch of one micro-batch, as :class:`Stats` that add.

    mismatch/k3_kl_fresh       k3 estimate of KL(π_behav ‖ π_θ), x = behav - logp,
                               k3 = e^x - 1 - x, over valid tokens with staleness d = 0
                               only: there π_behav and π_θ are the same weights, so what
                               remains is the mismatch of the two programs
    mismatch/fresh_tokens      the count of those tokens (a total)
    mismatch/iw_p01|p50|p99    quantiles of the token weight w_t = π_prox/π_behav before
                               any cap, over every valid token of the step (a histogram,
                               see :mod:`a3po_jax.core.importance`); iw_min / iw_max exact
    mismatch/masked_frac       valid tokens dropped from the loss by the token or the
                               sequence cap; truncated_frac: weight lowered to the cap
    mismatch/seq_masked_frac   sequences (with ≥ 1 valid token) dropped / truncated by
    mismatch/seq_truncated_frac  the sequence cap (0 with the token-level cap)
    mismatch/seq_log_iw_min|max  log W_b = Σ_t log w_t of the sequences (log: a product
                               over a long response overflows float32)
    mismatch/ess               normalised effective sample size (Σ w)² / (n · Σ w²) of
                               the weights the loss applies (after the cap; 0 for a
                               dropped token) over the n valid tokens: 1 when every
                               token weighs the same, → 1/n when one token dominates

    Args:
      logp, behav_logp: ``[b, T]`` current and behaviour log-probs.
      staleness: ``[b, T]`` d_t, or None (then no ``k3_kl_fresh`` / ``fresh_tokens``).
      mask: ``[b, T]`` loss mask.
      diag: :func:`decoupled_ppo_per_token`'s diagnostics.
    """
    valid = mask > 0
    fresh = None if staleness is None else valid & (staleness == 0)
    if fresh is not None:
        x = jnp.where(fresh, behav_logp.astype(jnp.float32) - logp.astype(jnp.float32), 0.0)
        k3 = jax.lax.stop_gradient(jnp.expm1(x) - x)
    log_w = diag.log_is_weight
    w = jnp.exp(log_w)
    rows = jnp.any(valid, axis=-1)  # [b] sequences with a valid token
    if diag.seq_log_weight is not None:  # the sequence-level correction is on
        log_seq, seq_masked, seq_truncated = (
            diag.seq_log_weight,
            diag.seq_masked,
            diag.seq_truncated,
        )
    else:
        log_seq = jnp.sum(jnp.where(valid, log_w, 0.0), axis=-1)
        seq_masked = seq_truncated = jnp.zeros_like(log_seq)
    means = {} if fresh is None else {"mismatch/k3_kl_fresh": masked_pair(k3, fresh)}
    means.update(
        {
            "mismatch/masked_frac": masked_pair(diag.masked, mask),
            "mismatch/truncated_frac": masked_pair(diag.truncated, mask),
            "mismatch/seq_masked_frac": masked_pair(seq_masked, rows),
            "mismatch/seq_truncated_frac": masked_pair(seq_truncated, rows),
        }
    )
    totals = {} if fresh is None else {"mismatch/fresh_tokens": jnp.sum(fresh.astype(jnp.float32))}
    return Stats(
        means=means,
        totals=totals,
        maxima={
            "mismatch/iw_max": masked_max(w, mask),
            "mismatch/seq_log_iw_max": masked_max(log_seq, rows),
        },
        minima={
            "mismatch/iw_min": masked_min(w, mask),
            "mismatch/seq_log_iw_min": masked_min(log_seq, rows),
        },
        histograms={"mismatch/iw": importance.log_weight_histogram(log_w, mask)},
        ess={"mismatch/ess": masked_ess(diag.is_weight * (1.0 - diag.masked), mask)},
    )


# --------------------------------------------------------------------------------------
# The objective's registration: its term is the sums anchored at π_prox (spec.py).
# --------------------------------------------------------------------------------------


@register("ppo")
def ppo(spec: ObjectiveSpec) -> Term:
    """``algo.loss=ppo``: :func:`decoupled_ppo_sums` anchored at the bound prox rule
    (``spec.anchor``), with the clip, the token or sequence cap and the aggregation."""
    return spec.anchored(decoupled_ppo_sums, aggregate=spec.aggregate, **spec.clip.clip_and_caps)


# --------------------------------------------------------------------------------------
# The public losses: a whole batch's sums, finalized.
# --------------------------------------------------------------------------------------


def decoupled_ppo_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO clip loss with separate behaviour and proximal policies.

    r_t = exp(logp_t - prox_t)                               trust-region ratio
    w_t = sg(exp(prox_t - behav_t))                          off-policy correction
    ℓ_t = w_t · max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))
    dual clip (A_t < 0):  ℓ_t = min(ℓ_t, -c · A_t · w_t),  c > 1
    cap: tokens with w_t > cap dropped ("mask") or w_t := cap ("truncate")
    or, sequence-level (``seq_correction``): w_t := ω_b, the capped Π_t w_t of the token's
    sequence (see :func:`a3po_jax.core.importance.make_sequence_correction`)
    loss = aggregate(ℓ, m)

    Symbols: logp = log π_θ (differentiated), prox = log π_prox (the trust-region anchor:
    recomputed, A-3PO-interpolated, or behav — this function does not know which), behav =
    log π_behav (the policy that sampled the data), A advantages, m the completion mask.
    Hilton et al., "Batch size-invariance for policy optimization", arXiv 2110.00641; used
    for asynchronous RL by AReaL, arXiv 2505.24298. With prox = behav it is exactly PPO's
    clipped objective against the behaviour policy (``ppo_clip_loss``). The per-token ℓ and
    diagnostics, unreduced, are :func:`decoupled_ppo_per_token`; this function is
    ``finalize`` of :func:`decoupled_ppo_sums`, the same sums the train step adds across
    micro-batches (:func:`ppo`'s term), divided once.

    Args:
      logp: ``[B, T]`` current log-probs.
      prox_logp: ``[B, T]`` proximal log-probs (gradient is stopped here regardless).
      behav_logp: ``[B, T]`` behaviour log-probs.
      advantages: ``[B, T]`` per-token advantages (broadcast sequence advantages yourself).
      mask: ``[B, T]`` 1 for tokens that count.
      clip_eps: ε_low > 0.
      options: the keywords below, each optional.
      clip_eps_high: ε_high > 0 (DAPO's clip-higher); defaults to ``clip_eps``.
      dual_clip: c > 1 for dual clipping of negative advantages, or None.
      behav_weight_cap: cap > 0 on w_t, or None.
      cap_mode: ``"mask"`` or ``"truncate"``.
      aggregation: one of ``AGGREGATIONS``.
      denominator: global count for micro-batching (see ``aggregate``).
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, only for the ``staleness/*`` diagnostics.
      seq_correction: sequence-level TIS / MIS instead of the token cap (see
        :func:`decoupled_ppo_per_token`).

    Returns:
      ``(loss, metrics)``: scalar loss and a dict of scalar diagnostics: ``loss/clipfrac``,
      ``loss/dual_clipfrac``, ``is/weight_mean|max|min``, ``is/capped_frac``,
      ``kl/behav_k3`` (approx KL(π_behav‖π_θ) with k3), ``loss/num_tokens``, the
      ``mismatch/*`` metrics of :func:`mismatch_stats` and, with staleness,
      ``staleness/mean|max`` and ``mismatch/k3_kl_fresh|fresh_tokens``.
    """
    return token_loss(
        decoupled_ppo_sums,
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        clip_eps=clip_eps,
        **options,
    )


def token_loss(
    sums: Callable[..., tuple[jax.Array, jax.Array, Stats]],
    *arrays: jax.Array,
    aggregation: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
    staleness: jax.Array | None = None,
    **hyper: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The public loss of a token-level objective: ``sums(*arrays, aggregate=...,
    staleness=..., **hyper)`` over the whole batch, finalized (``loss = loss_sum / count``,
    or over the whole batch's ``denominator``); ``arrays`` start with ``logp`` and end with
    the mask. ``aggregation`` and ``max_len`` (Dr.GRPO's normaliser) pick the aggregation."""
    check_same_shape("logp", arrays[0], staleness=staleness)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    aggregate = functools.partial(aggregate_sum, mode=aggregation, max_len=max_len)
    loss_sum, count, stats = sums(*arrays, aggregate=aggregate, staleness=staleness, **hyper)
    return finalized_loss(loss_sum, count, stats, arrays[-1], denominator)


def ppo_clip_loss(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    **kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Standard PPO clip loss against the behaviour policy (naive async PPO, sync GRPO).

    ℓ_t = max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high)),  r_t = exp(logp_t - behav_t)

    The special case prox = behav of ``decoupled_ppo_loss`` (w_t = 1); Schulman et al.,
    arXiv 1707.06347. Keyword arguments are those of ``decoupled_ppo_loss``.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]``.

    Returns:
      ``(loss, metrics)`` as ``decoupled_ppo_loss``.
    """
    return decoupled_ppo_loss(logp, behav_logp, behav_logp, advantages, mask, **kwargs)
