"""Advantage estimators as a table, and the KL-in-reward shaping, as pure functions of arrays.

* :data:`ESTIMATORS`: ``grpo`` (group-normalised, DeepSeekMath arXiv 2402.03300),
  ``drgrpo`` (no std division, Dr.GRPO arXiv 2503.20783), ``rloo`` (leave-one-out,
  arXiv 2402.14740); each maps ``[N*G]`` rewards to ``[N*G]`` sequence advantages.
* :func:`kl_shaped_rewards`: R_i ← R_i − β Σ_t KL_t (the reference KL charged to the reward
  instead of the loss, as in InstructGPT / TRL's PPO).
* :func:`token_advantages`: a sequence advantage broadcast over its completion tokens.

Shape letters: B = N·G sequences (groups contiguous), T tokens, N groups, G group size.
Core layer: imports only from ``a3po_jax.core``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import chex
import jax
import jax.numpy as jnp

from a3po_jax.core import losses
from a3po_jax.core.checks import check_choice

Estimator = Callable[[jax.Array, int], jax.Array]  # (rewards [N*G], G) -> advantages [N*G]

ESTIMATORS: Mapping[str, Estimator] = {
    "grpo": losses.grpo_advantages,
    "drgrpo": functools.partial(losses.grpo_advantages, normalize_std=False),
    "rloo": losses.rloo_advantages,
}


def estimator(name: str) -> Estimator:
    """The estimator called ``name``; a ValueError names the allowed ones."""
    check_choice("advantage", name, ESTIMATORS)
    return ESTIMATORS[name]


def token_advantages(seq_advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B, T]`` per-token advantages: A_b on every completion token of row b, 0 elsewhere.

    Args:
      seq_advantages: ``[B]`` sequence advantages.
      mask: ``[B, T]`` completion mask.

    Returns:
      ``[B, T]`` float32.
    """
    chex.assert_rank(mask, 2)
    chex.assert_shape(seq_advantages, mask.shape[:1])
    return seq_advantages.astype(jnp.float32)[:, None] * mask.astype(jnp.float32)


def kl_shaped_rewards(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: float,
    kl_kind: str = "k3",
) -> jax.Array:
    """Rewards with the reference KL subtracted: R_b − β Σ_t m_bt · KL_bt.

    KL_bt is ``losses.kl_penalty(logp, ref_logp, kl_kind)`` (an estimator of
    KL(π_θ ‖ π_ref) on samples from π_θ; Schulman 2020); the sum runs over the completion
    tokens only. The log-probs are data here (no gradient flows through a reward).

    Args:
      rewards: ``[B]`` sequence rewards.
      logp: ``[B, T]`` current policy log-probs of the sampled tokens.
      ref_logp: ``[B, T]`` reference log-probs.
      mask: ``[B, T]`` completion mask.
      kl_coef: β ≥ 0.
      kl_kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      ``[B]`` float32 shaped rewards.
    """
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, ref_logp, mask])
    chex.assert_shape(rewards, logp.shape[:1])
    kl = losses.kl_penalty(jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ref_logp), kl_kind)
    kl_seq = jnp.sum(kl * mask.astype(jnp.float32), axis=-1)  # [B]
    return rewards.astype(jnp.float32) - kl_coef * kl_seq


def kl_in_reward_advantages(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    group_size: int,
    estimate: Estimator,
    kl_coef: float,
    kl_kind: str = "k3",
) -> tuple[jax.Array, jax.Array]:
    """KL-in-reward end to end: shaped rewards, then the group advantages of those.

    Returns:
      (rewards [B], advantages [B, T]) float32: the shaped rewards and the per-token
      advantages the loss reads.
    """
    shaped = kl_shaped_rewards(rewards, logp, ref_logp, mask, kl_coef=kl_coef, kl_kind=kl_kind)
    return shaped, token_advantages(estimate(shaped, group_size), mask)
