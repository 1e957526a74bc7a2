"""M2PO: the second moment of the log importance ratio as the trust region, for stale data
(``algo.loss=m2po``): maths, term, metrics and registration, in three readings.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Zheng, Zhao, Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale
Data on LLMs?", arXiv 2510.01161 (τ = 0.04 in all their runs). Its Algorithm 1 drops the
largest (log ρ)² among "all trust-region tokens" until their mean is ≤ τ and then trains
ℓ = -M ρ A with no ratio clip; implementations disagree on which tokens those are, and the
authors' own code does not mask at all. ``algo.m2po.reading`` picks one of three:

    log ρ_t = sg(logp_t) - behav_t,  v_t = (log ρ_t)²       π_θ/π_behav of token t
    S = {t valid : A_t > 0 and log ρ_t > 0, or A_t < 0 and log ρ_t < 0}
                                    the clip side: where PPO's ε-clip can bind

* ``all_tokens_mask`` (default): over every valid token, drop the largest v_t until the
  mean of the rest is < τ, keeping at least one token; ℓ_t = -M_t ρ_t A_t. AReaL's
  reading (``areal/trainer/ppo/actor.py``, ``_get_m2po_loss_mask``), the only one this
  module had before the option.
* ``clip_side_mask``: over S only, drop the largest v_t until the mean over the rest of S
  is ≤ τ (all of S may go); tokens outside S are never dropped; ℓ_t = -M_t ρ_t A_t. The
  final (ICLR 2026) paper's Algorithm 1 as ms-swift (PR 9965, ``swift/rl_core/m2po.py``)
  and Trinity-RFT (PR 616, ``trinity/algorithm/policy_loss_fn/m2po_policy_loss.py``) read
  it, and the set the authors' code measures M̂₂ on.
* ``derived_clip``: the authors' released code (github.com/Infini-AI-Lab/M2PO,
  ``verl/trainer/ppo/core_algos.py``, ``compute_m2po_policy_loss``): no mask; if the mean
  of v over S exceeds τ, a bound b on v is derived from the budget (:func:`m2po_bound`)
  and PPO's clip runs with ε_low = 1 - e^{-√b}, ε_high = e^{√b} - 1, which zeroes the
  gradient of exactly the tokens of S with v_t > b.

Differences from the references, each deliberate:

* The ratio is measured at the weights being differentiated (the paper's π_θ and the
  authors' code): AReaL, which must build the mask before its forward pass, uses the
  recomputed prox in its place, the same numbers with one minibatch per step.
* The mask or bound is built per micro-batch, as in AReaL's and the authors' code (both
  call the loss once per micro-batch; ms-swift and Trinity-RFT select once per optimizer
  batch). With ``system.batch.micro_batch_size=0`` the micro-batch is the minibatch, the paper's
  batch-level M̂₂. With several micro-batches each one's kept tokens satisfy the bound, but
  the tokens dropped (or the bound b) can differ from one pass over the whole minibatch:
  the one part of this loss that does not add exactly across micro-batches.
* The clip side is decided per token from A_t's sign: the authors' code takes each
  sequence's first advantage (and |A| > 1e-12), the same set for this repo's estimators,
  which give one advantage per sequence.
* ``derived_clip``: a token exactly at the bound (v_t = b) keeps its gradient; the
  authors' bound is √(b - 1e-12), a difference float32 cannot resolve. Their
  ``miniclip_low|high`` floors are not applied: their released run script does not set
  them, and ``dp_actor.py`` then passes None.
* M2PO has no proximal anchor: ``algo.prox`` is not read (any value is accepted and no
  recompute pass runs); ``algo.clip_eps`` and the weight caps are not read either.

Shape letters: B sequences (b in a micro-batch), T tokens, L = b·T.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core.checks import check_choice, check_positive, check_rank, check_same_shape
from a3po_jax.core.objectives.ppo import Aggregate, token_loss
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.objectives.spec import ObjectiveSpec, check_number, token_term
from a3po_jax.core.stats import Stats, combine, masked_ess, masked_max, masked_pair, staleness_stats

Batch = dict[str, jax.Array]


def _sorted_decreasing(v: jax.Array, candidates: jax.Array):
    """``v`` over ``candidates`` sorted decreasing (stable; the others last, as 0), with
    the suffix means Σ_{j ≥ i} v_j / (n - i), n the number of candidates."""
    order = jnp.argsort(-jnp.where(candidates, v, -jnp.inf), stable=True)  # [L]
    v_sorted = jnp.where(candidates[order], v[order], 0.0)
    n = jnp.sum(candidates.astype(jnp.int32))
    i = jnp.arange(v.shape[0])
    suffix = jnp.cumsum(v_sorted[::-1])[::-1]  # Σ_{j ≥ i} v_j (the others add 0)
    suffix_mean = suffix / jnp.maximum(n - i, 1).astype(jnp.float32)
    return order, suffix_mean, n, i


def _keep_from_rank(order, i, k, candidates):
    """The candidates whose position in the decreasing sort is ≥ k (the k largest go)."""
    rank = jnp.zeros_like(i).at[order].set(i)  # position of each token in the sort
    return candidates & (rank >= k)


def m2po_keep(sq_log_ratio: jax.Array, mask: jax.Array, *, tau: float) -> jax.Array:
    """``all_tokens_mask``: the valid tokens kept once the largest squared log-ratios are
    dropped until the mean of the rest is < τ (AReaL's ``_get_m2po_loss_mask``).

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
    order, suffix_mean, n, i = _sorted_decreasing(v, valid)
    below = (suffix_mean < tau) & (i < n)
    k = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
    return _keep_from_rank(order, i, k, valid).reshape(mask.shape)


def m2po_clip_side(log_ratio: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """S, the valid tokens on the side where PPO's ε-clip can bind: A_t > 0 with
    log ρ_t > 0, or A_t < 0 with log ρ_t < 0 (the authors' "trust-region tokens",
    ``_get_trust_region_tokens_delta_sq``). ``[B, T]`` bool; no gradient."""
    check_same_shape("log_ratio", log_ratio, advantages=advantages, mask=mask)
    lr = jax.lax.stop_gradient(log_ratio)
    adv = jax.lax.stop_gradient(advantages)
    return (mask > 0) & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))


