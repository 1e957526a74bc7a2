"""IcePop: decoupled PPO whose tokens leave the loss when the train/inference ratio is
outside [α, β] (``algo.loss=icepop``): maths, term, metrics and registration.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

    w_t = sg(π_prox(y_t) / π_behav(y_t))                   train / inference ratio
    M(w; α, β) = w if α ≤ w ≤ β, else 0                    two-sided mask (IcePop)
    ℓ_t = M(w_t; α, β) · max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high)),
    r_t = exp(logp_t - prox_t)

Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
Model" (Ring-1T), arXiv 2510.18855, where the ratio is π_train(θ_old)/π_infer(θ_old) and
α = 0.5, β = 5. A token outside the band is *dropped*, not truncated: its gradient is
exactly zero (truncation, TIS, would keep a capped gradient), and it still counts in the
denominator (design §3). It is :mod:`~a3po_jax.core.objectives.ppo`'s per-token loss with
no cap, times the band's 0/1: one road to the clip maths.

Which prox rules it makes sense with (the registration refuses the others):

* ``recompute``: π_prox = the step's starting weights through the trainer's program, so
  w_t is the paper's π_train(θ_old)/π_infer(θ_old) where the rollout's weights are the
  step's (otherwise it also holds the staleness between them);
* ``a3po``: log w_t = (1 - α_d)(sg(logp_t) - behav_t) (α_d = A-3PO's 1/d): at d = 0 the
  paper's train/inference ratio at the current weights, at d ≥ 1 a shrunk staleness ratio;
* not ``behav``: prox = behav gives w_t = 1, so nothing could ever be masked.

``algo.behav_weight_cap`` and ``algo.seq_weight_cap`` are not read: the band replaces them.

Shape letters: B sequences (b in a micro-batch), T tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core.objectives.ppo import (
    Aggregate,
    Diagnostics,
    decoupled_ppo_per_token,
    token_loss,
    token_stats,
)
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.objectives.spec import ObjectiveSpec, check_number
from a3po_jax.core.stats import Stats, combine, masked_pair


class IcePopDiagnostics(NamedTuple):
    """Per-token diagnostics of :func:`icepop_per_token`, ``[B, T]`` float32 each."""

    token: Diagnostics  # PPO's, with ``masked`` the tokens outside the band
    below: jax.Array  # 0/1: w_t < α
    above: jax.Array  # 0/1: w_t > β


def icepop_per_token(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    low: float,
    high: float,
    **clip: Any,
) -> tuple[jax.Array, IcePopDiagnostics]:
    """Per-token IcePop loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`icepop_loss`.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for :func:`icepop_loss`.
      low, high: α and β, 0 < α ≤ 1 ≤ β (checked as :class:`IcePopSettings` checks them).
      clip: ``clip_eps``, ``clip_eps_high``, ``dual_clip``, the trust-region clip of
        :func:`a3po_jax.core.objectives.ppo.decoupled_ppo_per_token`.

    Returns:
      ``(per_token, diagnostics)``: ``[B, T]`` float32 ℓ_t (0 where masked or outside the
      band) and an :class:`IcePopDiagnostics`.
    """
    IcePopSettings(low=low, high=high)
    per_token, diag = decoupled_ppo_per_token(logp, prox_logp, behav_logp, advantages, mask, **clip)
    valid = mask > 0
    w = diag.is_weight  # no cap was applied: w_t = exp(prox_t - behav_t)
    below = valid & (w < low)
    above = valid & (w > high)
    # where, not a multiply: a dropped token's gradient is exactly 0, whatever w_t is.
    per_token = jnp.where(below | above, 0.0, per_token)
    f32 = jnp.float32
    token = diag._replace(masked=(below | above).astype(f32))
    return per_token, IcePopDiagnostics(token, below.astype(f32), above.astype(f32))


def icepop_sums(
    *arrays: jax.Array, aggregate: Aggregate, staleness: jax.Array | None = None, **hyper: Any
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`icepop_per_token` as ``(loss_sum, count, stats)`` that add across
    micro-batches; ``loss = loss_sum / count``.

    Args:
      arrays: ``logp``, ``prox_logp``, ``behav_logp``, ``advantages``, ``mask``, ``[B, T]``.
      aggregate: ``(per_token, mask) -> (numerator, count)``.
      staleness: ``[B, T]`` d_t, or None.
      hyper: ``low``, ``high``, ``clip_eps``, ``clip_eps_high``, ``dual_clip``.

    Returns:
      ``(loss_sum, count, stats)``: ``icepop/masked_frac`` (valid tokens outside [α, β]),
      ``icepop/below_frac`` (w < α), ``icepop/above_frac`` (w > β), the PPO metrics of
      :func:`a3po_jax.core.objectives.ppo.token_stats` (``mismatch/masked_frac`` is the
      band's) and ``mismatch/ess``.
    """
    logp, _, behav_logp, _, mask = arrays
    per_token, diag = icepop_per_token(*arrays, **hyper)
    loss_sum, count = aggregate(per_token, mask)
    own = Stats(
        means={
            "icepop/masked_frac": masked_pair(diag.token.masked, mask),
            "icepop/below_frac": masked_pair(diag.below, mask),
            "icepop/above_frac": masked_pair(diag.above, mask),
        }
    )
    return loss_sum, count, combine(own, token_stats(logp, behav_logp, staleness, mask, diag.token))


