"""GSPO: a length-normalised sequence importance ratio, clipped per sequence
(``algo.loss=gspo``): maths, term, metrics and registration.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

    s_b = exp((1/n_b) Σ_t m_t (logp_t - prox_t))            sequence ratio to the anchor
    w_b = sg(exp((1/n_b) Σ_t m_t (prox_t - behav_t)))       sequence off-policy weight
    s_bt = sg(s_b) · exp(logp_t - sg(logp_t))               GSPO-token: value s_b
    ℓ_b = w_b · (1/n_b) Σ_t m_t max(-A_t s_bt, -A_t clip(s_bt, 1 - ε_low, 1 + ε_high))
    loss = (1/#sequences) Σ_b ℓ_b                          sequence mean (the paper's)

Zheng et al. (Qwen), "Group Sequence Policy Optimization", arXiv 2507.18071: s_b with
π_old in place of prox, ε_low = 3e-4 and ε_high = 4e-4 (§5.1; a sequence ratio near 1
needs a far narrower band than PPO's token ratio). The token form s_bt is the paper's
GSPO-token: with one advantage per sequence (``grpo``, ``drgrpo``, ``rloo`` here) its
value and gradient are GSPO's exactly, since ∇s_b = s_b · (1/n_b) Σ_t ∇logp_t; with
per-token advantages it is GSPO-token. verl's ``compute_policy_loss_gspo`` is the same
form. A clip decision is one per sequence (s_bt = s_b on every token of b).

The decoupled part is this repo's: the trust region is anchored at prox, and the
behaviour policy enters through w_b, the geometric mean of the token weights π_prox/π_behav
(a sequence weight at the ratio's own length normalisation). Every prox rule makes sense:

* ``behav``: w_b = 1 and s_b is GSPO against the inference host's likelihoods (the
  paper's remark that GSPO can use them directly);
* ``recompute``: GSPO as published (π_old recomputed by the trainer), w_b correcting the
  train/inference mismatch and the staleness;
* ``a3po``: the anchor interpolated by staleness, no recompute pass.

``algo.aggregation`` is not read (GSPO is a sequence mean by construction; the step still
reduces a KL term in the loss with it, so ``seq_mean_token_mean`` keeps the two alike),
nor are ``algo.clip_eps*`` (``algo.gspo.clip_low|high`` are its ε) or the weight caps.

Shape letters: B sequences (b in a micro-batch), T tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core.aggregation import aggregate_sum
from a3po_jax.core.checks import check_positive
from a3po_jax.core.objectives.ppo import Aggregate, check_token_arrays, token_loss
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.objectives.spec import ObjectiveSpec, check_number
from a3po_jax.core.stats import (
    Stats,
    combine,
    masked_ess,
    masked_max,
    masked_min,
    masked_pair,
    staleness_stats,
)

# GSPO's loss is a mean over sequences of each sequence's token mean.
SEQUENCE_MEAN = "seq_mean_token_mean"
_SEQUENCE_MEAN = functools.partial(aggregate_sum, mode=SEQUENCE_MEAN)


class GSPODiagnostics(NamedTuple):
    """Diagnostics of :func:`gspo_per_token`, float32."""

    clipped: jax.Array  # [B, T] 0/1: the clip binds
    log_seq_ratio: jax.Array  # [B] log s_b
    seq_weight: jax.Array  # [B] w_b
    seq_clipped: jax.Array  # [B] 0/1: a token of b clipped


def _sequence_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B]`` Σ_t m·x / n_b (0 for a sequence with no valid token)."""
    n = jnp.sum(mask, axis=-1)
    return jnp.sum(x * mask, axis=-1) / jnp.maximum(n, 1.0)


