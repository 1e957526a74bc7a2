"""Online DPO: maths, term, metrics and the ``dpo`` objective's registration.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

    h = (logp⁺ - ref⁺) - (logp⁻ - ref⁻)       sequence log-probs, ⁺ the higher reward
    sigmoid:  ℓ = -log σ(β h)                 (Rafailov et al., arXiv 2305.18290)
    ipo:      ℓ = (h - 1 / (2β))²             (Azar et al., arXiv 2310.12036)

Asynchronous RLHF (Noukhovitch et al., arXiv 2410.18252) finds it the loss most robust to
off-policy samples. One road from the per-pair maths to both callers:
:func:`online_dpo_per_pair` (ℓ and diagnostics per pair), :func:`pair_sums` (their
``(loss_sum, count, Stats)``), :func:`dpo_term` (the train step's term: sequence log-probs
of a micro-batch's rows 2i / 2i+1, then the sums) and :func:`online_dpo_loss` (the public
loss: the sums finalized). The objective reads the frozen reference's log-probs and needs
the ``pairs`` batch layout (groups of 2, ordered chosen then rejected).

Shape letters: P pairs, b rows of a micro-batch (2 per pair), T tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core.aggregation import TINY
from a3po_jax.core.checks import check_choice, check_positive, check_rank, check_same_shape
from a3po_jax.core.objectives.registry import PAIRS, Term, register
from a3po_jax.core.objectives.spec import ObjectiveSpec, check_number
from a3po_jax.core.stats import Stats, finalize, masked_pair

Batch = dict[str, jax.Array]

# Online DPO per-pair losses of the margin h (beta > 0): sigmoid (Rafailov et al. 2305.18290)
# and IPO (Azar et al. 2310.12036).
_DPO_LOSSES = {
    "sigmoid": lambda h, beta: -jax.nn.log_sigmoid(beta * h),
    "ipo": lambda h, beta: jnp.square(h - 1.0 / (2.0 * beta)),
}
DPO_KINDS: tuple[str, ...] = tuple(_DPO_LOSSES)


class PairDiagnostics(NamedTuple):
    """Per-pair diagnostics of :func:`online_dpo_per_pair`, ``[P]`` float32 each."""

    margin: jax.Array  # β·h
    accuracy: jax.Array  # 1 where h > 0
    chosen_reward: jax.Array  # β·(logp⁺ - ref⁺)
    rejected_reward: jax.Array  # β·(logp⁻ - ref⁻)


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """``algo.dpo.*``: Online DPO's own settings."""

    beta: float = 0.1  # β > 0
    kind: str = "sigmoid"  # "sigmoid" or "ipo"

    def __post_init__(self):
        check_number("beta", self.beta, above=0.0)
        check_choice("kind", self.kind, DPO_KINDS)