@dataclasses.dataclass(frozen=True)
class IcePopSettings:
    """``algo.icepop.*``: the band [α, β] of the train/inference ratio."""

    low: float = 0.5  # α: tokens with π_prox/π_behav < α leave the loss
    high: float = 5.0  # β: tokens with π_prox/π_behav > β leave the loss

    def __post_init__(self):
        check_number("low", self.low, above=0.0)
        check_number("high", self.high, above=0.0)
        # α ≤ 1 ≤ β: a token whose train and inference probabilities agree is always kept.
        if not self.low <= 1.0:
            raise ValueError(f"low must be <= 1 (the band [low, high] holds 1), got {self.low}")
        if not (self.high >= 1.0 and self.high > self.low):
            raise ValueError(f"high must be >= 1 and > low={self.low}, got {self.high}")


@register("icepop", settings=IcePopSettings, prox_rules=("recompute", "a3po"))
def icepop(spec: ObjectiveSpec) -> Term:
    """``algo.loss=icepop``: :func:`icepop_sums` anchored at the bound prox rule (as for
    ``ppo``), with ``algo.icepop.low|high`` (α, β), the clip (``algo.clip_eps``,
    ``clip_eps_high``, ``dual_clip``) and the aggregation."""
    own = spec.settings
    return spec.anchored(
        icepop_sums, aggregate=spec.aggregate, low=own.low, high=own.high, **spec.clip.clip
    )


def icepop_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    low: float = 0.5,
    high: float = 5.0,
    clip_eps: float = 0.2,
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """IcePop: decoupled PPO with tokens outside [α, β] of the train/inference ratio dropped.

    w_t = sg(exp(prox_t - behav_t)),  M(w; α, β) = w if α ≤ w ≤ β else 0
    ℓ_t = M(w_t; α, β) · max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))
    r_t = exp(logp_t - prox_t);  dual clip as in ``decoupled_ppo_loss``
    loss = aggregate(ℓ, m)

    Symbols: logp = log π_θ (differentiated), prox = log π_prox (the trainer's log-probs of
    the step's starting weights with ``prox=recompute``: π_train(θ_old)), behav =
    log π_behav (the inference host's: π_infer(θ_old)), A advantages, m the completion
    mask, α / β the band. Ling Team (Ring-1T), arXiv 2510.18855 (α = 0.5, β = 5 there).
    This function is ``finalize`` of :func:`icepop_sums`, the step's sums.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]``; prox and behav carry no
        gradient.
      low, high: α and β, 0 < α ≤ 1 ≤ β, α < β.
      clip_eps: ε_low of the trust-region clip.
      options: each optional: ``clip_eps_high``, ``dual_clip`` (ε_high, c), and
        ``aggregation``, ``denominator``, ``max_len``, ``staleness`` as below.
      aggregation: one of ``AGGREGATIONS``.
      denominator: global count for micro-batching; defaults to the local count.
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, for the ``staleness/*`` metrics.

    Returns:
      ``(loss, metrics)``: ``icepop/masked_frac|below_frac|above_frac``, the PPO metrics
      (``loss/clipfrac``, ``is/*``, ``mismatch/*`` with ``mismatch/ess``) and
      ``loss/num_tokens``.
    """
    return token_loss(
        icepop_sums,
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        low=low,
        high=high,
        clip_eps=clip_eps,
        **options,
    )