def m2po_clip_side_keep(
    sq_log_ratio: jax.Array, mask: jax.Array, clip_side: jax.Array, *, tau: float
) -> jax.Array:
    """``clip_side_mask``: the valid tokens kept once the largest squared log-ratios of the
    clip side S are dropped until the mean over the rest of S is ≤ τ (Algorithm 1 with
    T = S: ``while mean_T v > τ: drop argmax_T v``).

    Sort S's n values decreasing, v_0 ≥ … ≥ v_{n-1}; k is the first i with
    (Σ_{j ≥ i} v_j) / (n - i) ≤ τ, or n if there is none (all of S goes); the k largest
    are dropped (ties in sort order). Tokens outside S are always kept.

    Args:
      sq_log_ratio: ``[B, T]`` (log ρ_t)² ≥ 0.
      mask: ``[B, T]`` 1 for valid tokens.
      clip_side: ``[B, T]`` bool, S (:func:`m2po_clip_side`; only valid tokens).
      tau: τ > 0.

    Returns:
      ``[B, T]`` bool, True for the valid tokens kept.
    """
    check_same_shape("sq_log_ratio", sq_log_ratio, mask=mask, clip_side=clip_side)
    valid = (mask > 0).reshape(-1)
    side = clip_side.reshape(-1) & valid
    v = sq_log_ratio.astype(jnp.float32).reshape(-1)
    order, suffix_mean, n, i = _sorted_decreasing(v, side)
    within = (suffix_mean <= tau) & (i < n)
    k = jnp.where(jnp.any(within), jnp.argmax(within), n)
    kept_side = _keep_from_rank(order, i, k, side)
    return (valid & ~side | kept_side).reshape(mask.shape)


