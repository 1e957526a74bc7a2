"""The optimizer and the update: AdamW, gradients divided once, the skip of a bad step.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

* :class:`TrainState`: params, optimizer state and the version, one pytree;
* :func:`make_optimizer`: AdamW with warm-up, as a :class:`LeafwiseOptimizer`;
* :class:`Accumulated`: gradient and loss sums over micro-batches (and arriving groups);
* :func:`apply_grads`: divide by the accumulated count, clip, update, skip the update if
  anything is non-finite, bump the version; on a CPU one leaf at a time
  (:func:`update_leaf_by_leaf`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from a3po_jax.core.aggregation import TINY
from a3po_jax.core.stats import Stats, combine

Params = Any


class TrainState(NamedTuple):
    """Everything the step changes, as one pytree."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer steps applied = the policy version


class LeafwiseOptimizer(optax.GradientTransformation):
    """An optax optimizer that acts leaf by leaf: each parameter's update depends on its own
    gradient, state and value only (AdamW, Adam, SGD with momentum; not a chain with a
    global transform such as ``clip_by_global_norm``). On a CPU :func:`apply_grads` updates
    such an optimizer one leaf at a time (:func:`update_leaf_by_leaf`), any other one over
    the whole tree. Wrap an optimizer in it only when that holds:
    ``LeafwiseOptimizer(*optax.adam(lr))``.
    """

    __slots__ = ()


