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

import functools
from typing import Any

import jax
import jax.numpy as jnp

from a3po_jax.core import prox
from a3po_jax.core.aggregation import AGGREGATIONS, aggregate_sum
from a3po_jax.core.checks import check_choice, check_positive, check_same_shape
from a3po_jax.core.objectives.ppo import (
    Aggregate,
    ProxStaleness,
    decoupled_ppo_per_token,
    proximal_logp,
    token_stats,
)
from a3po_jax.core.objectives.registry import Term, register
from a3po_jax.core.stats import Stats, combine, finalized_loss, masked_pair

Batch = dict[str, jax.Array]


def icepop_per_token(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    low: float,
    high: float,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token IcePop loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`icepop_loss`.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for :func:`icepop_loss`.
      low, high: α and β, 0 < α ≤ 1 ≤ β.
      clip_eps, clip_eps_high, dual_clip: the trust-region clip, as for
        :func:`a3po_jax.core.objectives.ppo.decoupled_ppo_per_token`.

    Returns:
      ``(per_token, diagnostics)``: ``[B, T]`` float32 ℓ_t (0 where masked or outside the
      band) and the diagnostics of ``decoupled_ppo_per_token``, with ``"masked"`` now the
      tokens outside the band and ``"below"`` / ``"above"`` (0/1: w_t < α / w_t > β).
    """
    check_positive("low", low)
    check_positive("high", high)
    if not low <= 1.0 <= high or not low < high:
        raise ValueError(f"IcePop needs low <= 1 <= high and low < high, got {low}, {high}")
    per_token, diag = decoupled_ppo_per_token(
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
    )
    valid = mask > 0
    w = diag["is_weight"]  # no cap was applied: w_t = exp(prox_t - behav_t)
    below = valid & (w < low)
    above = valid & (w > high)
    # where, not a multiply: a dropped token's gradient is exactly 0, whatever w_t is.
    per_token = jnp.where(below | above, 0.0, per_token)
    f32 = jnp.float32
    diag = {
        **diag,
        "masked": (below | above).astype(f32),
        "below": below.astype(f32),
        "above": above.astype(f32),
    }
    return per_token, diag


def icepop_sums(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregate: Aggregate,
    staleness: jax.Array | None = None,
    **hyper: Any,
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`icepop_per_token` as ``(loss_sum, count, stats)`` that add across
    micro-batches; ``loss = loss_sum / count``.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]``.
      aggregate: ``(per_token, mask) -> (numerator, count)``.
      staleness: ``[B, T]`` d_t, or None.
      hyper: ``low``, ``high``, ``clip_eps``, ``clip_eps_high``, ``dual_clip``.

    Returns:
      ``(loss_sum, count, stats)``: ``icepop/masked_frac`` (valid tokens outside [α, β]),
      ``icepop/below_frac`` (w < α), ``icepop/above_frac`` (w > β), the PPO metrics of
      :func:`a3po_jax.core.objectives.ppo.token_stats` (``mismatch/masked_frac`` is the
      band's) and ``mismatch/ess``.
    """
    per_token, diag = icepop_per_token(logp, prox_logp, behav_logp, advantages, mask, **hyper)
    loss_sum, count = aggregate(per_token, mask)
    own = Stats(
        means={
            "icepop/masked_frac": masked_pair(diag["masked"], mask),
            "icepop/below_frac": masked_pair(diag["below"], mask),
            "icepop/above_frac": masked_pair(diag["above"], mask),
        }
    )
    return loss_sum, count, combine(own, token_stats(logp, behav_logp, staleness, mask, diag))


def icepop_term(
    logp: jax.Array,
    mb: Batch,
    *,
    staleness: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    prox_fn: prox.ProxFn,
    prox_staleness: ProxStaleness | None = None,
    aggregate: Aggregate,
    **hyper: Any,
) -> tuple[jax.Array, jax.Array, Stats]:
    """IcePop on one micro-batch: prox from ``prox_fn`` (A-3PO's d from ``prox_staleness``,
    as for ``ppo``), then :func:`icepop_sums`."""
    del ref_logp
    behav = mb["behav_logp"]
    prox_logp = proximal_logp(
        logp, mb, staleness, old_logp, prox_fn=prox_fn, prox_staleness=prox_staleness
    )
    return icepop_sums(
        logp,
        prox_logp,
        behav,
        mb["advantages"],
        mb["loss_mask"],
        aggregate=aggregate,
        staleness=staleness,
        **hyper,
    )


@register("icepop", prox_rules=("recompute", "a3po"))
def icepop(cfg: Any) -> Term:
    """``algo.loss=icepop``: :func:`icepop_term` with the prox rule (``algo.prox``,
    ``algo.a3po_zero_staleness``, ``algo.a3po_staleness_unit``), ``algo.icepop_low`` /
    ``algo.icepop_high`` (α, β), the clip (``algo.clip_eps``, ``clip_eps_high``,
    ``dual_clip``) and the aggregation bound once."""
    a = cfg.algo
    rule = prox.make_prox_rule(
        a.prox, zero_staleness=a.a3po_zero_staleness, one_pass_old=cfg.system.one_pass_old
    )
    fn = functools.partial(
        icepop_term,
        prox_fn=rule.fn,
        prox_staleness=prox.staleness_for_prox(a.a3po_staleness_unit),
        aggregate=functools.partial(aggregate_sum, mode=a.aggregation),
        low=a.icepop_low,
        high=a.icepop_high,
        clip_eps=a.clip_eps,
        clip_eps_high=a.clip_eps_high or None,
        dual_clip=a.dual_clip or None,
    )
    return Term(fn, needs_old_pass=rule.needs_old_pass)


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
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
    staleness: jax.Array | None = None,
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
      clip_eps, clip_eps_high, dual_clip: the trust-region clip (ε_low, ε_high, c).
      aggregation: one of ``AGGREGATIONS``.
      denominator: global count for micro-batching; defaults to the local count.
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, for the ``staleness/*`` metrics.

    Returns:
      ``(loss, metrics)``: ``icepop/masked_frac|below_frac|above_frac``, the PPO metrics
      (``loss/clipfrac``, ``is/*``, ``mismatch/*`` with ``mismatch/ess``) and
      ``loss/num_tokens``.
    """
    check_same_shape("logp", logp, staleness=staleness)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    loss_sum, count, stats = icepop_sums(
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        aggregate=functools.partial(aggregate_sum, mode=aggregation, max_len=max_len),
        staleness=staleness,
        low=low,
        high=high,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
    )
    return finalized_loss(loss_sum, count, stats, mask, denominator)
