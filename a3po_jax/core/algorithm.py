"""The step's algorithm, assembled once from the run config before anything is traced.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

:func:`build_algorithm` resolves every name of the validated run configuration against its
table once: the objective (:mod:`a3po_jax.core.objectives`, built from the typed
:class:`~a3po_jax.core.objectives.spec.ObjectiveSpec` the shell converted once, which binds
its prox rule and hyperparameters), the advantage estimator
(:data:`a3po_jax.core.advantages.ESTIMATORS`), the aggregation and the KL estimator. The
result, an :class:`Algorithm`, holds functions, the model's architecture and the batch
plan, not names: nothing inside the differentiated function compares strings, and the
step's functions take the one ``algo`` value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from a3po_jax import model
from a3po_jax.core import advantages, logprobs, losses, objectives, packing
from a3po_jax.core.aggregation import aggregate_sum
from a3po_jax.core.batch_plan import BatchPlan

LogprobFn = Callable[..., tuple[jax.Array, jax.Array]]  # (params, batch) -> (logp, entropy)
Aggregator = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """The step's algorithm, resolved by :func:`build_algorithm`: functions with their
    hyperparameters bound, the flags derived from them once, the architecture and the plan."""

    model_config: model.ModelConfig  # the policy's architecture (static under jit)
    plan: BatchPlan  # the step's batch geometry
    objective: objectives.Objective  # the registered objective (name, layout, reference)
    forward: LogprobFn  # (params, batch) -> (logp [B, T], entropy [B, T])
    loss_term: objectives.TermFn  # (logp, mb, *, staleness, old_logp, ref_logp) -> sums
    kl_in_loss: Callable[[jax.Array, jax.Array], jax.Array] | None  # (logp, ref) -> KL [B, T]
    kl_coef: float  # β of the KL term in the loss (with kl_in_loss)
    kl_metric: Callable[[jax.Array, jax.Array], jax.Array] | None  # k3 KL to ref, metric only
    kl_in_reward: Callable[..., tuple[jax.Array, jax.Array]] | None  # (R, logp, ref, mask)
    aggregate: Aggregator  # (values [B, T], mask [B, T]) -> (numerator, count)
    needs_old_pass: bool  # a no-grad pass of the step's starting weights (prox "recompute")
    needs_reference: bool  # the step reads the frozen reference's log-probs
    keeps_reference: bool  # the run keeps a reference (the step's, or KL-in-reward's)


def build_algorithm(
    cfg: Any,
    model_config: model.ModelConfig,
    plan: BatchPlan | None = None,
    *,
    spec: objectives.ObjectiveSpec,
) -> Algorithm:
    """The algorithm of a validated run configuration, for the architecture ``model_config``.

    Args:
      cfg: a :class:`a3po_jax.training.config.TrainConfig` (validated: its names are known
        to be in their tables); read are ``cfg.algo``'s loss, advantage, aggregation and KL
        fields and ``cfg.rollout.temperature``.
      model_config: the policy's architecture.
      plan: the batch plan, computed once by the caller; default ``BatchPlan.from_config``.
      spec: what the objective's ``make`` builds its term from, converted from ``cfg`` once.
    """
    a = cfg.algo
    plan = BatchPlan.from_config(cfg) if plan is None else plan
    objective = objectives.get(a.loss)
    term = objective.make(spec)
    estimate = advantages.estimator(a.advantage)
    kl_in_loss = kl_in_reward = None
    if a.kl_coef > 0 and a.kl_in_reward:
        kl_in_reward = functools.partial(
            advantages.kl_in_reward_advantages,
            group_size=plan.group_size,
            estimate=estimate,
            kl_coef=a.kl_coef,
            kl_kind=a.kl_kind,
        )
    elif a.kl_coef > 0:
        kl_in_loss = functools.partial(_kl_estimate, estimate=losses.KL_ESTIMATORS[a.kl_kind])
    forward = packing.packed_token_logprobs if plan.packed else logprobs.forward_logprobs
    # KL to the initial policy as a metric only (the paper's reward-vs-KL frontier): the
    # reference pass runs, nothing is added to the loss.
    kl_metric = (
        functools.partial(_kl_estimate, estimate=losses.KL_ESTIMATORS["k3"])
        if a.track_ref_kl
        else None
    )
    needs_reference = objective.needs_reference or kl_in_loss is not None or kl_metric is not None
    return Algorithm(
        model_config=model_config,
        plan=plan,
        objective=objective,
        forward=functools.partial(
            forward, model_config=model_config, temperature=cfg.rollout.temperature
        ),
        loss_term=term.fn,
        kl_in_loss=kl_in_loss,
        kl_coef=a.kl_coef,
        kl_metric=kl_metric,
        kl_in_reward=kl_in_reward,
        aggregate=functools.partial(aggregate_sum, mode=a.aggregation),
        needs_old_pass=term.needs_old_pass,
        needs_reference=needs_reference,
        keeps_reference=needs_reference or kl_in_reward is not None,
    )


def _kl_estimate(logp: jax.Array, ref_logp: jax.Array, *, estimate) -> jax.Array:
    """``losses.kl_penalty`` with its kind resolved at build time (x = ref - logp)."""
    return estimate(ref_logp.astype(jnp.float32) - logp.astype(jnp.float32))
