"""The jitted training step: logits → logp → prox → loss → grads → optax update.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Every function takes one ``algo`` (:class:`a3po_jax.core.algorithm.Algorithm`, built once
from the config): the objective's term, the forward pass, the architecture and the batch
plan. Reduction happens once, at the top (design §3): the objective's term returns a
``(loss_sum, count)`` pair and its metrics as :class:`~a3po_jax.core.stats.Stats`, which
add across micro-batches, minibatches and arriving groups; ``finalize`` divides once.

* :func:`accumulate_grads`: gradients of :func:`loss_sums` scanned over micro-batches.
* :func:`train_step`: the whole step for a batch that is all at hand (``sync``,
  ``one_step_off``, ``async``): the old-policy pass when the prox rule needs one, the
  reference pass when the objective does, then ``plan.num_minibatches`` optimizer steps
  (:func:`a3po_jax.core.optim.apply_grads`); metrics cover every minibatch.
* :func:`fold_group` / :func:`apply_accumulated`: ``periodic`` mode, one arriving group at
  a time, one optimizer step per iteration.
* :func:`kl_in_reward`: the reference KL charged to the rewards, advantages recomputed.

The optimizer and the update live in :mod:`a3po_jax.core.optim`; placement on a mesh and
the jit boundary in :mod:`a3po_jax.core.placement`.

Shape letters: M micro-batches, B sequences (per micro-batch b), T tokens, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from a3po_jax.core import prox
from a3po_jax.core.algorithm import Algorithm
from a3po_jax.core.optim import Accumulated, TrainState, add_accumulated, apply_grads
from a3po_jax.core.stats import Stats, combine, finalize, masked_pair

Params = Any
Batch = dict[str, jax.Array]


# --------------------------------------------------------------------------------------
# The no-grad passes.
# --------------------------------------------------------------------------------------


def _no_grad_logprobs(params, micro_batches, *, algo):
    """[M, b, T] log-probs of every micro-batch, no gradient (old-policy / reference pass)."""

    def one(mb):
        logp, _ = algo.forward(params, mb)
        return jax.lax.stop_gradient(logp)

    return jax.lax.map(one, micro_batches)


def auxiliary_logprobs(
    params: Params, ref_params: Params | None, micro_batches: Batch, *, algo: Algorithm
) -> tuple[jax.Array | None, jax.Array | None]:
    """The no-grad passes the algorithm needs, ``[M, b, T]`` each or None: the old policy
    (``params`` = the step's starting weights) and the frozen reference."""
    old = ref = None
    if algo.needs_old_pass:
        old = _no_grad_logprobs(params, micro_batches, algo=algo)
    if algo.needs_reference:
        ref = _no_grad_logprobs(ref_params, micro_batches, algo=algo)
    return old, ref


# --------------------------------------------------------------------------------------
# Loss sum of one micro-batch.
# --------------------------------------------------------------------------------------


def loss_sums(
    params: Params,
    mb: Batch,
    *,
    version: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    algo: Algorithm,
    step_version: jax.Array | None = None,
    updates_per_step: int = 1,
) -> tuple[jax.Array, tuple[jax.Array, Stats]]:
    """Loss *sum* of one micro-batch, its count, and its metric :class:`Stats`.

    Args:
      params: current policy parameters (differentiated).
      mb: micro-batch arrays ``[b, T]`` from :class:`a3po_jax.core.batching.TrainBatch`.
      version: int32 scalar trainer version v_θ for this optimizer step.
      old_logp: ``[b, T]`` old-policy log-probs when ``algo.needs_old_pass``, else None.
      ref_logp: ``[b, T]`` reference log-probs when ``algo.needs_reference``, else None.
      step_version, updates_per_step: the version v₀ at which this training step started
        and its k optimizer updates (None, 1: this update is the whole step). The term finds
        ``mb["step_staleness"]`` = ⌈(v₀ − v_behav) / k⌉, the training steps between the data
        and the step's start, which A-3PO's α reads (``algo.a3po_staleness_unit=step``).

    Returns:
      (loss_sum, (count, stats)): the loss is ``Σ loss_sum / Σ count`` over micro-batches.
    """
    logp, ent = algo.forward(params, mb)
    mask = mb["loss_mask"]
    # Staleness d = v_θ - v_behav per token; masked positions get 0 (their versions are 0
    # by construction and carry no meaning).
    staleness = jnp.where(mask > 0, version - mb["versions"], 0).astype(jnp.int32)
    start = version if step_version is None else step_version
    behind = prox.steps_behind(start - mb["versions"], updates_per_step)
    mb = {**mb, "step_staleness": jnp.where(mask > 0, behind, 0).astype(jnp.int32)}
    loss, count, stats = algo.loss_term(
        logp, mb, staleness=staleness, old_logp=old_logp, ref_logp=ref_logp
    )
    means = {
        "policy/entropy": masked_pair(jax.lax.stop_gradient(ent), mask),
        "policy/logp": masked_pair(jax.lax.stop_gradient(logp), mask),
    }
    if algo.kl_in_loss is not None:
        kl = algo.kl_in_loss(logp, ref_logp)  # [b, T] estimator of KL(π_θ ‖ π_ref)
        kl_sum, _ = algo.aggregate(kl, mask)
        loss = loss + algo.kl_coef * kl_sum
        means["kl/ref"] = masked_pair(jax.lax.stop_gradient(kl), mask)
    if algo.kl_metric is not None:
        kl_metric = algo.kl_metric(jax.lax.stop_gradient(logp), ref_logp)
        means["kl/ref_k3"] = masked_pair(kl_metric, mask)
    own = Stats(means=means, totals={"loss/num_tokens": jnp.sum(mask.astype(jnp.float32))})
    return loss, (count, combine(stats, own))


# --------------------------------------------------------------------------------------
# Gradients over micro-batches.
# --------------------------------------------------------------------------------------


def split_micro_batches(batch: Batch, num: int) -> Batch:
    """[B, ...] → [num, B / num, ...] for every array."""

    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {num} micro-batches")
        return x.reshape((num, x.shape[0] // num) + x.shape[1:])

    return jax.tree.map(split, batch)


def accumulate_grads(
    params: Params,
    micro_batches: Batch,
    *,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    **step: Any,
) -> Accumulated:
    """Sum of loss-sum gradients over ``[M, b, T]`` micro-batches (a ``lax.scan``), with
    ``old_logp`` / ``ref_logp`` ``[M, b, T]`` or None; ``step`` holds :func:`loss_sums`'s
    ``version`` and ``algo`` (and maybe ``step_version``, ``updates_per_step``), the same
    for every micro-batch."""
    grad_fn = jax.value_and_grad(functools.partial(loss_sums, **step), has_aux=True)

    def one(mb, old, ref):
        (loss, (count, stats)), grads = grad_fn(params, mb, old_logp=old, ref_logp=ref)
        return Accumulated(grads, jax.lax.stop_gradient(loss), count, stats)

    def body(acc, xs):
        return add_accumulated(acc, one(*xs)), None

    # The first micro-batch seeds the carry so the scan carry has a fixed structure.
    xs = (micro_batches, old_logp, ref_logp)
    first = one(*jax.tree.map(lambda x: x[0], xs))
    acc, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], xs))
    return acc


