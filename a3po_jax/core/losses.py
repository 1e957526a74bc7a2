"""Pure-functional losses for asynchronous RL of LLMs (design.md §3), in one namespace.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Everything here is a function of arrays: no model, no config object, keyword-only
hyperparameters. Policy losses return ``(loss, metrics)`` so they drop straight into
``jax.value_and_grad(..., has_aux=True)``.

Shape letters: B batch (sequences), T time (tokens), V vocab, N groups, G group size.

This module holds the shared pieces (``token_logprobs``, ``entropy``, the advantage
estimators, the KL estimators) and re-exports the rest from where each lives:

* the objectives, each with its per-token maths, its public loss and the train step's term
  (:mod:`a3po_jax.core.objectives`): ``decoupled_ppo_loss``, ``decoupled_ppo_per_token``,
  ``ppo_clip_loss`` (:mod:`~a3po_jax.core.objectives.ppo`); ``online_dpo_loss``,
  ``online_dpo_per_pair``, ``sequence_logprobs`` (:mod:`~a3po_jax.core.objectives.dpo`);
  ``m2po_loss``, ``m2po_per_token``, ``m2po_keep``, ``m2po_clip_side``,
  ``m2po_clip_side_keep``, ``m2po_bound`` (:mod:`~a3po_jax.core.objectives.m2po`);
  ``gspo_loss``, ``gspo_per_token`` (:mod:`~a3po_jax.core.objectives.gspo`);
  ``icepop_loss``, ``icepop_per_token`` (:mod:`~a3po_jax.core.objectives.icepop`);
* the proximal policy's A-3PO rule, ``a3po_alpha`` and ``a3po_prox_logp``
  (:mod:`a3po_jax.core.prox`);
* aggregation, ``aggregate`` and ``aggregate_sum`` (:mod:`a3po_jax.core.aggregation`).

Reduction happens once, at the top. The per-token (per-pair) pieces come unreduced, and
``aggregate_sum`` turns per-token values into a ``(numerator, count)`` pair that adds
across micro-batches; the train step sums those and divides once. The public losses are
the same sums finalized: the function a user calls is the one training runs. Their
optional ``denominator`` takes the *global* count when a caller adds micro-batch losses
itself. Choices are tables (``AGGREGATORS``, ``KL_ESTIMATORS``), so a caller can resolve a
name once and call the function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from a3po_jax.core.aggregation import (
    AGGREGATIONS,
    AGGREGATORS,
    Aggregation,
    aggregate,
    aggregate_sum,
)
from a3po_jax.core.checks import check_choice, check_rank, check_same_shape
from a3po_jax.core.objectives.dpo import (
    DPO_KINDS,
    online_dpo_loss,
    online_dpo_per_pair,
    sequence_logprobs,
)
from a3po_jax.core.objectives.gspo import gspo_loss, gspo_per_token
from a3po_jax.core.objectives.icepop import icepop_loss, icepop_per_token
from a3po_jax.core.objectives.m2po import (
    m2po_bound,
    m2po_clip_side,
    m2po_clip_side_keep,
    m2po_keep,
    m2po_loss,
    m2po_per_token,
)
from a3po_jax.core.objectives.ppo import (
    CAP_MODES,
    decoupled_ppo_loss,
    decoupled_ppo_per_token,
    ppo_clip_loss,
)
from a3po_jax.core.prox import a3po_alpha, a3po_prox_logp

__all__ = [
    "AGGREGATIONS",
    "AGGREGATORS",
    "CAP_MODES",
    "DPO_KINDS",
    "KL_ESTIMATORS",
    "KL_KINDS",
    "Aggregation",
    "a3po_alpha",
    "a3po_prox_logp",
    "aggregate",
    "aggregate_sum",
    "decoupled_ppo_loss",
    "decoupled_ppo_per_token",
    "entropy",
    "grpo_advantages",
    "gspo_loss",
    "gspo_per_token",
    "icepop_loss",
    "icepop_per_token",
    "kl_penalty",
    "m2po_bound",
    "m2po_clip_side",
    "m2po_clip_side_keep",
    "m2po_keep",
    "m2po_loss",
    "m2po_per_token",
    "online_dpo_loss",
    "online_dpo_per_pair",
    "ppo_clip_loss",
    "rloo_advantages",
    "sequence_logprobs",
    "token_logprobs",
]


# --------------------------------------------------------------------------------------
# Log-probs and entropy from logits.
# --------------------------------------------------------------------------------------


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Log-probability of each target token under ``softmax(logits)``.

    logp[b, t] = logits[b, t, targets[b, t]] - logsumexp_v logits[b, t, v]

    Computed in float32 whatever the logits' dtype (bfloat16 log-softmax loses ~2 digits,
    which is the size of the importance ratios being clipped). The target logit is picked
    with ``take_along_axis``, so no ``[B, T, V]`` one-hot is materialised.

    Args:
      logits: ``[B, T, V]`` unnormalised scores; position t predicts ``targets[:, t]``.
      targets: ``[B, T]`` integer token ids.

    Returns:
      ``[B, T]`` float32 log-probabilities.
    """
    check_rank("logits", logits, 3, "[B, T, V]")
    check_rank("targets", targets, 2, "[B, T]")
    if jnp.shape(logits)[:2] != jnp.shape(targets):
        raise ValueError(
            f"targets has shape {jnp.shape(targets)} but logits has leading shape "
            f"{jnp.shape(logits)[:2]}"
        )
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - lse


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy of ``softmax(logits)`` per position, in float32.

    H[b, t] = -Σ_v p_v log p_v,   p = softmax(logits[b, t])

    Args:
      logits: ``[B, T, V]``.

    Returns:
      ``[B, T]`` float32 entropies (nats).
    """
    check_rank("logits", logits, 3, "[B, T, V]")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# --------------------------------------------------------------------------------------
# Advantages.
# --------------------------------------------------------------------------------------


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    """Return rewards as ``[N, G]``, checking the group structure."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(
                f"rewards has shape {rewards.shape}: "
                f"its second axis must be group_size={group_size}"
            )
        return rewards
    if rewards.ndim == 1:
        if rewards.shape[0] % group_size:
            raise ValueError(
                f"rewards has {rewards.shape[0]} entries, not a multiple of group_size={group_size}"
            )
        return rewards.reshape(-1, group_size)
    raise ValueError(f"rewards must be [N*G] or [N, G], got shape {rewards.shape}")