def m2po_bound(sq_log_ratio: jax.Array, clip_side: jax.Array, *, tau: float) -> jax.Array:
    """``derived_clip``'s bound b on (log ρ)², from the budget τ over the clip side S (the
    authors' ``kpo_clip_harmful_tokens`` and ``_solve_tau_from_sorted_delta2``).

    n = |S|. If n = 0 or the mean of v over S is ≤ τ: b = +inf (no clip). Otherwise sort
    S's values increasing, u_0 ≤ … ≤ u_{n-1}; C(j) = Σ_{i<j} u_i + (n - j)·u_j is their
    sum with every value capped at u_j; k is the first j with C(j) ≥ τ·n, and b = u_{k-1}
    (b = 0 when k = 0): the largest breakpoint whose capped mean is below τ, not the exact
    solution of Σ min(u_i, b) = τ·n between breakpoints.

    Args:
      sq_log_ratio: ``[B, T]`` (log ρ_t)² ≥ 0.
      clip_side: ``[B, T]`` bool, S (valid tokens only).
      tau: τ > 0.

    Returns:
      float32 scalar b ≥ 0, or +inf.
    """
    check_same_shape("sq_log_ratio", sq_log_ratio, clip_side=clip_side)
    side = clip_side.reshape(-1)
    v = sq_log_ratio.astype(jnp.float32).reshape(-1)
    order = jnp.argsort(jnp.where(side, v, jnp.inf), stable=True)  # increasing, S first
    u = jnp.where(side[order], v[order], 0.0)
    n = jnp.sum(side.astype(jnp.int32))
    j = jnp.arange(v.shape[0])
    capped = (jnp.cumsum(u) - u) + (n - j).astype(jnp.float32) * u  # C(j)
    budget = tau * n.astype(jnp.float32)
    hit = (capped >= budget) & (j < n)
    # C(n - 1) is the total, > τ·n whenever the clip is on; the fallback only guards
    # float32 rounding of that equality.
    k = jnp.where(jnp.any(hit), jnp.argmax(hit), n - 1)
    b = jnp.where(k >= 1, u[jnp.maximum(k - 1, 0)], 0.0)
    mean = jnp.sum(jnp.where(side, v, 0.0)) / jnp.maximum(n, 1).astype(jnp.float32)
    return jnp.where((n > 0) & (mean > tau), b, jnp.inf)


class Selection(NamedTuple):
    """What a reading decides for one micro-batch, all ``[B, T]``."""

    keep: jax.Array  # bool: tokens whose ℓ_t is computed (the others are 0)
    log_ratio: jax.Array  # the log ρ_t that enters ρ_t (held at a bound where clipped)
    no_grad: jax.Array  # bool: valid tokens whose gradient the reading removes
    clip_side: jax.Array | None  # bool S, for the clip-side readings' metrics


def _all_tokens_mask(log_ratio, sq, adv, mask, tau) -> Selection:
    del adv
    keep = m2po_keep(sq, mask, tau=tau)
    return Selection(keep, log_ratio, (mask > 0) & ~keep, None)


def _clip_side_mask(log_ratio, sq, adv, mask, tau) -> Selection:
    side = m2po_clip_side(log_ratio, adv, mask)
    keep = m2po_clip_side_keep(sq, mask, side, tau=tau)
    return Selection(keep, log_ratio, (mask > 0) & ~keep, side)


def _derived_clip(log_ratio, sq, adv, mask, tau) -> Selection:
    side = m2po_clip_side(log_ratio, adv, mask)
    b = m2po_bound(sq, side, tau=tau)
    clipped = side & (sq > b)  # exactly where PPO's clip at [e^{-√b}, e^{√b}] binds
    bound = jnp.sqrt(b)
    # ρ held at e^{±√b} with no gradient, as PPO's max(-Aρ, -A clip(ρ)) does there.
    held = jax.lax.stop_gradient(jnp.clip(log_ratio, -bound, bound))
    return Selection(mask > 0, jnp.where(clipped, held, log_ratio), clipped, side)