def gspo_per_token(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[jax.Array, GSPODiagnostics]:
    """Per-token GSPO(-token) loss ℓ_bt and diagnostics, nothing reduced: the loss is the
    mean over sequences of their token means (``seq_mean_token_mean``).

    The formula, symbols and paper are those of :func:`gspo_loss`.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for :func:`gspo_loss`.
      clip_low, clip_high: ε_low in (0, 1), ε_high > 0.

    Returns:
      ``(per_token, diagnostics)``: ``[B, T]`` float32 w_b-weighted clipped terms (0
      where masked) and a :class:`GSPODiagnostics`.
    """
    check_token_arrays(logp, prox_logp, behav_logp, advantages, mask)
    check_positive("clip_low", clip_low)
    check_positive("clip_high", clip_high)
    if clip_low >= 1:
        raise ValueError(f"clip_low must be < 1 (1 - ε_low is a ratio), got {clip_low}")
    f32 = jnp.float32
    m = mask.astype(f32)
    valid = m > 0
    logp = logp.astype(f32)
    # The anchor and the behaviour policy are data, never differentiated.
    prox_ = jax.lax.stop_gradient(prox_logp.astype(f32))
    behav = jax.lax.stop_gradient(behav_logp.astype(f32))
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    log_s = _sequence_mean(jnp.where(valid, logp - prox_, 0.0), m)  # [B]
    log_w = _sequence_mean(jnp.where(valid, prox_ - behav, 0.0), m)  # [B]
    # GSPO-token: value s_b on every token, gradient s_b · ∇logp_t (sg keeps ∇ per token).
    s_bt = jnp.exp(jax.lax.stop_gradient(log_s))[:, None] * jnp.exp(
        logp - jax.lax.stop_gradient(logp)
    )
    unclipped = -adv * s_bt
    clipped = -adv * jnp.clip(s_bt, 1.0 - clip_low, 1.0 + clip_high)
    w = jnp.exp(log_w)  # [B]
    per_token = jnp.where(valid, w[:, None] * jnp.maximum(unclipped, clipped), 0.0)
    clip_hit = (clipped > unclipped) & valid
    diagnostics = GSPODiagnostics(
        clipped=clip_hit.astype(f32),
        log_seq_ratio=jax.lax.stop_gradient(log_s),
        seq_weight=w,
        seq_clipped=jnp.any(clip_hit, axis=-1).astype(f32),
    )
    return per_token, diagnostics


def gspo_sums(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    staleness: jax.Array | None = None,
    aggregate: Aggregate = _SEQUENCE_MEAN,
    **clip: float,
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`gspo_per_token` as ``(loss_sum, count, stats)`` that add across
    micro-batches: ``loss_sum`` = Σ_b ℓ_b, ``count`` = sequences with a valid token;
    ``clip`` is ``clip_low``, ``clip_high`` of :func:`gspo_per_token`; ``aggregate`` is the
    sequence mean GSPO is (its public loss hands in the same one).

    Returns:
      ``(loss_sum, count, stats)``: ``gspo/seq_clipfrac`` (sequences clipped),
      ``loss/clipfrac`` (tokens), ``gspo/seq_ratio_mean|max|min`` (s_b),
      ``is/seq_weight_mean|max|min`` (w_b), ``mismatch/ess`` (of w_b on each valid token)
      and, with staleness, ``staleness/mean|max``.
    """
    per_token, diag = gspo_per_token(logp, prox_logp, behav_logp, advantages, mask, **clip)
    loss_sum, count = aggregate(per_token, mask)
    rows = jnp.any(mask > 0, axis=-1)  # [b] sequences with a valid token
    s, w = jnp.exp(diag.log_seq_ratio), diag.seq_weight
    means = {
        "gspo/seq_clipfrac": masked_pair(diag.seq_clipped, rows),
        "loss/clipfrac": masked_pair(diag.clipped, mask),
        "gspo/seq_ratio_mean": masked_pair(s, rows),
        "is/seq_weight_mean": masked_pair(w, rows),
    }
    stats = Stats(
        means=means,
        maxima={
            "gspo/seq_ratio_max": masked_max(s, rows),
            "is/seq_weight_max": masked_max(w, rows),
        },
        minima={
            "gspo/seq_ratio_min": masked_min(s, rows),
            "is/seq_weight_min": masked_min(w, rows),
        },
        # Token-level, like every objective's mismatch/ess: a sequence weighs its length.
        ess={"mismatch/ess": masked_ess(jnp.broadcast_to(w[:, None], mask.shape), mask)},
    )
    return loss_sum, count, combine(stats, staleness_stats(staleness, mask))


@dataclasses.dataclass(frozen=True)
class GSPOSettings:
    """``algo.gspo.*``: the sequence ratio's clip (paper §5.1)."""

    clip_low: float = 3e-4  # ε_low in (0, 1)
    clip_high: float = 4e-4  # ε_high > 0

    def __post_init__(self):
        check_number("clip_low", self.clip_low, above=0.0, below=1.0)
        check_number("clip_high", self.clip_high, above=0.0)


@register("gspo", settings=GSPOSettings)
def gspo(spec: ObjectiveSpec) -> Term:
    """``algo.loss=gspo``: :func:`gspo_sums` anchored at the bound prox rule (as for
    ``ppo``; a sequence lies in one micro-batch, so its sums add exactly), with
    ``algo.gspo.clip_low|high``."""
    own = spec.settings
    return spec.anchored(gspo_sums, clip_low=own.clip_low, clip_high=own.clip_high)


def gspo_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    denominator: jax.Array | float | None = None,
    staleness: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO: the PPO clip on a length-normalised sequence ratio, one decision per sequence.

    s_b = exp((1/n_b) Σ_t m_t (logp_t - prox_t))
    w_b = sg(exp((1/n_b) Σ_t m_t (prox_t - behav_t)))
    ℓ_b = w_b · (1/n_b) Σ_t m_t max(-A_t s_bt, -A_t clip(s_bt, 1 - ε_low, 1 + ε_high)),
    s_bt = sg(s_b) · exp(logp_t - sg(logp_t))
    loss = Σ_b ℓ_b / #sequences

    Symbols: logp = log π_θ (differentiated), prox = log π_prox (GSPO's π_old), behav =
    log π_behav, A advantages (one per sequence gives GSPO, per token GSPO-token), m the
    completion mask, n_b = Σ_t m_t. Zheng et al., arXiv 2507.18071 (ε_low = 3e-4,
    ε_high = 4e-4). With prox = behav, w_b = 1: GSPO as published against the sampler.
    This function is ``finalize`` of :func:`gspo_sums`.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]``; prox and behav carry no
        gradient.
      clip_low, clip_high: ε_low in (0, 1), ε_high > 0.
      denominator: global number of sequences for micro-batching; defaults to the local.
      staleness: optional ``[B, T]`` d_t, for the ``staleness/*`` metrics.

    Returns:
      ``(loss, metrics)``: ``gspo/seq_clipfrac``, ``loss/clipfrac``,
      ``gspo/seq_ratio_mean|max|min``, ``is/seq_weight_mean|max|min``, ``mismatch/ess``,
      ``loss/num_tokens`` and, with staleness, ``staleness/mean|max``.
    """
    return token_loss(
        gspo_sums,
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        aggregation=SEQUENCE_MEAN,
        clip_low=clip_low,
        clip_high=clip_high,
        denominator=denominator,
        staleness=staleness,
    )