def grpo_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300).

    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)      (population std, ddof = 0)
    Dr.GRPO (arXiv 2503.20783): ``normalize_std=False`` gives A_i = R_i - mean_j R_j.

    Args:
      rewards: ``[N*G]`` (groups contiguous) or ``[N, G]`` rewards.
      group_size: G.
      normalize_std: divide by the group's standard deviation.
      eps: added to the std so a group of equal rewards gets advantage 0, not NaN.

    Returns:
      float32 advantages with the shape of ``rewards``.
    """
    shape = jnp.shape(rewards)
    r = _grouped(rewards, group_size)  # [N, G]
    adv = r - jnp.mean(r, axis=1, keepdims=True)
    if normalize_std:
        adv = adv / (jnp.std(r, axis=1, keepdims=True) + eps)
    return adv.reshape(shape)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """REINFORCE leave-one-out advantages (Ahmadian et al., arXiv 2402.14740).

    A_i = R_i - (1 / (G - 1)) Σ_{j ≠ i} R_j

    Args:
      rewards: ``[N*G]`` or ``[N, G]``.
      group_size: G ≥ 2.

    Returns:
      float32 advantages with the shape of ``rewards``.
    """
    if isinstance(group_size, int) and group_size < 2:
        raise ValueError(f"group_size must be >= 2 for leave-one-out, got {group_size}")
    shape = jnp.shape(rewards)
    r = _grouped(rewards, group_size)
    others = (jnp.sum(r, axis=1, keepdims=True) - r) / (group_size - 1)
    return (r - others).reshape(shape)


# --------------------------------------------------------------------------------------
# KL to a reference policy.
# --------------------------------------------------------------------------------------


def _k1(x):
    return -x


def _k2(x):
    return 0.5 * jnp.square(x)


def _k3(x):
    # expm1 keeps k3 accurate for small x, where exp(x) - 1 - x cancels to float32 noise.
    return jnp.expm1(x) - x


# Each maps x = ref - logp ([B, T] float32) to the per-token estimator.
KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}
KL_KINDS: tuple[str, ...] = tuple(KL_ESTIMATORS)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimator of KL(π_θ ‖ π_ref) on samples from π_θ (Schulman, 2020).

    x = ref - logp;   k1 = -x,   k2 = x² / 2,   k3 = exp(x) - 1 - x  (≥ 0, low variance)

    Args:
      logp: ``[B, T]`` current log-probs.
      ref_logp: ``[B, T]`` reference log-probs.
      kind: ``"k1"``, ``"k2"`` or ``"k3"`` (a key of ``KL_ESTIMATORS``).

    Returns:
      ``[B, T]`` float32 per-token penalty (mask and aggregate it yourself).
    """
    check_choice("kind", kind, KL_KINDS)
    check_same_shape("logp", logp, ref_logp=ref_logp)
    return KL_ESTIMATORS[kind](ref_logp.astype(jnp.float32) - logp.astype(jnp.float32))
