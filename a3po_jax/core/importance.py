"""Importance weights between the behaviour policy and the trainer: sequence-level
truncated / masked correction (TIS / MIS) and the mismatch histogram.

Core layer (pure): imports only ``a3po_jax.core`` and third-party packages.

Even at staleness 0 the inference host's behaviour log-probs differ from the trainer's
(different programs, batch shapes, dtypes). The decoupled loss already weights each token
by w_t = π_prox/π_behav and can cap it per token (``behav_weight_cap``, ``cap_mode``:
token-level TIS / MIS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; no arXiv id). This
module adds the sequence-level variants, which weight every token of a response by one
weight for the whole response (Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch",
https://richardli.xyz/rl-collapse; no arXiv id). Their analysis: token-level weights are
biased (O(T² Δ_max)); the untruncated sequence weight is unbiased with variance exponential
in T; truncating or masking it per sequence trades a little bias for bounded variance.

Choices are tables resolved once (:func:`make_sequence_correction`); the function it
returns compares no strings, so it is safe inside the differentiated step.

Shape letters: B sequences, T tokens, K histogram bins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from a3po_jax.core.checks import check_choice

# --------------------------------------------------------------------------------------
# Sequence-level weights.
# --------------------------------------------------------------------------------------


def _log_product(log_w: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(log_w * mask, axis=-1)


def _log_geometric_mean(log_w: jax.Array, mask: jax.Array) -> jax.Array:
    # max(n, 1): a sequence with no valid token gets log W = 0 (W = 1), not 0/0.
    return jnp.sum(log_w * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


# Each maps (log w [B, T] float32, mask [B, T] float32) to log W [B].
SEQ_WEIGHT_FORMS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "product": _log_product,
    "geometric_mean": _log_geometric_mean,
}


def _truncate(log_seq: jax.Array, log_cap: float):
    return jnp.minimum(log_seq, log_cap), jnp.ones_like(log_seq, bool), log_seq > log_cap


def _mask_upper(log_seq: jax.Array, log_cap: float):
    keep = log_seq <= log_cap
    # The weight of a dropped sequence is never used; min keeps exp() finite anyway.
    return jnp.minimum(log_seq, log_cap), keep, jnp.zeros_like(keep)


def _mask_both(log_seq: jax.Array, log_cap: float):
    keep = jnp.abs(log_seq) <= log_cap
    return jnp.clip(log_seq, -log_cap, log_cap), keep, jnp.zeros_like(keep)


# Each maps (log W [B], log C) to (log of the weight used [B], kept [B], truncated [B]).
SEQ_CAP_RULES = {
    "truncate": _truncate,  # seq-TIS: W := min(W, C)
    "mask": _mask_upper,  # seq-MIS: drop the sequence when W > C
    "mask_both": _mask_both,  # drop the sequence when W ∉ [1/C, C]
}
SEQ_CAP_MODES: tuple[str, ...] = tuple(SEQ_CAP_RULES)
SEQ_FORMS: tuple[str, ...] = tuple(SEQ_WEIGHT_FORMS)


class SequenceCorrection(NamedTuple):
    """The sequence-level correction of one batch (no gradient anywhere)."""

    log_seq_weight: jax.Array  # [B] log W_b before the cap
    seq_keep: jax.Array  # [B] bool: the sequence stays in the loss
    seq_truncated: jax.Array  # [B] bool: its weight was lowered to C
    token_weight: jax.Array  # [B, T] float32: the capped W_b on each of its tokens


def make_sequence_correction(
    cap: float, *, mode: str = "truncate", form: str = "product"
) -> Callable[[jax.Array, jax.Array], SequenceCorrection]:
    """Sequence-level truncated / masked importance weights, resolved once.

    log W_b = Σ_t m_bt · (prox_bt - behav_bt)                      form = "product"
    log W_b = Σ_t m_bt · (prox_bt - behav_bt) / Σ_t m_bt           form = "geometric_mean"
    truncate (seq-TIS):  ω_b = min(W_b, C)
    mask (seq-MIS):      ω_b = W_b · 1[W_b ≤ C]
    mask_both:           ω_b = W_b · 1[1/C ≤ W_b ≤ C]
    every valid token t of sequence b: ℓ_bt = ω_b · max(-A r_bt, -A clip(r_bt, 1 ± ε))

    Symbols: prox = log π_prox, behav = log π_behav, m the completion mask, C > 1 the cap,
    r_bt = π_θ/π_prox the decoupled loss's trust-region ratio. The ratio is π_prox/π_behav,
    not π_θ/π_behav: in the decoupled loss (Hilton et al., arXiv 2110.00641) the factor
    π_θ/π_prox is already the clipped ratio r, so using π_θ here would count it twice and
    give the weight a gradient path; the weight corrects only for who sampled the data.
    With A-3PO (arXiv 2512.06547) at staleness 0, prox = sg(logp), so W_b is exactly the
    train-inference mismatch π_θ/π_behav of the sequence. Product is Liu, Li et al.'s
    sequence-level IS (2025, https://richardli.xyz/rl-collapse). The geometric mean is their
    length-normalised variant (Geo-MIS, in verl ≥ 0.6): a product over T tokens drifts like
    T · E[log w], so one cap C cannot suit short and long responses alike; the per-token
    geometric mean keeps C's meaning ("average drift per token") the same at every length.
    Everything is done in log space, so a long sequence's product never overflows. A
    dropped sequence's tokens still count in the loss's denominator (design §3: the count
    comes from the mask alone), so masking shrinks the step instead of re-weighting the
    sequences that remain (slime chose the other convention, THUDM/slime#657).

    Args:
      cap: C > 1.
      mode: a key of ``SEQ_CAP_RULES``.
      form: a key of ``SEQ_WEIGHT_FORMS``.

    Returns:
      ``fn(log_w [B, T], mask [B, T]) -> SequenceCorrection``; ``log_w`` is
      prox - behav per token (already 0 where the mask is 0).

    Raises:
      ValueError: for an unknown mode or form, or C ≤ 1, naming the allowed values.
    """
    check_choice("seq_cap_mode", mode, SEQ_CAP_MODES)
    check_choice("seq_weight_form", form, SEQ_FORMS)
    if not cap > 1.0:
        raise ValueError(f"sequence weight cap must be > 1, got {cap!r}")
    seq_log_weight = SEQ_WEIGHT_FORMS[form]
    rule = SEQ_CAP_RULES[mode]
    log_cap = math.log(cap)

    def correction(log_w: jax.Array, mask: jax.Array) -> SequenceCorrection:
        if jnp.ndim(log_w) != 2 or jnp.shape(mask) != jnp.shape(log_w):
            raise ValueError(
                f"log_w and mask must both be [B, T], got {jnp.shape(log_w)} and {jnp.shape(mask)}"
            )
        m = mask.astype(jnp.float32)
        log_seq = seq_log_weight(jax.lax.stop_gradient(log_w.astype(jnp.float32)), m)  # [B]
        log_used, keep, truncated = rule(log_seq, log_cap)
        token_weight = jnp.broadcast_to(jnp.exp(log_used)[:, None], jnp.shape(log_w))
        return SequenceCorrection(log_seq, keep, truncated & (jnp.sum(m, -1) > 0), token_weight)

    return correction


# --------------------------------------------------------------------------------------
# Quantiles of the importance weights that add across micro-batches.
# --------------------------------------------------------------------------------------

# Quantiles of w are read from a histogram of log w with K fixed bins, uniform in
# u = asinh(log w / s): bins are ~s·du wide near w = 1 (s = 1e-4: float32 mismatch is
# visible) and ~du·|log w| wide in the tails (a fixed relative resolution of the log-ratio,
# du = 2U/K ≈ 1.2 %), covering |log w| ≤ s·sinh(U) ≈ 8.1 (w from 3e-4 to 3e3; values beyond
# land in the end bins, and the exact extremes are reported separately as maxima / minima).
# A histogram, not sorted values: counts add across micro-batches, minibatches and periodic
# groups, so the quantile is of every token of the step and is taken once, at the top,
# like every other metric; sorted arrays would not merge without growing shapes.
HIST_BINS = 2048
HIST_SCALE = 1e-4
HIST_U = 12.0
HIST_DU = 2.0 * HIST_U / HIST_BINS
# Reported quantiles: metric suffix -> q.
QUANTILES: dict[str, float] = {"p01": 0.01, "p50": 0.5, "p99": 0.99}


def log_weight_histogram(log_w: jax.Array, mask: jax.Array) -> jax.Array:
    """Counts of the valid tokens' log-weights in the fixed bins above.

    Args:
      log_w: ``[B, T]`` log importance weights.
      mask: ``[B, T]`` 1 for tokens that count.

    Returns:
      ``[K]`` float32 counts (exact integers up to 2²⁴ tokens).
    """
    u = jnp.arcsinh(log_w.astype(jnp.float32) / HIST_SCALE)
    idx = jnp.clip(jnp.floor((u + HIST_U) / HIST_DU), 0, HIST_BINS - 1).astype(jnp.int32)
    return (
        jnp.zeros((HIST_BINS,), jnp.float32).at[idx.ravel()].add(mask.astype(jnp.float32).ravel())
    )


def histogram_quantiles(counts: jax.Array, qs: tuple[float, ...]) -> jax.Array:
    """Weights at quantiles ``qs`` of a :func:`log_weight_histogram` (0 when it is empty).

    The q-quantile is the k-th smallest value with k = max(1, ⌈q·n⌉) (NumPy's
    ``method="inverted_cdf"``): the first bin whose cumulative count reaches k
    (``searchsorted`` on the cumsum), reported at the bin's centre. Its error in log w is at
    most one bin width, du · sqrt(s² + (log w)²).

    Args:
      counts: ``[K]`` bin counts.
      qs: quantiles in (0, 1].

    Returns:
      ``[len(qs)]`` float32 weights w.
    """
    cum = jnp.cumsum(counts)
    n = cum[-1]
    k = jnp.maximum(jnp.ceil(jnp.asarray(qs, jnp.float32) * n), 1.0)
    idx = jnp.searchsorted(cum, k, side="left")
    centre_u = -HIST_U + (idx.astype(jnp.float32) + 0.5) * HIST_DU
    return jnp.where(n > 0, jnp.exp(HIST_SCALE * jnp.sinh(centre_u)), 0.0)