class M2PODiagnostics(NamedTuple):
    """Per-token diagnostics of :func:`m2po_per_token`, ``[B, T]`` float32 each."""

    masked: jax.Array  # 0/1: gradient removed by the reading (dropped or clipped)
    m2: jax.Array  # (log ρ_t)²
    ratio: jax.Array  # ρ_t, no gradient
    clip_side: jax.Array | None = None  # 0/1: in S (the clip-side readings)


# (log ρ [B, T], (log ρ)² [B, T], A [B, T], mask [B, T], τ) -> Selection
READINGS: dict[str, Callable[..., Selection]] = {
    "all_tokens_mask": _all_tokens_mask,
    "clip_side_mask": _clip_side_mask,
    "derived_clip": _derived_clip,
}
M2PO_READINGS: tuple[str, ...] = tuple(READINGS)


def m2po_per_token(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float,
    reading: str = "all_tokens_mask",
) -> tuple[jax.Array, M2PODiagnostics]:
    """Per-token M2PO loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`m2po_loss`.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]`` as for :func:`m2po_loss`.
      tau: τ > 0.
      reading: a key of ``READINGS`` (chosen in Python, when the function is traced).

    Returns:
      ``(per_token, diagnostics)``: ``[B, T]`` float32 ℓ_t (0 where masked or dropped) and
      an :class:`M2PODiagnostics` (``clip_side`` set by the clip-side readings).
    """
    check_rank("logp", logp, 2, "[B, T]")
    check_same_shape("logp", logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
    check_positive("tau", tau)
    check_choice("reading", reading, READINGS)
    f32 = jnp.float32
    logp = logp.astype(f32)
    # Behaviour log-probs and advantages are data, never differentiated.
    behav = jax.lax.stop_gradient(behav_logp.astype(f32))
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    valid = mask > 0
    log_ratio = jnp.where(valid, logp - behav, 0.0)  # 0 at padding keeps exp finite there
    sq = jax.lax.stop_gradient(jnp.square(log_ratio))  # the mask is data, not a path
    chosen = READINGS[reading](log_ratio, sq, adv, mask, tau)
    # where, not a multiply: a dropped token's gradient is exactly 0, whatever its ratio.
    per_token = jnp.where(chosen.keep, -jnp.exp(chosen.log_ratio) * adv, 0.0)
    clip_side = None if chosen.clip_side is None else chosen.clip_side.astype(f32)
    diagnostics = M2PODiagnostics(
        masked=chosen.no_grad.astype(f32),
        m2=sq,
        ratio=jax.lax.stop_gradient(jnp.exp(log_ratio)),
        clip_side=clip_side,
    )
    return per_token, diagnostics


def m2po_sums(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregate: Aggregate,
    tau: float,
    reading: str = "all_tokens_mask",
    staleness: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`m2po_per_token` as ``(loss_sum, count, stats)`` that add across micro-batches
    (given each micro-batch's mask or bound); ``loss = loss_sum / count``.

    Returns:
      ``(loss_sum, count, stats)``: ``m2po/masked_frac`` (valid tokens whose gradient the
      reading removes: dropped, or clipped by ``derived_clip``), ``m2po/m2`` (M̂₂ over
      every valid token), ``m2po/m2_kept`` (over the others), ``is/weight_mean|max`` (ρ),
      ``mismatch/masked_frac`` (= ``m2po/masked_frac``), ``mismatch/ess`` (of ρ·M), with
      staleness ``staleness/mean|max``; the clip-side readings add
      ``m2po/clip_side_frac`` (valid tokens in S) and ``m2po/m2_clip_side`` (M̂₂ over S,
      before any drop or clip).
    """
    per_token, diag = m2po_per_token(logp, behav_logp, advantages, mask, tau=tau, reading=reading)
    loss_sum, count = aggregate(per_token, mask)
    kept = mask * (1.0 - diag.masked)
    means = {
        "m2po/masked_frac": masked_pair(diag.masked, mask),
        "m2po/m2": masked_pair(diag.m2, mask),
        "m2po/m2_kept": masked_pair(diag.m2, kept),
        "is/weight_mean": masked_pair(diag.ratio, mask),
        "mismatch/masked_frac": masked_pair(diag.masked, mask),
    }
    if diag.clip_side is not None:
        means["m2po/clip_side_frac"] = masked_pair(diag.clip_side, mask)
        means["m2po/m2_clip_side"] = masked_pair(diag.m2, diag.clip_side)
    stats = Stats(
        means=means,
        maxima={"is/weight_max": masked_max(diag.ratio, mask)},
        ess={"mismatch/ess": masked_ess(diag.ratio * (1.0 - diag.masked), mask)},
    )
    return loss_sum, count, combine(stats, staleness_stats(staleness, mask))


@dataclasses.dataclass(frozen=True)
class M2POSettings:
    """``algo.m2po.*``: the bound and the reading (the module docstring says which is whose)."""

    tau: float = 0.04  # τ > 0 on the mean (log π_θ/π_behav)² of the kept tokens
    reading: str = "all_tokens_mask"  # a key of READINGS

    def __post_init__(self):
        check_number("tau", self.tau, above=0.0)
        check_choice("reading", self.reading, READINGS)


@register("m2po", settings=M2POSettings)
def m2po(spec: ObjectiveSpec) -> Term:
    """``algo.loss=m2po``: :func:`m2po_sums` of each micro-batch (its own mask or bound)
    with ``algo.m2po.tau``, ``algo.m2po.reading`` and the aggregation; no prox rule
    (``algo.prox`` is not read, no recompute pass)."""
    own = spec.settings
    return Term(
        functools.partial(
            token_term, sums=m2po_sums, aggregate=spec.aggregate, tau=own.tau, reading=own.reading
        )
    )


def m2po_loss(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float = 0.04,
    reading: str = "all_tokens_mask",
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """M2PO: the policy gradient on stale data, with the second moment of the log ratio
    bounded instead of PPO's ε-clip.

    log ρ_t = sg(logp_t) - behav_t, v_t = (log ρ_t)², S the clip side (:func:`m2po_clip_side`)
    all_tokens_mask: M_t = 0 for the largest v_t of all valid tokens, dropped until the
                     mean over the rest is < τ (:func:`m2po_keep`)
    clip_side_mask:  M_t = 0 for the largest v_t of S, dropped until the mean over the
                     rest of S is ≤ τ (:func:`m2po_clip_side_keep`)
    ℓ_t = -M_t · exp(logp_t - behav_t) · A_t     (both mask readings: no ratio clip)
    derived_clip:    ℓ_t = max(-A_t ρ_t, -A_t clip(ρ_t, e^{-√b}, e^{√b})), b from the
                     budget τ over S (:func:`m2po_bound`; b = +inf: no clip)
    loss = aggregate(ℓ, m)

    Symbols: logp = log π_θ (differentiated), behav = log π_behav (the policy that sampled
    the data, however stale), A advantages, m the completion mask, τ the bound on M̂₂.
    Zheng, Zhao, Chen, arXiv 2510.01161 (τ = 0.04); the module docstring says which code
    each reading follows. The whole batch is one mask (or one bound) here; the train step
    builds one per micro-batch (:func:`m2po`'s term). This function is ``finalize`` of
    :func:`m2po_sums`.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]``; behav and advantages carry no
        gradient.
      tau: τ > 0.
      reading: one of ``M2PO_READINGS``.
      options: each optional: ``aggregation``, ``denominator``, ``max_len``, ``staleness``.
      aggregation: one of ``AGGREGATIONS`` (the paper: ``token_mean``).
      denominator: global count for micro-batching; defaults to the local count.
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, for the ``staleness/*`` metrics.

    Returns:
      ``(loss, metrics)``: ``m2po/masked_frac``, ``m2po/m2``, ``m2po/m2_kept``,
      ``is/weight_mean|max``, ``mismatch/masked_frac``, ``mismatch/ess``,
      ``loss/num_tokens``, with staleness ``staleness/mean|max``, and for the clip-side
      readings ``m2po/clip_side_frac``, ``m2po/m2_clip_side``.
    """
    return token_loss(
        m2po_sums, logp, behav_logp, advantages, mask, tau=tau, reading=reading, **options
    )