# --------------------------------------------------------------------------------------
# The step.
# --------------------------------------------------------------------------------------


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Params | None,
    *,
    algo: Algorithm,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One training step on a batch that is all at hand.

    1. the old-policy pass over the whole batch with the step's starting weights, when the
       prox rule needs one (decoupled PPO's extra pass; A-3PO exists to remove it);
    2. reference log-probs with the frozen ``ref_params`` if the loss needs them;
    3. ``num_minibatches`` = k optimizer steps; minibatch i trains at version v₀ + i, so
       its staleness is v₀ + i − v_behav updates, and ⌈(v₀ − v_behav) / k⌉ training steps
       in every minibatch (what A-3PO's α reads by default, docs/losses.md).

    Args:
      state: the current :class:`~a3po_jax.core.optim.TrainState` (donate it under jit).
      batch: ``[B, T]`` arrays of ``algo.plan`` (:func:`a3po_jax.core.batch_plan.make_batch`),
        split by the plan into ``plan.micro_batches`` micro-batches.
      ref_params: frozen reference params, or None.

    Returns:
      (new_state, metrics): metrics over every minibatch (means weighted by their counts,
      ``optim/*`` averaged over the minibatches, maxima / minima over all of them;
      ``step/skipped`` is 1 if any minibatch was skipped).
    """
    plan = algo.plan
    rows = batch["loss_mask"].shape[0]
    if rows != plan.rows:
        raise ValueError(f"train_step: the batch has {rows} sequences, its plan {plan.rows}")
    k = plan.num_minibatches
    n_micro = plan.micro_batches // k
    minibatches = split_micro_batches(batch, plan.micro_batches)  # [k*M, b, T]
    old_all, ref_all = auxiliary_logprobs(state.params, ref_params, minibatches, algo=algo)

    stats = Stats()
    v0 = state.step
    for i in range(k):
        sl = slice(i * n_micro, (i + 1) * n_micro)
        mbs, old, ref = jax.tree.map(lambda x: x[sl], (minibatches, old_all, ref_all))  # noqa: B023
        acc = accumulate_grads(
            state.params,
            mbs,
            version=v0 + i,
            old_logp=old,
            ref_logp=ref,
            algo=algo,
            step_version=v0,
            updates_per_step=k,
        )
        state, opt_stats = apply_grads(state, acc, optimizer=optimizer, grad_clip=grad_clip)
        stats = combine(stats, combine(acc.stats, opt_stats))
    return state, finalize(stats)


# --------------------------------------------------------------------------------------
# Periodic mode: groups folded in as they arrive, one update per iteration.
# --------------------------------------------------------------------------------------


def fold_group(
    params: Params,
    ref_params: Params | None,
    micro_batches: Batch,
    version: jax.Array,
    *,
    algo: Algorithm,
) -> Accumulated:
    """One arriving group's contribution at the iteration's weights ``params``.

    ``micro_batches`` is the group's batch (``make_batch`` with ``algo.plan.fold``) split
    into ``algo.plan.fold.micro_batches``. The old-policy pass (when the prox rule needs
    one) runs over ``params``: nothing has been applied since the iteration began, so they
    are the step's starting weights, and folding every group then one
    :func:`apply_accumulated` equals :func:`train_step` on the whole batch up to summation
    order.
    """
    old, ref = auxiliary_logprobs(params, ref_params, micro_batches, algo=algo)
    return accumulate_grads(
        params, micro_batches, version=version, old_logp=old, ref_logp=ref, algo=algo
    )


def apply_accumulated(
    state: TrainState,
    acc: Accumulated,
    *,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The iteration's one optimizer step from the folded groups, and its metrics."""
    state, opt_stats = apply_grads(state, acc, optimizer=optimizer, grad_clip=grad_clip)
    return state, finalize(combine(acc.stats, opt_stats))


# --------------------------------------------------------------------------------------
# KL in the reward.
# --------------------------------------------------------------------------------------


def kl_in_reward(
    params: Params,
    ref_params: Params,
    batch: Batch,
    rewards: jax.Array,
    *,
    algo: Algorithm,
) -> tuple[jax.Array, jax.Array]:
    """Rewards minus β·Σ_t KL_t under the current and reference policies, and the group
    advantages recomputed from them (``algo.kl_in_reward`` must be set).

    Args:
      batch: the step's arrays (``[B, T]``; packed arrays when ``algo.plan.packed``), groups
        of ``algo.plan.group_size`` contiguous rows.
      rewards: ``[B]`` sequence rewards in the batch's row order.

    Returns:
      (rewards [B], advantages [B, T]).
    """
    logp, _ = algo.forward(params, batch)
    ref, _ = algo.forward(ref_params, batch)
    return algo.kl_in_reward(rewards, logp, ref, batch["loss_mask"])
