"""Placement on a mesh and the jit boundary of the train step.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

The parameters and optimizer state are laid out by ``sharding.TRAIN_RULES`` (FSDP + tensor
parallel), every batch array along its leading axis over ("data", "fsdp"), and the step is
jitted once with explicit in/out shardings and its state donated (style §7).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from a3po_jax.core.algorithm import Algorithm
from a3po_jax.core.optim import TrainState
from a3po_jax.core.train_step import train_step
from a3po_jax.parallel import sharding

Params = Any


def batch_shardings(mesh: jax.sharding.Mesh, batch_size: int) -> jax.sharding.NamedSharding:
    """Sharding of every train-step batch array: the leading axis (rows, or groups when
    packed) over ("data", "fsdp"), the rest replicated. One spec fits every rank, since a
    PartitionSpec shorter than the array's rank replicates the trailing axes.

    Raises a ValueError naming both numbers when the mesh does not divide ``batch_size``.
    """
    sharding.check_batch_divisible(batch_size, mesh, sharding.TRAIN_RULES)
    rows = sharding.batch_sharding(mesh, sharding.TRAIN_RULES).spec[0]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rows))


def place_train_state(
    params: Params, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh
) -> TrainState:
    """A copy of the params laid out by ``sharding.TRAIN_RULES`` (FSDP + tensor parallel) and
    an optimizer state initialised under jit, so Adam's moments inherit the params' shardings."""
    shardings = sharding.param_shardings(params, mesh, sharding.TRAIN_RULES)
    # A copy, never an alias: the step donates the state's buffers, and the caller's params
    # (e.g. the policy the inference host or a reference was built from) must survive it.
    params = jax.tree.map(lambda x, s: jax.device_put(x, s, may_alias=False), params, shardings)
    opt_state = jax.jit(optimizer.init)(params)
    # Leaves not derived from params (Adam's step count) land on one device: replicate them.
    replicated = sharding.replicated(mesh)

    def on_mesh(x):
        s = x.sharding
        if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh:
            return x
        return jax.device_put(x, replicated)

    opt_state = jax.tree.map(on_mesh, opt_state)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return TrainState(params=params, opt_state=opt_state, step=step)


def jit_train_step(
    state: TrainState,
    mesh: jax.sharding.Mesh,
    *,
    algo: Algorithm,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
    with_reference: bool,
):
    """``train_step`` jitted at the boundary with explicit shardings; the state is donated.

    Args:
      state: a placed state (from :func:`place_train_state`); its shardings are reused for
        the output so the step never moves parameters.
      algo: the step's algorithm; its plan's leading rows are checked against the mesh.
      with_reference: whether a reference params tree (same layout as params) is passed.

    Returns:
      ``fn(state, batch, ref_params) -> (state, metrics)``.
    """
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    ref_shardings = state_shardings.params if with_reference else None
    fn = functools.partial(train_step, algo=algo, optimizer=optimizer, grad_clip=grad_clip)
    batch = batch_shardings(mesh, algo.plan.leading_rows)
    return jax.jit(
        fn,
        in_shardings=(state_shardings, batch, ref_shardings),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )
