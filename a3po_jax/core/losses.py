"""Pure-functional losses for asynchronous RL of LLMs (design.md §3).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Everything here is a function of arrays: no model, no config object, keyword-only
hyperparameters. Policy losses return ``(loss, metrics)`` so they drop straight into
``jax.value_and_grad(..., has_aux=True)``.

Shape letters: B batch (sequences), T time (tokens), V vocab, N groups, G group size.

Reduction happens once, at the top. The per-token (per-pair) pieces come unreduced:
``decoupled_ppo_per_token`` and ``online_dpo_per_pair`` return the loss and diagnostics per
token (pair), and ``aggregate_sum`` turns per-token values into a ``(numerator, count)`` pair
that adds across micro-batches; the train step sums those and divides once. The
reduced losses (``decoupled_ppo_loss``, ``online_dpo_loss``) are these pieces plus one
reduction; their optional ``denominator`` takes the *global* count when a caller adds
micro-batch losses itself. Choices are tables (``AGGREGATORS``, ``KL_ESTIMATORS``), so a
caller can resolve a name once and call the function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from a3po_jax.core.importance import SequenceCorrection

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
# Token-level cap of the behaviour weight w (Yao et al. 2025, TIS/MIS): over = w > cap
# (valid tokens only) -> (weight, keep, masked, truncated). Chosen by table lookup when the
# loss is traced; no string is compared inside the math.
_TOKEN_CAPS = {
    "mask": lambda weight, keep, over, cap: (weight, keep & ~over, over, jnp.zeros_like(over)),
    "truncate": lambda weight, keep, over, cap: (
        jnp.minimum(weight, cap),
        keep,
        jnp.zeros_like(over),
        over,
    ),
}
CAP_MODES: tuple[str, ...] = tuple(_TOKEN_CAPS)
# Online DPO per-pair losses of the margin h (beta > 0): sigmoid (Rafailov et al. 2305.18290)
# and IPO (Azar et al. 2310.12036).
_DPO_LOSSES = {
    "sigmoid": lambda h, beta: -jax.nn.log_sigmoid(beta * h),
    "ipo": lambda h, beta: jnp.square(h - 1.0 / (2.0 * beta)),
}
DPO_KINDS: tuple[str, ...] = tuple(_DPO_LOSSES)
# A-3PO's α at d = 0: the paper's prox = current (α = 0) or AReaL's prox = behav (α = 1).
_ALPHA_AT_ZERO = {"current": 0.0, "behav": 1.0}

# Added to the masked denominator so an all-masked batch gives 0 rather than 0/0 = NaN.
_TINY = 1e-8


# --------------------------------------------------------------------------------------
# Validation helpers (run at trace time: shapes and Python hyperparameters are static).
# --------------------------------------------------------------------------------------


def _check_rank(name: str, x: jax.Array, rank: int, what: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} ({what}), got shape {jnp.shape(x)}")


def _check_same_shape(ref_name: str, ref: jax.Array, **others: jax.Array | None) -> None:
    for name, x in others.items():
        if x is not None and jnp.shape(x) != jnp.shape(ref):
            raise ValueError(
                f"{name} has shape {jnp.shape(x)} but {ref_name} has shape {jnp.shape(ref)}; "
                "they must match exactly (no implicit broadcasting)"
            )


def _check_positive(name: str, value: float | None, *, minimum: float = 0.0) -> None:
    if value is not None and not value > minimum:
        raise ValueError(f"{name} must be > {minimum}, got {value!r}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / (jnp.sum(mask) + _TINY)


def _masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    # 0 when nothing is valid, so an all-padding micro-batch reports a finite value.
    return jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, x, -jnp.inf)), 0.0)


def _masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(jnp.any(mask), jnp.min(jnp.where(mask, x, jnp.inf)), 0.0)


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
    _check_rank("logits", logits, 3, "[B, T, V]")
    _check_rank("targets", targets, 2, "[B, T]")
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
    _check_rank("logits", logits, 3, "[B, T, V]")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sequence_logprobs(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of token log-probs over the valid (completion) tokens of each sequence.

    Args:
      logp: ``[B, T]`` token log-probs.
      mask: ``[B, T]`` 1 for completion tokens, 0 elsewhere.

    Returns:
      ``[B]`` sequence log-probs.
    """
    _check_rank("logp", logp, 2, "[B, T]")
    _check_same_shape("logp", logp, mask=mask)
    return jnp.sum(logp * mask.astype(logp.dtype), axis=-1)


# --------------------------------------------------------------------------------------
# Where the proximal policy comes from.
# --------------------------------------------------------------------------------------


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
    _check_choice("zero_staleness", zero_staleness, tuple(_ALPHA_AT_ZERO))
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
    _check_rank("logp", logp, 2, "[B, T]")
    _check_same_shape("logp", logp, behav_logp=behav_logp, staleness=staleness)
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


# --------------------------------------------------------------------------------------
# Aggregation.
# --------------------------------------------------------------------------------------


def _token_mean(values, mask, max_len):
    del max_len
    return jnp.sum(values), jnp.sum(mask)


def _seq_mean_token_mean(values, mask, max_len):
    del max_len
    tokens_per_seq = jnp.sum(mask, axis=-1)  # [B]
    per_seq = jnp.sum(values, axis=-1) / (tokens_per_seq + _TINY)
    return jnp.sum(per_seq), jnp.sum(tokens_per_seq > 0).astype(jnp.float32)


def _seq_mean_token_sum_norm(values, mask, max_len):
    norm = jnp.shape(values)[-1] if max_len is None else max_len
    _check_positive("max_len", norm)
    per_seq = jnp.sum(values, axis=-1) / norm
    return jnp.sum(per_seq), jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


# Each maps (masked values [B, T], mask [B, T], max_len) to (numerator, count).
AGGREGATORS = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}
AGGREGATIONS: tuple[str, ...] = tuple(AGGREGATORS)


def aggregate_sum(
    values: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "token_mean",
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token values as a ``(numerator, count)`` pair: ``aggregate = numerator / count``.

    token_mean:              (Σ_bt m·x,                   Σ_bt m)
    seq_mean_token_mean:     (Σ_b [Σ_t m·x / Σ_t m],      #seqs with ≥ 1 valid token)
    seq_mean_token_sum_norm: (Σ_b [Σ_t m·x / max_len],    #seqs with ≥ 1 valid token)

    Both parts add across micro-batches (and across arriving groups), so a caller that
    splits a batch sums the pairs and divides once, at the top: the result equals the
    full batch's ``aggregate`` exactly. Dr.GRPO's constant normaliser: arXiv 2503.20783.

    Args:
      values: ``[B, T]`` per-token values (may be 0 where a valid token was dropped, e.g. by
        the importance-weight cap: the count comes from ``mask`` alone, so dropped tokens
        still count, as design.md §3 requires).
      mask: ``[B, T]`` validity (1 = completion token).
      mode: one of ``AGGREGATIONS`` (a key of ``AGGREGATORS``).
      max_len: Dr.GRPO's constant normaliser; defaults to T.

    Returns:
      (numerator, count): float32 scalars.
    """
    _check_choice("aggregation", mode, AGGREGATIONS)
    _check_rank("values", values, 2, "[B, T]")
    _check_same_shape("values", values, mask=mask)
    mask = mask.astype(jnp.float32)
    return AGGREGATORS[mode](values.astype(jnp.float32) * mask, mask, max_len)


def aggregate(
    values: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
) -> jax.Array:
    """Reduce per-token values to a scalar, once.

    token_mean:              Σ_bt m·x / Σ_bt m                     (global valid-token count)
    seq_mean_token_mean:     Σ_b [Σ_t m·x / Σ_t m] / #seqs          (sequences with ≥1 valid token)
    seq_mean_token_sum_norm: Σ_b [Σ_t m·x / max_len] / #seqs        (Dr.GRPO, arXiv 2503.20783)

    ``values`` may already be zero where a token was dropped after validity (e.g. by the
    importance-weight cap): the denominator is computed from ``mask`` alone, so dropped
    tokens still count, as design.md §3 requires. ``aggregate_sum`` gives the two parts.

    Args:
      values: ``[B, T]`` per-token values.
      mask: ``[B, T]`` validity (1 = completion token).
      mode: one of ``AGGREGATIONS``.
      denominator: override of the count (valid tokens for ``token_mean``, sequences for
        the others). Pass the *whole batch's* count when reducing micro-batches, then add.
      max_len: Dr.GRPO's constant normaliser; defaults to T.

    Returns:
      scalar float32.
    """
    numerator, count = aggregate_sum(values, mask, mode=mode, max_len=max_len)
    # A caller-given denominator is used as is (it is the whole batch's count); the local
    # count gets _TINY so an all-masked batch reduces to 0, not 0/0.
    return numerator / (count + _TINY if denominator is None else denominator)


# --------------------------------------------------------------------------------------
# Policy losses.
# --------------------------------------------------------------------------------------


def decoupled_ppo_per_token(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = None,
    cap_mode: str = "mask",
    seq_correction: Callable[[jax.Array, jax.Array], SequenceCorrection] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token decoupled PPO loss ℓ_t and per-token diagnostics, nothing reduced.

    The formula, symbols and paper are those of :func:`decoupled_ppo_loss`, which is
    ``aggregate`` of this function's ℓ. A train step that splits a batch into micro-batches
    reduces these values once, with ``aggregate_sum``, instead of averaging averages.

    Args:
      logp, prox_logp, behav_logp, advantages, mask: ``[B, T]`` as for
        :func:`decoupled_ppo_loss`.
      clip_eps, clip_eps_high, dual_clip, behav_weight_cap, cap_mode: as there.
      seq_correction: sequence-level weights from
        :func:`a3po_jax.core.importance.make_sequence_correction` (seq-TIS / seq-MIS), which
        replace the token weight w_t by the capped sequence weight ω_b on every token of
        sequence b; None keeps the token-level w_t. Not together with ``behav_weight_cap``.

    Returns:
      ``(per_token, diagnostics)``: ``per_token`` ``[B, T]`` float32 ℓ_t (0 where masked or
      dropped by the cap); ``diagnostics`` maps ``"clipped"``, ``"dual_clipped"``,
      ``"capped"`` (0/1 per token), ``"masked"`` / ``"truncated"`` (0/1: the token left the
      loss / its weight was lowered, by either cap), ``"is_weight"`` (the weight used),
      ``"log_is_weight"`` (log w_t = prox - behav before any cap) and ``"kl_behav_k3"`` to
      ``[B, T]`` float32 arrays, meaningful where ``mask`` is 1; with ``seq_correction``
      also ``"seq_log_weight"`` ``[B]`` (log W_b before the cap) and ``"seq_masked"`` /
      ``"seq_truncated"`` ``[B]`` 0/1.
    """
    _check_rank("logp", logp, 2, "[B, T]")
    _check_same_shape(
        "logp",
        logp,
        prox_logp=prox_logp,
        behav_logp=behav_logp,
        advantages=advantages,
        mask=mask,
    )
    _check_positive("clip_eps", clip_eps)
    _check_positive("clip_eps_high", clip_eps_high)
    _check_positive("dual_clip", dual_clip, minimum=1.0)
    _check_positive("behav_weight_cap", behav_weight_cap)
    _check_choice("cap_mode", cap_mode, CAP_MODES)
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    valid = mask.astype(bool)
    logp = logp.astype(jnp.float32)
    # The anchor and the behaviour policy are data, never differentiated.
    prox = jax.lax.stop_gradient(prox_logp.astype(jnp.float32))
    behav = jax.lax.stop_gradient(behav_logp.astype(jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))

    # Log-ratios are masked to 0 before exp so padding (where log-probs may be garbage or
    # -inf) cannot create inf * 0 = NaN in the sums.
    log_r = jnp.where(valid, logp - prox, 0.0)
    log_w = jnp.where(valid, prox - behav, 0.0)
    ratio = jnp.exp(log_r)
    weight = jnp.exp(log_w)

    keep = valid
    none = jnp.zeros_like(valid)
    masked = truncated = none
    seq_diag = {}
    if seq_correction is not None and behav_weight_cap is not None:
        raise ValueError(
            "behav_weight_cap (token-level) and seq_correction (sequence-level) are "
            "alternatives: set one of them"
        )
    if seq_correction is not None:
        corr = seq_correction(log_w, valid)
        weight = corr.token_weight
        keep = valid & corr.seq_keep[:, None]
        masked = valid & ~corr.seq_keep[:, None]
        truncated = valid & corr.seq_truncated[:, None]
        capped = masked | truncated
        seq_diag = {
            "seq_log_weight": corr.log_seq_weight,
            "seq_masked": (~corr.seq_keep).astype(jnp.float32),
            "seq_truncated": corr.seq_truncated.astype(jnp.float32),
        }
    elif behav_weight_cap is not None:
        capped = (weight > behav_weight_cap) & valid
        weight, keep, masked, truncated = _TOKEN_CAPS[cap_mode](
            weight, keep, capped, behav_weight_cap
        )
    else:
        capped = none

    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg = jnp.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped) & valid
    dual_hit = jnp.zeros_like(valid)
    if dual_clip is not None:
        bound = -dual_clip * adv  # positive where adv < 0
        dual_hit = (adv < 0) & (pg > bound) & valid
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    per_token = jnp.where(keep, weight * pg, 0.0)

    x = behav - logp  # k3 estimator of KL(π_behav ‖ π_θ) on samples from π_behav
    k3 = jnp.where(valid, jnp.expm1(jnp.where(valid, x, 0.0)) - x, 0.0)
    f32 = jnp.float32
    diagnostics = {
        "clipped": clip_hit.astype(f32),
        "dual_clipped": dual_hit.astype(f32),
        "capped": capped.astype(f32),
        "masked": masked.astype(f32),
        "truncated": truncated.astype(f32),
        "is_weight": weight,
        "log_is_weight": log_w,
        "kl_behav_k3": jax.lax.stop_gradient(k3),
        **seq_diag,
    }
    return per_token, diagnostics


def decoupled_ppo_loss(
    logp: jax.Array,
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = None,
    cap_mode: str = "mask",
    aggregation: str = "token_mean",
    denominator: jax.Array | float | None = None,
    max_len: int | None = None,
    staleness: jax.Array | None = None,
    seq_correction: Callable[[jax.Array, jax.Array], SequenceCorrection] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO clip loss with separate behaviour and proximal policies.

    r_t = exp(logp_t - prox_t)                               trust-region ratio
    w_t = sg(exp(prox_t - behav_t))                          off-policy correction
    ℓ_t = w_t · max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))
    dual clip (A_t < 0):  ℓ_t = min(ℓ_t, -c · A_t · w_t),  c > 1
    cap: tokens with w_t > cap dropped ("mask") or w_t := cap ("truncate")
    or, sequence-level (``seq_correction``): w_t := ω_b, the capped Π_t w_t of the token's
    sequence (see :func:`a3po_jax.core.importance.make_sequence_correction`)
    loss = aggregate(ℓ, m)

    Symbols: logp = log π_θ (differentiated), prox = log π_prox (the trust-region anchor:
    recomputed, A-3PO-interpolated, or behav — this function does not know which), behav =
    log π_behav (the policy that sampled the data), A advantages, m the completion mask.
    Hilton et al., "Batch size-invariance for policy optimization", arXiv 2110.00641; used
    for asynchronous RL by AReaL, arXiv 2505.24298. With prox = behav it is exactly PPO's
    clipped objective against the behaviour policy (``ppo_clip_loss``). The per-token ℓ and
    diagnostics, unreduced, are :func:`decoupled_ppo_per_token`.

    Args:
      logp: ``[B, T]`` current log-probs.
      prox_logp: ``[B, T]`` proximal log-probs (gradient is stopped here regardless).
      behav_logp: ``[B, T]`` behaviour log-probs.
      advantages: ``[B, T]`` per-token advantages (broadcast sequence advantages yourself).
      mask: ``[B, T]`` 1 for tokens that count.
      clip_eps: ε_low > 0.
      clip_eps_high: ε_high > 0 (DAPO's clip-higher); defaults to ``clip_eps``.
      dual_clip: c > 1 for dual clipping of negative advantages, or None.
      behav_weight_cap: cap > 0 on w_t, or None.
      cap_mode: ``"mask"`` or ``"truncate"``.
      aggregation: one of ``AGGREGATIONS``.
      denominator: global count for micro-batching (see ``aggregate``).
      max_len: Dr.GRPO normaliser for ``seq_mean_token_sum_norm``.
      staleness: optional ``[B, T]`` d_t, only for the ``staleness/*`` diagnostics.
      seq_correction: sequence-level TIS / MIS instead of the token cap (see
        :func:`decoupled_ppo_per_token`).

    Returns:
      ``(loss, metrics)``: scalar loss and a dict of scalar diagnostics: ``loss/clipfrac``,
      ``loss/dual_clipfrac``, ``is/weight_mean|max|min``, ``is/capped_frac``,
      ``kl/behav_k3`` (approx KL(π_behav‖π_θ) with k3), ``loss/num_tokens`` and, with
      staleness, ``staleness/mean|max``.
    """
    _check_same_shape("logp", logp, staleness=staleness)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    per_token, diag = decoupled_ppo_per_token(
        logp,
        prox_logp,
        behav_logp,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        behav_weight_cap=behav_weight_cap,
        cap_mode=cap_mode,
        seq_correction=seq_correction,
    )
    loss = aggregate(per_token, mask, mode=aggregation, denominator=denominator, max_len=max_len)

    valid = mask.astype(bool)
    fvalid = valid.astype(jnp.float32)
    metrics = {
        "loss/clipfrac": _masked_mean(diag["clipped"], fvalid),
        "loss/dual_clipfrac": _masked_mean(diag["dual_clipped"], fvalid),
        "loss/num_tokens": jnp.sum(fvalid),
        "is/weight_mean": _masked_mean(diag["is_weight"], fvalid),
        "is/weight_max": _masked_max(diag["is_weight"], valid),
        "is/weight_min": _masked_min(diag["is_weight"], valid),
        "is/capped_frac": _masked_mean(diag["capped"], fvalid),
        "kl/behav_k3": _masked_mean(diag["kl_behav_k3"], fvalid),
    }
    if staleness is not None:
        d = staleness.astype(jnp.float32)
        metrics["staleness/mean"] = _masked_mean(d, fvalid)
        metrics["staleness/max"] = _masked_max(d, valid)
    return loss, metrics


def ppo_clip_loss(
    logp: jax.Array,
    behav_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    **kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Standard PPO clip loss against the behaviour policy (naive async PPO, sync GRPO).

    ℓ_t = max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high)),  r_t = exp(logp_t - behav_t)

    The special case prox = behav of ``decoupled_ppo_loss`` (w_t = 1); Schulman et al.,
    arXiv 1707.06347. Keyword arguments are those of ``decoupled_ppo_loss``.

    Args:
      logp, behav_logp, advantages, mask: ``[B, T]``.

    Returns:
      ``(loss, metrics)`` as ``decoupled_ppo_loss``.
    """
    return decoupled_ppo_loss(logp, behav_logp, behav_logp, advantages, mask, **kwargs)


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
    _check_choice("kl kind", kind, KL_KINDS)
    _check_same_shape("logp", logp, ref_logp=ref_logp)
    return KL_ESTIMATORS[kind](ref_logp.astype(jnp.float32) - logp.astype(jnp.float32))


# --------------------------------------------------------------------------------------
# Online DPO.
# --------------------------------------------------------------------------------------


def online_dpo_per_pair(
    chosen_logp: jax.Array,
    rejected_logp: jax.Array,
    chosen_ref_logp: jax.Array,
    rejected_ref_logp: jax.Array,
    *,
    beta: float,
    kind: str = "sigmoid",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair Online DPO loss ℓ_i and per-pair diagnostics, nothing reduced.

    The formula, symbols and papers are those of :func:`online_dpo_loss`, which is the
    masked mean of this function's ℓ.

    Args:
      chosen_logp, rejected_logp: ``[P]`` current sequence log-probs.
      chosen_ref_logp, rejected_ref_logp: ``[P]`` reference sequence log-probs.
      beta: β > 0.
      kind: ``"sigmoid"`` or ``"ipo"``.

    Returns:
      ``(per_pair, diagnostics)``: ``[P]`` float32 ℓ and ``[P]`` float32 ``"margin"`` (β·h),
      ``"accuracy"`` (1 where h > 0), ``"chosen_reward"``, ``"rejected_reward"``
      (β·(logp - ref)).
    """
    _check_rank("chosen_logp", chosen_logp, 1, "[P] sequence log-probs")
    _check_same_shape(
        "chosen_logp",
        chosen_logp,
        rejected_logp=rejected_logp,
        chosen_ref_logp=chosen_ref_logp,
        rejected_ref_logp=rejected_ref_logp,
    )
    _check_positive("beta", beta)
    _check_choice("dpo kind", kind, DPO_KINDS)
    f32 = jnp.float32
    chosen_ratio = chosen_logp.astype(f32) - jax.lax.stop_gradient(chosen_ref_logp.astype(f32))
    rejected_ratio = rejected_logp.astype(f32) - jax.lax.stop_gradient(
        rejected_ref_logp.astype(f32)
    )
    h = chosen_ratio - rejected_ratio  # [P]
    per_pair = _DPO_LOSSES[kind](h, beta)
    h_sg = jax.lax.stop_gradient(h)
    diagnostics = {
        "margin": beta * h_sg,
        "accuracy": (h_sg > 0).astype(f32),
        "chosen_reward": beta * jax.lax.stop_gradient(chosen_ratio),
        "rejected_reward": beta * jax.lax.stop_gradient(rejected_ratio),
    }
    return per_pair, diagnostics


def online_dpo_loss(
    chosen_logp: jax.Array,
    rejected_logp: jax.Array,
    chosen_ref_logp: jax.Array,
    rejected_ref_logp: jax.Array,
    *,
    beta: float,
    kind: str = "sigmoid",
    mask: jax.Array | None = None,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Online DPO on pairs of on-line samples ranked by a reward.

    h = (logp⁺ - ref⁺) - (logp⁻ - ref⁻)
    sigmoid:  ℓ = -log σ(β h)                 (Rafailov et al., arXiv 2305.18290)
    ipo:      ℓ = (h - 1 / (2β))²             (Azar et al., arXiv 2310.12036)

    Asynchronous RLHF (Noukhovitch et al., arXiv 2410.18252) finds it the loss most robust
    to off-policy samples. Log-probs are *sequence* log-probs (sum over completion tokens,
    see ``sequence_logprobs``); ⁺ is the higher-reward sample of the pair.

    Args:
      chosen_logp, rejected_logp: ``[B]`` current sequence log-probs.
      chosen_ref_logp, rejected_ref_logp: ``[B]`` reference sequence log-probs.
      beta: β > 0.
      kind: ``"sigmoid"`` or ``"ipo"``.
      mask: optional ``[B]`` 1 for pairs that count (e.g. 0 where both samples got the same
        reward, so there is no preference to learn).
      denominator: global number of counted pairs for micro-batching; defaults to the
        local count.

    Returns:
      ``(loss, metrics)`` with ``dpo/margin_mean`` (mean β·h), ``dpo/accuracy`` (fraction
      with h > 0), ``dpo/chosen_reward`` and ``dpo/rejected_reward`` (β·(logp - ref)).
    """
    _check_same_shape("chosen_logp", chosen_logp, mask=mask)
    per_pair, diag = online_dpo_per_pair(
        chosen_logp, rejected_logp, chosen_ref_logp, rejected_ref_logp, beta=beta, kind=kind
    )
    pair_mask = jnp.ones_like(per_pair) if mask is None else mask.astype(jnp.float32)
    denom = jnp.sum(pair_mask) + _TINY if denominator is None else denominator
    loss = jnp.sum(per_pair * pair_mask) / denom
    metrics = {
        "dpo/margin_mean": _masked_mean(diag["margin"], pair_mask),
        "dpo/accuracy": _masked_mean(diag["accuracy"], pair_mask),
        "dpo/chosen_reward": _masked_mean(diag["chosen_reward"], pair_mask),
        "dpo/rejected_reward": _masked_mean(diag["rejected_reward"], pair_mask),
        "dpo/num_pairs": jnp.sum(pair_mask),
    }
    return loss, metrics