def sequence_logprobs(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of token log-probs over the valid (completion) tokens of each sequence.

    Args:
      logp: ``[B, T]`` token log-probs.
      mask: ``[B, T]`` 1 for completion tokens, 0 elsewhere.

    Returns:
      ``[B]`` sequence log-probs.
    """
    check_rank("logp", logp, 2, "[B, T]")
    check_same_shape("logp", logp, mask=mask)
    return jnp.sum(logp * mask.astype(logp.dtype), axis=-1)


def online_dpo_per_pair(
    chosen_logp: jax.Array,
    rejected_logp: jax.Array,
    chosen_ref_logp: jax.Array,
    rejected_ref_logp: jax.Array,
    *,
    beta: float,
    kind: str = "sigmoid",
) -> tuple[jax.Array, PairDiagnostics]:
    """Per-pair Online DPO loss ℓ_i and per-pair diagnostics, nothing reduced.

    The formula, symbols and papers are those of :func:`online_dpo_loss`, which is the
    masked mean of this function's ℓ.

    Args:
      chosen_logp, rejected_logp: ``[P]`` current sequence log-probs.
      chosen_ref_logp, rejected_ref_logp: ``[P]`` reference sequence log-probs.
      beta: β > 0.
      kind: ``"sigmoid"`` or ``"ipo"``.

    Returns:
      ``(per_pair, diagnostics)``: ``[P]`` float32 ℓ and a :class:`PairDiagnostics`.
    """
    check_rank("chosen_logp", chosen_logp, 1, "[P] sequence log-probs")
    check_same_shape(
        "chosen_logp",
        chosen_logp,
        rejected_logp=rejected_logp,
        chosen_ref_logp=chosen_ref_logp,
        rejected_ref_logp=rejected_ref_logp,
    )
    check_positive("beta", beta)
    check_choice("kind", kind, DPO_KINDS)
    f32 = jnp.float32
    chosen_ratio = chosen_logp.astype(f32) - jax.lax.stop_gradient(chosen_ref_logp.astype(f32))
    rejected_ratio = rejected_logp.astype(f32) - jax.lax.stop_gradient(
        rejected_ref_logp.astype(f32)
    )
    h = chosen_ratio - rejected_ratio  # [P]
    per_pair = _DPO_LOSSES[kind](h, beta)
    h_sg = jax.lax.stop_gradient(h)
    diagnostics = PairDiagnostics(
        margin=beta * h_sg,
        accuracy=(h_sg > 0).astype(f32),
        chosen_reward=beta * jax.lax.stop_gradient(chosen_ratio),
        rejected_reward=beta * jax.lax.stop_gradient(rejected_ratio),
    )
    return per_pair, diagnostics


def pair_sums(
    per_pair: jax.Array, diagnostics: PairDiagnostics, pair_mask: jax.Array
) -> tuple[jax.Array, jax.Array, Stats]:
    """:func:`online_dpo_per_pair`'s outputs over the pairs that count, as
    ``(loss_sum, count, stats)`` that add across micro-batches; ``loss = loss_sum / count``.

    Args:
      per_pair: ``[P]`` ℓ.
      diagnostics: its ``[P]`` diagnostics.
      pair_mask: ``[P]`` float32, 1 for pairs with a preference.

    Returns:
      ``(loss_sum, count, stats)``: ``dpo/margin_mean``, ``dpo/accuracy``,
      ``dpo/chosen_reward``, ``dpo/rejected_reward`` (means over counted pairs) and
      ``dpo/num_pairs`` (a total).
    """
    loss_sum, count = masked_pair(per_pair, pair_mask)
    # dpo/<field>: each diagnostic's mean over counted pairs (the margin's: dpo/margin_mean)
    means = {
        f"dpo/{'margin_mean' if name == 'margin' else name}": masked_pair(value, pair_mask)
        for name, value in diagnostics._asdict().items()
    }
    return loss_sum, count, Stats(means=means, totals={"dpo/num_pairs": count})


def dpo_term(
    logp: jax.Array,
    mb: Batch,
    *,
    staleness: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array,
    beta: float,
    kind: str,
) -> tuple[jax.Array, jax.Array, Stats]:
    """Online DPO on one micro-batch: rows 2i / 2i+1 are pair i's chosen / rejected sample
    (the ``pairs`` layout); the count is the pairs with a preference."""
    del staleness, old_logp
    mask = mb["loss_mask"]
    seq = sequence_logprobs(logp, mask)  # [b]
    ref_seq = sequence_logprobs(ref_logp, mask)  # [b]
    per_pair, diag = online_dpo_per_pair(
        seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], beta=beta, kind=kind
    )
    pairs = mb["pair_mask"][0::2].astype(jnp.float32)  # [b / 2]
    return pair_sums(per_pair, diag, pairs)


@register("dpo", settings=DPOSettings, needs_reference=True, layout=PAIRS)
def dpo(spec: ObjectiveSpec) -> Term:
    """``algo.loss=dpo``: :func:`dpo_term` with ``algo.dpo.beta`` and ``algo.dpo.kind``."""
    own = spec.settings
    return Term(functools.partial(dpo_term, beta=own.beta, kind=own.kind))


def online_dpo_loss(
    *sequence_logps: jax.Array,
    mask: jax.Array | None = None,
    denominator: jax.Array | float | None = None,
    **dpo: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Online DPO on pairs of on-line samples ranked by a reward.

    h = (logp⁺ - ref⁺) - (logp⁻ - ref⁻)
    sigmoid:  ℓ = -log σ(β h)                 (Rafailov et al., arXiv 2305.18290)
    ipo:      ℓ = (h - 1 / (2β))²             (Azar et al., arXiv 2310.12036)

    Asynchronous RLHF (Noukhovitch et al., arXiv 2410.18252) finds it the loss most robust
    to off-policy samples. Log-probs are *sequence* log-probs (sum over completion tokens,
    see ``sequence_logprobs``); ⁺ is the higher-reward sample of the pair. This function is
    ``finalize`` of the same sums the train step adds across micro-batches
    (:func:`dpo_term`), divided once.

    Args:
      sequence_logps: ``chosen_logp``, ``rejected_logp`` (``[B]`` current sequence
        log-probs), ``chosen_ref_logp``, ``rejected_ref_logp`` (``[B]`` the reference's).
      dpo: ``beta`` (β > 0) and ``kind`` (``"sigmoid"`` or ``"ipo"``) of
        :func:`online_dpo_per_pair`.
      mask: optional ``[B]`` 1 for pairs that count (e.g. 0 where both samples got the same
        reward, so there is no preference to learn).
      denominator: global number of counted pairs for micro-batching; defaults to the
        local count.

    Returns:
      ``(loss, metrics)`` with ``dpo/margin_mean`` (mean β·h), ``dpo/accuracy`` (fraction
      with h > 0), ``dpo/chosen_reward`` and ``dpo/rejected_reward`` (β·(logp - ref)).
    """
    check_same_shape("chosen_logp", sequence_logps[0], mask=mask)
    per_pair, diag = online_dpo_per_pair(*sequence_logps, **dpo)
    pair_mask = jnp.ones_like(per_pair) if mask is None else mask.astype(jnp.float32)
    loss_sum, count, stats = pair_sums(per_pair, diag, pair_mask)
    # A caller-given denominator is the whole batch's count (micro-batch losses then add).
    loss = loss_sum / (count + TINY if denominator is None else denominator)
    return loss, finalize(stats)