def make_optimizer(
    *,
    learning_rate: float,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW with linear warm-up, as a :class:`LeafwiseOptimizer`; gradient clipping
    happens in :func:`apply_grads` so the pre-clip norm can be reported."""
    if warmup_steps:
        lr = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    else:
        lr = learning_rate
    return LeafwiseOptimizer(*optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(
        params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32)
    )


class Accumulated(NamedTuple):
    """Sums over micro-batches (and arriving groups); nothing divided yet."""

    grads: Params  # Σ ∂ loss_sum / ∂ params
    loss_sum: jax.Array  # Σ loss_sum
    count: jax.Array  # Σ count: the loss's denominator
    stats: Stats


def add_accumulated(a: Accumulated, b: Accumulated) -> Accumulated:
    """Sum of two accumulations (periodic mode: one per arriving group)."""
    return Accumulated(
        grads=jax.tree.map(jnp.add, a.grads, b.grads),
        loss_sum=a.loss_sum + b.loss_sum,
        count=a.count + b.count,
        stats=combine(a.stats, b.stats),
    )


def tree_norm(tree: Any) -> jax.Array:
    """The global L2 norm of a pytree's leaves in float32, as ``optax.tree.norm``, computed
    as one dot product per leaf (all axes contracted: no reshape, so a sharded leaf sums its
    shards and all-reduces)."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        total = total + _squared_norm(x)
    return jnp.sqrt(total)


def _squared_norm(x: jax.Array) -> jax.Array:
    axes = "abcdefghijklmnop"[: x.ndim]
    return jnp.einsum(f"{axes},{axes}->", x, x, preferred_element_type=jnp.float32)


def update_leaf_by_leaf(
    optimizer: optax.GradientTransformation,
    grads: Params,
    opt_state: optax.OptState,
    params: Params,
) -> tuple[Params, optax.OptState, jax.Array]:
    """``optimizer.update`` and ``optax.apply_updates`` one parameter leaf at a time, in
    order, with the global L2 norm of the updates.

    The same values as one call over the whole tree, for an optimizer that acts leaf by
    leaf (:class:`LeafwiseOptimizer`; not a chain with a global transform such as
    ``clip_by_global_norm`` inside, which :func:`apply_grads` does itself). Why: a norm of
    the updates is a second reader of every update beside the parameter write, so XLA
    materialises them; XLA:CPU then schedules every leaf's update before any is applied and
    holds them all at once. Here each leaf's gradient carries a zero-valued dependency on
    the previous leaf's applied update and norm (``g + 0 * dep``: XLA keeps it, as ``x * 0``
    is not 0 for a NaN or an infinity, and it drops optimization barriers before
    scheduling), so one leaf's update is alive at a time (the figures: docs/performance.md).
    A compiler that folded it would give the same values with the old memory.

    Returns:
      (new_params, new_opt_state, update_norm).
    """
    leaves, treedef = jax.tree.flatten(params)
    grad_leaves = treedef.flatten_up_to(grads)

    def param_shaped(x: Any) -> bool:
        return jax.tree.structure(x) == treedef

    # The optimizer state as its parts: params-shaped trees (moments) split into leaves,
    # anything else (step counts, schedule states) given whole to every leaf's update.
    parts, parts_def = jax.tree.flatten(opt_state, is_leaf=param_shaped)
    split = [treedef.flatten_up_to(p) if param_shaped(p) else None for p in parts]
    new_leaves, new_parts = [], []
    squares = jnp.zeros((), jnp.float32)
    for i, (p, g) in enumerate(zip(leaves, grad_leaves, strict=True)):
        if i:
            # One element of the previous leaf's new value: its write happens first too.
            dep = squares + new_leaves[-1][(0,) * new_leaves[-1].ndim].astype(jnp.float32)
            g = g + (0.0 * dep).astype(g.dtype)
        state_i = parts_def.unflatten(
            [s[i] if s is not None else part for s, part in zip(split, parts, strict=True)]
        )
        u, new_state_i = optimizer.update(g, state_i, p)
        squares = squares + _squared_norm(u)
        new_leaves.append(optax.apply_updates(p, u))
        new_parts.append(jax.tree.flatten(new_state_i, is_leaf=param_shaped)[0])
    merged = [
        treedef.unflatten([leaf_parts[j] for leaf_parts in new_parts])
        if split[j] is not None
        else new_parts[0][j]
        for j in range(len(parts))
    ]
    return treedef.unflatten(new_leaves), parts_def.unflatten(merged), jnp.sqrt(squares)


def apply_grads(
    state: TrainState,
    acc: Accumulated,
    *,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, Stats]:
    """Divide by the accumulated count, clip, update; skip the update if anything is
    non-finite.

    A skipped step leaves params, optimizer state and version untouched and reports
    ``step/skipped = 1`` so the host can count and stop after N in a row. On a CPU a
    :class:`LeafwiseOptimizer` (what :func:`make_optimizer` returns) is applied one leaf at
    a time; any other optimizer, and every optimizer on an accelerator, over the whole tree.

    Returns:
      (new_state, stats): ``loss/total`` and the ``optim/*`` norms as means (over the
      minibatches of a step), ``step/skipped`` as a maximum.
    """
    denominator = jnp.maximum(acc.count, TINY)
    # Norms as dot products (every axis contracted): XLA's CPU reductions run far below
    # memory speed, its dots do not (docs/performance.md).
    grad_norm = tree_norm(acc.grads) / denominator
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(acc.loss_sum)
    # 1/denominator and the clip (same rule as optax.clip_by_global_norm, done here to
    # report the pre-clip norm) are one scale, folded into the update's elementwise pass.
    scale = 1.0 / denominator
    if grad_clip > 0:
        scale = scale * jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6))

    def update(state: TrainState) -> tuple[TrainState, jax.Array]:
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), acc.grads)
        if isinstance(optimizer, LeafwiseOptimizer) and jax.default_backend() == "cpu":
            # On a CPU only: XLA:GPU fuses the whole-tree update with its norm, and the
            # leaf-by-leaf chain made it slower and larger there (docs/log.md).
            params, opt_state, update_norm = update_leaf_by_leaf(
                optimizer, grads, state.opt_state, state.params
            )
        else:
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params, update_norm = optax.apply_updates(state.params, updates), tree_norm(updates)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), update_norm

    def skip(state: TrainState) -> tuple[TrainState, jax.Array]:
        return state, jnp.zeros((), jnp.float32)

    if jax.device_count() == 1:
        # A branch, not a select over every leaf: a select must hold the new and the old
        # params and optimizer state at once and costs a full extra pass over them.
        new_state, update_norm = jax.lax.cond(finite, update, skip, state)
    else:
        # Several devices: with the update's collectives inside a lax.cond branch, XLA:CPU
        # deadlocks (two devices of one process wait in different all-reduces) or aborts
        # (gloo across processes: "collective mismatch"); tests/e2e/test_trainer_multiprocess.py
        # shows both. Sharded jobs take the select, on every backend (not measured off CPU).
        new, update_norm = update(state)
        new_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
        update_norm = jnp.where(finite, update_norm, 0.0)
    one = jnp.ones((), jnp.float32)
    stats = Stats(
        means={
            "loss/total": (acc.loss_sum / denominator, one),
            "optim/grad_norm": (grad_norm, one),
            "optim/update_norm": (update_norm, one),
            "optim/param_norm": (tree_norm(new_state.params), one),
        },
        maxima={"step/skipped": 1.0 - finite.astype(jnp.float32)},
    )
    return new_state, stats
