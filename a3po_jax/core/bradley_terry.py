"""The Bradley-Terry loss of a reward model on preference pairs, and its jitted train step.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Under Bradley-Terry, P(chosen ≻ rejected) = σ(r_chosen − r_rejected); the loss is its
negative log-likelihood, −log σ(r_c − r_r) = softplus(r_r − r_c), averaged over pairs, and
the pair accuracy counts r_c > r_r as right and a tie as half (an untrained zero head is at
0.5, not 0). A pair batch (:class:`PairBatch`) holds both sides right-padded with explicit
lengths; the step scores chosen and rejected in one forward pass of 2B rows and updates
through the policy's own optimizer code (:func:`a3po_jax.core.optim.apply_grads`: AdamW,
gradient clip, the skipped non-finite step), on the policy's mesh layout
(:func:`a3po_jax.core.placement.place_train_state`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from a3po_jax.core.optim import Accumulated, TrainState, apply_grads
from a3po_jax.core.placement import batch_shardings
from a3po_jax.core.stats import Stats, finalize, masked_pair
from a3po_jax.model.config import ModelConfig, Params
from a3po_jax.model.reward_model import reward_scores
from a3po_jax.parallel import sharding


class PairBatch(NamedTuple):
    """B preference pairs, each side right-padded to T tokens."""

    chosen: jax.Array  # [B, T] int32
    chosen_lengths: jax.Array  # [B] int32
    rejected: jax.Array  # [B, T] int32
    rejected_lengths: jax.Array  # [B] int32
    mask: jax.Array  # [B] float32: 1 for a real pair, 0 for a filler of a short batch


def bradley_terry_terms(r_chosen: jax.Array, r_rejected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per pair: (−log σ(r_c − r_r), 1 if r_c > r_r, ½ on a tie, else 0), float32."""
    margin = r_chosen.astype(jnp.float32) - r_rejected.astype(jnp.float32)
    loss = jax.nn.softplus(-margin)  # = −log σ(margin), finite for any margin
    correct = jnp.where(margin > 0, 1.0, jnp.where(margin == 0, 0.5, 0.0))
    return loss, correct


def bradley_terry_loss(
    r_chosen: jax.Array, r_rejected: jax.Array, mask: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean Bradley-Terry loss over (masked) pairs, and its metrics.

    Args:
      r_chosen, r_rejected: [B] rewards of each pair's two sides.
      mask: [B], 1 for pairs that count (default: all).
    Returns:
      (loss, {"reward/pair_accuracy", "reward/margin", "reward/num_pairs"}).
    """
    mask = jnp.ones_like(r_chosen, jnp.float32) if mask is None else mask
    loss, correct = bradley_terry_terms(r_chosen, r_rejected)
    loss_sum, count = masked_pair(loss, mask)
    stats = _pair_stats(r_chosen, r_rejected, correct, mask)
    metrics = finalize(stats)
    metrics["reward/num_pairs"] = count
    return loss_sum / jnp.maximum(count, 1.0), metrics


def _pair_stats(r_chosen, r_rejected, correct, mask) -> Stats:
    return Stats(
        means={
            "reward/pair_accuracy": masked_pair(correct, mask),
            "reward/margin": masked_pair(r_chosen - r_rejected, mask),
            "reward/chosen": masked_pair(r_chosen, mask),
            "reward/rejected": masked_pair(r_rejected, mask),
        }
    )


def pair_scores(params: Params, batch: PairBatch, config: ModelConfig) -> tuple[jax.Array, ...]:
    """(r_chosen [B], r_rejected [B]): both sides in one forward pass of 2B rows."""
    b = batch.chosen.shape[0]
    tokens = jnp.concatenate([batch.chosen, batch.rejected], axis=0)
    lengths = jnp.concatenate([batch.chosen_lengths, batch.rejected_lengths], axis=0)
    scores = reward_scores(params, tokens, lengths, config=config)
    return scores[:b], scores[b:]


def pair_sums(params: Params, batch: PairBatch, config: ModelConfig) -> tuple[jax.Array, Stats]:
    """(Σ masked loss, stats with the pair count): what a step or an evaluation adds up."""
    r_chosen, r_rejected = pair_scores(params, batch, config)
    loss, correct = bradley_terry_terms(r_chosen, r_rejected)
    loss_sum, count = masked_pair(loss, batch.mask)
    stats = _pair_stats(r_chosen, r_rejected, correct, batch.mask)
    stats.means["loss/bradley_terry"] = (loss_sum, count)
    return loss_sum, stats


def reward_train_step(
    state: TrainState,
    batch: PairBatch,
    *,
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on the mean Bradley-Terry loss of `batch`'s real pairs.

    Returns:
      (new_state, metrics): ``loss/bradley_terry``, ``reward/pair_accuracy``,
      ``reward/margin``, the ``optim/*`` norms and ``step/skipped`` of `apply_grads`.
    """

    def loss_fn(params):
        return pair_sums(params, batch, config)

    (loss_sum, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    count = jnp.sum(batch.mask.astype(jnp.float32))
    acc = Accumulated(grads=grads, loss_sum=loss_sum, count=count, stats=stats)
    state, optim_stats = apply_grads(state, acc, optimizer=optimizer, grad_clip=grad_clip)
    metrics = finalize(stats)
    metrics.update(finalize(optim_stats))
    return state, metrics


def pair_eval_sums(params: Params, batch: PairBatch, *, config: ModelConfig) -> jax.Array:
    """[3] float32: (Σ loss, Σ correct, Σ pairs) of `batch`'s real pairs, to add over
    batches for a held-out set's loss and accuracy."""
    loss_sum, stats = pair_sums(params, batch, config)
    correct, count = stats.means["reward/pair_accuracy"]
    return jnp.stack([loss_sum, correct, count])


def jit_reward_step(
    state: TrainState,
    mesh: jax.sharding.Mesh,
    *,
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
    batch_size: int,
):
    """:func:`reward_train_step` jitted with explicit shardings (the state laid out by
    :func:`a3po_jax.core.placement.place_train_state`, pairs split over ("data", "fsdp")),
    the state donated, as the policy's step is.

    Returns:
      ``fn(state, batch) -> (state, metrics)``.
    """
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    rows = batch_shardings(mesh, batch_size)
    fn = functools.partial(
        reward_train_step, config=config, optimizer=optimizer, grad_clip=grad_clip
    )
    return jax.jit(
        fn,
        in_shardings=(state_shardings, rows),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )


def jit_pair_eval(params: Params, mesh: jax.sharding.Mesh, *, config: ModelConfig, batch_size: int):
    """:func:`pair_eval_sums` jitted on the same layout: ``fn(params, batch) -> [3]``."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    return jax.jit(
        functools.partial(pair_eval_sums, config=config),
        in_shardings=(param_shardings, batch_shardings(mesh, batch_size)),
        out_shardings=sharding.replicated(mesh),
    )
