"""Where the proximal policy comes from: a table of prox rules, chosen when the step is built.

Decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298) anchors its trust
region at a proximal policy π_prox, separate from the behaviour policy π_behav that sampled
the data. The loss (:func:`a3po_jax.core.losses.decoupled_ppo_loss`) does not know where
``prox_logp`` came from; one of these rules produces it:

* ``recompute``: log π_prox = the step's starting weights' log-probs, from an extra no-grad
  forward pass (decoupled PPO as published). With one optimizer step per batch the starting
  weights ARE the current ones, so the pass can be skipped: old = sg(current)
  (:func:`old_is_current`, Periodic Asynchrony's unified pass, arXiv 2511.18871).
* ``a3po``: A-3PO's interpolation between behav and sg(current) by staleness, no pass
  (:func:`a3po_prox_logp`, arXiv 2512.06547).
* ``behav``: prox = behav, i.e. plain PPO against the behaviour policy (naive async PPO).

Every rule has one signature, ``rule(logp, behav_logp, staleness, old_logp) -> prox_logp``
(``[B, T]`` each; ``old_logp`` is the recompute pass's output or None), so the step calls
whichever was chosen without comparing strings inside the differentiated function.

Core layer: imports only from ``a3po_jax.core``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from a3po_jax.core.checks import check_choice, check_rank, check_same_shape

ProxFn = Callable[[jax.Array, jax.Array, jax.Array, "jax.Array | None"], jax.Array]
# A-3PO's α at d = 0: the paper's prox = current (α = 0) or AReaL's prox = behav (α = 1).
_ALPHA_AT_ZERO = {"current": 0.0, "behav": 1.0}
ZERO_STALENESS: tuple[str, ...] = tuple(_ALPHA_AT_ZERO)


def steps_behind(updates_behind: jax.Array, updates_per_step: int) -> jax.Array:
    """Staleness in training steps from staleness in optimizer updates at a step's start.

    A training step trains one generated batch in ``updates_per_step`` = k optimizer updates
    (minibatches), so data x updates behind the step's starting weights is ⌈x / k⌉ steps
    behind. Negative x (tokens from the future) stays negative, so the prox rule still
    poisons the step.
    """
    x = jnp.asarray(updates_behind)
    k = int(updates_per_step)
    if k < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {k}")
    return jnp.where(x >= 0, (x + k - 1) // k, x)


# Which staleness A-3PO's α = 1/d reads, per minibatch i of a step (docs/losses.md, "A-3PO
# with several minibatches"): (mb, d in updates at minibatch i) -> d.
_STALENESS_UNITS = {
    # Training steps from the step's start: the paper's "difference in training steps", and
    # AReaL's version read once per step; the same d in every minibatch of the step. A
    # micro-batch without it comes from a caller with one update per step, where d is the same.
    "step": lambda mb, updates: mb.get("step_staleness", updates),
    # Optimizer updates at minibatch i: d grows by one per minibatch.
    "update": lambda mb, updates: updates,
}
STALENESS_UNITS: tuple[str, ...] = tuple(_STALENESS_UNITS)


def staleness_for_prox(unit: str) -> Callable[[Mapping[str, jax.Array], jax.Array], jax.Array]:
    """``(micro-batch, d in updates) -> d`` for A-3PO in ``unit`` (a key of
    :data:`STALENESS_UNITS`), resolved once when the step is built."""
    check_choice("a3po_staleness_unit", unit, STALENESS_UNITS)
    return _STALENESS_UNITS[unit]


def a3po_alpha(staleness: jax.Array, *, zero_staleness: str = "current") -> jax.Array:
    """A-3PO's staleness-aware interpolation weight α (arXiv 2512.06547).

    α_t = 0 if d_t = 0, 1/d_t if d_t ≥ 1.   With ``zero_staleness="behav"`` (AReaL's
    ``prox_logp_method: loglinear``) α_t = 1 when d_t = 0, i.e. prox = behav.

    Args:
      staleness: integer array of any shape, d = v_θ - v_behav ≥ 0.
      zero_staleness: ``"current"`` (the paper) or ``"behav"`` (AReaL's code).

    Returns:
      float32 array of α with the shape of ``staleness``.
    """
    check_choice("zero_staleness", zero_staleness, ZERO_STALENESS)
    d = jnp.asarray(staleness).astype(jnp.float32)
    at_zero = _ALPHA_AT_ZERO[zero_staleness]
    # max(d, 1) keeps 1/d finite on the branch `where` discards.
    return jnp.where(d >= 1.0, 1.0 / jnp.maximum(d, 1.0), at_zero)


def a3po_prox_logp(
    logp: jax.Array,
    behav_logp: jax.Array,
    staleness: jax.Array,
    *,
    zero_staleness: str = "current",
) -> jax.Array:
    """A-3PO's proximal log-prob, interpolated instead of recomputed.

    prox_t = α_t · behav_t + (1 - α_t) · sg(logp_t),   α_t = 0 (d_t = 0), 1/d_t (d_t ≥ 1)

    Replaces decoupled PPO's extra forward pass with the weights at the start of the step
    (arXiv 2512.06547, seeds 000/001). ``logp`` enters only through ``stop_gradient``: the
    trust-region ratio exp(logp - prox) must keep its gradient through the numerator alone,
    otherwise with α = 0 the ratio would be the constant 1.

    Args:
      logp: ``[B, T]`` current policy log-probs (the differentiated ones).
      behav_logp: ``[B, T]`` behaviour log-probs from the inference host.
      staleness: ``[B, T]`` integer d_t = v_θ - v_behav,t ≥ 0 per token (tokens of one
        sequence can differ when weights changed mid-generation). Values at masked
        positions are ignored by the loss but must still be ≥ 0 when checked eagerly.
      zero_staleness: ``"current"`` (default, the paper: prox = sg(logp) at d = 0) or
        ``"behav"`` (AReaL's ``loglinear`` code: prox = behav at d = 0). They differ only
        where inference and training numerics disagree.

    Returns:
      ``[B, T]`` float32 proximal log-probs carrying no gradient.

    Raises:
      ValueError: on shape mismatch, or on negative staleness when the values are concrete
        (outside jit). Under jit, negative staleness yields NaN so the loss is non-finite and
        the trainer's non-finite guard stops on it; the trainer also checks on the host.
    """
    check_rank("logp", logp, 2, "[B, T]")
    check_same_shape("logp", logp, behav_logp=behav_logp, staleness=staleness)
    if not isinstance(staleness, jax.core.Tracer) and bool(jnp.any(jnp.asarray(staleness) < 0)):
        raise ValueError(
            f"staleness must be >= 0 (d = trainer version - behaviour version), got min "
            f"{int(jnp.min(jnp.asarray(staleness)))}"
        )
    alpha = a3po_alpha(staleness, zero_staleness=zero_staleness)
    alpha = jnp.where(jnp.asarray(staleness) < 0, jnp.nan, alpha)
    prox = alpha * behav_logp.astype(jnp.float32) + (1.0 - alpha) * jax.lax.stop_gradient(
        logp.astype(jnp.float32)
    )
    # prox is an anchor, never a path for gradients (behav carries none either).
    return jax.lax.stop_gradient(prox)


def old_is_current(logp: jax.Array) -> jax.Array:
    """The old (proximal) policy's log-probs when it equals the current one: ``sg(logp)``.

    Exact when the step's starting weights are the weights being differentiated (one
    optimizer step per batch): a separate no-grad pass would return the same numbers. The
    gradient is stopped because the proximal anchor is data, never differentiated
    (design §3): through it, r = exp(logp - prox) would be the constant 1.
    """
    return jax.lax.stop_gradient(logp)


def _recomputed(logp, behav_logp, staleness, old_logp):
    """prox = the recompute pass over the step's starting weights."""
    del logp, behav_logp, staleness
    if old_logp is None:
        raise ValueError("prox rule 'recompute' needs the recompute pass's old_logp, got None")
    return jax.lax.stop_gradient(old_logp)


def _current(logp, behav_logp, staleness, old_logp):
    """prox = sg(current): recompute's value without the pass (one step per batch)."""
    del behav_logp, staleness, old_logp
    return old_is_current(logp)


def _a3po(logp, behav_logp, staleness, old_logp, *, zero_staleness: str = "current"):
    """prox = A-3PO's staleness interpolation between behav and sg(current)."""
    del old_logp
    return a3po_prox_logp(logp, behav_logp, staleness, zero_staleness=zero_staleness)


def _behav(logp, behav_logp, staleness, old_logp):
    """prox = behav: PPO against the behaviour policy, w_t = 1."""
    del logp, staleness, old_logp
    return jax.lax.stop_gradient(behav_logp)


@dataclasses.dataclass(frozen=True)
class ProxRule:
    """A way to obtain log π_prox, and whether it needs a no-grad pass of the old weights."""

    fn: ProxFn  # (logp, behav_logp, staleness, old_logp) -> prox_logp, all [B, T]
    needs_old_pass: bool  # True: the step runs the starting weights once more, no gradient


PROX_RULES: Mapping[str, ProxRule] = {
    "recompute": ProxRule(_recomputed, needs_old_pass=True),
    "a3po": ProxRule(_a3po, needs_old_pass=False),
    "behav": ProxRule(_behav, needs_old_pass=False),
}


def make_prox_rule(
    name: str, *, zero_staleness: str = "current", one_pass_old: bool = False
) -> ProxRule:
    """The rule called ``name`` from :data:`PROX_RULES`, with its hyperparameters bound.

    Args:
      name: ``"recompute"``, ``"a3po"`` or ``"behav"``.
      zero_staleness: A-3PO at d = 0: ``"current"`` (the paper) or ``"behav"`` (AReaL).
      one_pass_old: with ``"recompute"``, take old = sg(current) instead of running the pass
        (exact only with one optimizer step per batch; the config checks that).

    Raises:
      ValueError: naming the unknown value and the allowed ones.
    """
    check_choice("prox", name, PROX_RULES)
    check_choice("zero_staleness", zero_staleness, ZERO_STALENESS)
    if one_pass_old and name != "recompute":
        raise ValueError(f"one_pass_old applies to prox rule 'recompute' only, got {name!r}")
    if one_pass_old:
        return ProxRule(_current, needs_old_pass=False)
    rule = PROX_RULES[name]
    if name == "a3po":
        return ProxRule(functools.partial(_a3po, zero_staleness=zero_staleness), False)
    return rule
