"""The jitted training step: logits → logp → prox → loss → grads → optax update.

Core layer: pure functions of arrays and params pytrees; imports only ``a3po_jax.core``,
``a3po_jax.model`` and ``a3po_jax.parallel``. The algorithm is chosen once, when the step is
built (:func:`build_algorithm`), from three tables: the prox rule
(:data:`a3po_jax.core.prox.PROX_RULES`), the loss term (:data:`LOSS_TERMS`) and the
advantage estimator (:data:`a3po_jax.core.advantages.ESTIMATORS`). The result, an
:class:`Algorithm`, holds functions, not names: nothing inside the differentiated function
compares strings.

Reduction happens once, at the top (design §3). Every loss term returns a
``(loss_sum, count)`` pair and its metrics as :class:`Stats` (sums with their counts,
totals, maxima, minima); all of them add (or max/min) across micro-batches, minibatches and
arriving groups, and :func:`finalize` divides once.

* :func:`accumulate_grads`: gradients of :func:`loss_sums` scanned over micro-batches.
* :func:`apply_grads`: divide by the accumulated count, clip, AdamW, skip the update if
  anything is non-finite, bump the version.
* :func:`train_step`: the whole step for a batch that is all at hand (``sync``,
  ``one_step_off``, ``async``): the old-policy pass when the prox rule needs one, the
  reference pass when the loss does, then ``num_minibatches`` optimizer steps; metrics
  cover every minibatch.
* :func:`fold_group` / :func:`add_accumulated` / :func:`apply_accumulated`: ``periodic``
  mode, one arriving group at a time, one optimizer step per iteration.
* :func:`kl_in_reward`: the reference KL charged to the rewards, advantages recomputed.

Shape letters: M micro-batches, B sequences (per micro-batch b), T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from a3po_jax import model
from a3po_jax.core import advantages, importance, logprobs, losses, packing, prox

Params = Any
Batch = dict[str, jax.Array]

# The loss's denominator is at least this, so a batch with nothing to learn from (every DPO
# pair tied, every token masked) reports loss 0 rather than 0/0.
_TINY = 1e-8


class TrainState(NamedTuple):
    """Everything the step changes, as one pytree."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer steps applied = the policy version


# --------------------------------------------------------------------------------------
# Settings (plain values) and the algorithm built from them (functions).
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The plain values a step is built from.

    Field names are those of the run configuration's sections (``algo``, ``system``,
    ``rollout``), so ``a3po_jax.training.step_builder`` fills them by name: the core never
    sees the config and a renamed field fails loudly there, not silently here.
    """

    loss: str = "ppo"  # a key of LOSS_TERMS
    prox: str = "a3po"  # a key of prox.PROX_RULES
    a3po_zero_staleness: str = "current"  # A-3PO at d = 0: "current" (paper) or "behav"
    advantage: str = "grpo"  # a key of advantages.ESTIMATORS (used by KL-in-reward)
    aggregation: str = "token_mean"  # one of losses.AGGREGATIONS
    clip_eps: float = 0.2  # ε_low
    clip_eps_high: float = 0.0  # ε_high; 0 means = clip_eps
    dual_clip: float = 0.0  # c > 1 enables dual clipping; 0 = off
    behav_weight_cap: float = 0.0  # cap on w = π_prox/π_behav; 0 = off
    cap_mode: str = "mask"  # one of losses.CAP_MODES
    seq_weight_cap: float = 0.0  # C > 1 on the sequence weight (seq-TIS/MIS); 0 = off
    seq_cap_mode: str = "truncate"  # one of importance.SEQ_CAP_MODES
    seq_weight_form: str = "product"  # one of importance.SEQ_FORMS
    kl_coef: float = 0.0  # reference KL coefficient β; 0 = no reference
    kl_kind: str = "k3"  # one of losses.KL_KINDS
    kl_in_reward: bool = False  # charge β·KL to the rewards instead of the loss
    track_ref_kl: bool = False  # log kl/ref_k3 (KL to the initial policy), loss unchanged
    dpo_beta: float = 0.1  # Online DPO β
    dpo_kind: str = "sigmoid"  # one of losses.DPO_KINDS
    num_minibatches: int = 1  # optimizer steps per batch (each is one version)
    temperature: float = 1.0  # sampling temperature; the loss uses logits / temperature
    micro_batch_size: int = 0  # sequences per micro-batch; 0 = whole minibatch
    packed_prompts: bool = False  # batches come from packing.pack_groups (one row per group)
    one_pass_old: bool = False  # prox="recompute": old = sg(current), no extra pass


LogprobFn = Callable[..., tuple[jax.Array, jax.Array]]  # (params, batch, *, model_config)
Aggregator = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
TermFn = Callable[..., tuple[jax.Array, jax.Array, "Stats"]]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """The step's algorithm, resolved from :class:`StepSettings` by :func:`build_algorithm`:
    functions with their hyperparameters bound, and the flags derived from them once."""

    forward: LogprobFn  # (params, batch, *, model_config) -> (logp [B, T], entropy [B, T])
    loss_term: TermFn  # (logp, mb, *, staleness, old_logp, ref_logp) -> (sum, count, Stats)
    kl_in_loss: Callable[[jax.Array, jax.Array], jax.Array] | None  # (logp, ref) -> KL [B, T]
    kl_coef: float  # β of the KL term in the loss (with kl_in_loss)
    kl_metric: Callable[[jax.Array, jax.Array], jax.Array] | None  # k3 KL to ref, metric only
    kl_in_reward: Callable[..., tuple[jax.Array, jax.Array]] | None
    aggregate: Aggregator  # (values [B, T], mask [B, T]) -> (numerator, count)
    needs_old_pass: bool  # a no-grad pass of the step's starting weights (prox "recompute")
    needs_reference: bool  # the step reads the frozen reference's log-probs
    keeps_reference: bool  # the run keeps a reference (the step's, or KL-in-reward's)
    num_minibatches: int
    micro_batch_size: int
    packed: bool


class LossTerm(NamedTuple):
    """A loss family: how to bind its hyperparameters, and what inputs it reads."""

    make: Callable[[StepSettings, prox.ProxRule | None], TermFn]
    uses_prox: bool  # reads a prox rule (and maybe the old pass)
    needs_reference: bool  # reads reference log-probs


def _check_choice(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


# --------------------------------------------------------------------------------------
# Metrics that combine exactly across micro-batches.
# --------------------------------------------------------------------------------------


class Stats(NamedTuple):
    """Metrics in a form that adds across micro-batches, minibatches and arriving groups.

    ``means`` hold ``(Σ value, count)`` and report Σ / count; ``totals`` are sums reported
    as is; ``maxima`` / ``minima`` combine by max / min; ``histograms`` are ``[K]`` counts of
    log importance weights (:func:`a3po_jax.core.importance.log_weight_histogram`) that add
    and report their quantiles as ``<name>_p01|p50|p99``. A metric's kind is its place here,
    never its name.
    """

    means: dict[str, tuple[jax.Array, jax.Array]] = {}
    totals: dict[str, jax.Array] = {}
    maxima: dict[str, jax.Array] = {}
    minima: dict[str, jax.Array] = {}
    histograms: dict[str, jax.Array] = {}


# Identities of max / min for "no valid token in this micro-batch"; finalize reports 0.
_NO_MAX = float(jnp.finfo(jnp.float32).min)
_NO_MIN = float(jnp.finfo(jnp.float32).max)


def masked_pair(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(Σ m·x, Σ m)`` in float32, the parts of a masked mean."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * m), jnp.sum(m)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(mask > 0, x.astype(jnp.float32), _NO_MAX))


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.min(jnp.where(mask > 0, x.astype(jnp.float32), _NO_MIN))


def combine(a: Stats, b: Stats) -> Stats:
    """Merge two :class:`Stats`: pairs and totals add, maxima max, minima min; a metric in
    only one of them is kept as is."""

    def merge(x, y, op):
        return {k: op(x[k], y[k]) if k in x and k in y else x.get(k, y.get(k)) for k in {**x, **y}}

    def add(u, v):
        return jax.tree.map(jnp.add, u, v)

    return Stats(
        means=merge(a.means, b.means, add),
        totals=merge(a.totals, b.totals, add),
        maxima=merge(a.maxima, b.maxima, jnp.maximum),
        minima=merge(a.minima, b.minima, jnp.minimum),
        histograms=merge(a.histograms, b.histograms, jnp.add),
    )


def finalize(stats: Stats) -> dict[str, jax.Array]:
    """Scalars to report: Σ / count for means (0 when the count is 0), totals, maxima and
    minima (0 when no token was valid anywhere)."""
    out = {k: s / jnp.maximum(n, _TINY) for k, (s, n) in stats.means.items()}
    out.update(stats.totals)
    out.update({k: jnp.where(v == _NO_MAX, 0.0, v) for k, v in stats.maxima.items()})
    out.update({k: jnp.where(v == _NO_MIN, 0.0, v) for k, v in stats.minima.items()})
    names, qs = tuple(importance.QUANTILES), tuple(importance.QUANTILES.values())
    for key, counts in stats.histograms.items():
        values = importance.histogram_quantiles(counts, qs)
        out.update({f"{key}_{name}": values[i] for i, name in enumerate(names)})
    return out


# --------------------------------------------------------------------------------------
# Loss terms: (loss_sum, count, Stats) of one micro-batch.
# --------------------------------------------------------------------------------------


def ppo_term(
    logp: jax.Array,
    mb: Batch,
    *,
    staleness: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    prox_fn: prox.ProxFn,
    aggregate: Aggregator,
    **clip: Any,
) -> tuple[jax.Array, jax.Array, Stats]:
    """Decoupled PPO on one micro-batch: prox from ``prox_fn``, then
    :func:`losses.decoupled_ppo_per_token` reduced by ``aggregate`` into a sum/count pair.

    ``clip`` holds ``clip_eps``, ``clip_eps_high``, ``dual_clip``, ``behav_weight_cap``,
    ``cap_mode`` and ``seq_correction`` (bound at build time). The ``mismatch/*`` metrics
    are :func:`mismatch_stats`.
    """
    del ref_logp
    mask = mb["loss_mask"]
    behav = mb["behav_logp"]
    prox_logp = prox_fn(logp, behav, staleness, old_logp)
    per_token, diag = losses.decoupled_ppo_per_token(
        logp, prox_logp, behav, mb["advantages"], mask, **clip
    )
    loss_sum, count = aggregate(per_token, mask)
    d = staleness.astype(jnp.float32)
    stats = Stats(
        means={
            "loss/clipfrac": masked_pair(diag["clipped"], mask),
            "loss/dual_clipfrac": masked_pair(diag["dual_clipped"], mask),
            "is/weight_mean": masked_pair(diag["is_weight"], mask),
            "is/capped_frac": masked_pair(diag["capped"], mask),
            "kl/behav_k3": masked_pair(diag["kl_behav_k3"], mask),
            "staleness/mean": masked_pair(d, mask),
        },
        maxima={
            "is/weight_max": masked_max(diag["is_weight"], mask),
            "staleness/max": masked_max(d, mask),
        },
        minima={"is/weight_min": masked_min(diag["is_weight"], mask)},
    )
    return loss_sum, count, combine(stats, mismatch_stats(logp, behav, staleness, mask, diag))


def mismatch_stats(
    logp: jax.Array,
    behav_logp: jax.Array,
    staleness: jax.Array,
    mask: jax.Array,
    diag: dict[str, jax.Array],
) -> Stats:
    """The train-inference mismatch of one micro-batch, as :class:`Stats` that add.

    mismatch/k3_kl_fresh       k3 estimate of KL(π_behav ‖ π_θ), x = behav - logp,
                               k3 = e^x - 1 - x, over valid tokens with staleness d = 0
                               only: there π_behav and π_θ are the same weights, so what
                               remains is the mismatch of the two programs
    mismatch/fresh_tokens      the count of those tokens (a total)
    mismatch/iw_p01|p50|p99    quantiles of the token weight w_t = π_prox/π_behav before
                               any cap, over every valid token of the step (a histogram,
                               see :mod:`a3po_jax.core.importance`); iw_min / iw_max exact
    mismatch/masked_frac       valid tokens dropped from the loss by the token or the
                               sequence cap; truncated_frac: weight lowered to the cap
    mismatch/seq_masked_frac   sequences (with ≥ 1 valid token) dropped / truncated by
    mismatch/seq_truncated_frac  the sequence cap (0 with the token-level cap)
    mismatch/seq_log_iw_min|max  log W_b = Σ_t log w_t of the sequences (log: a product
                               over a long response overflows float32)

    Args:
      logp, behav_logp: ``[b, T]`` current and behaviour log-probs.
      staleness: ``[b, T]`` d_t.
      mask: ``[b, T]`` loss mask.
      diag: :func:`losses.decoupled_ppo_per_token`'s diagnostics.
    """
    valid = mask > 0
    fresh = valid & (staleness == 0)
    x = jnp.where(fresh, behav_logp.astype(jnp.float32) - logp.astype(jnp.float32), 0.0)
    k3 = jax.lax.stop_gradient(jnp.expm1(x) - x)
    log_w = diag["log_is_weight"]
    w = jnp.exp(log_w)
    rows = jnp.any(valid, axis=-1)  # [b] sequences with a valid token
    if "seq_log_weight" in diag:  # the sequence-level correction is on
        log_seq, seq_masked, seq_truncated = (
            diag["seq_log_weight"],
            diag["seq_masked"],
            diag["seq_truncated"],
        )
    else:
        log_seq = jnp.sum(jnp.where(valid, log_w, 0.0), axis=-1)
        seq_masked = seq_truncated = jnp.zeros_like(log_seq)
    return Stats(
        means={
            "mismatch/k3_kl_fresh": masked_pair(k3, fresh),
            "mismatch/masked_frac": masked_pair(diag["masked"], mask),
            "mismatch/truncated_frac": masked_pair(diag["truncated"], mask),
            "mismatch/seq_masked_frac": masked_pair(seq_masked, rows),
            "mismatch/seq_truncated_frac": masked_pair(seq_truncated, rows),
        },
        totals={"mismatch/fresh_tokens": jnp.sum(fresh.astype(jnp.float32))},
        maxima={
            "mismatch/iw_max": masked_max(w, mask),
            "mismatch/seq_log_iw_max": masked_max(log_seq, rows),
        },
        minima={
            "mismatch/iw_min": masked_min(w, mask),
            "mismatch/seq_log_iw_min": masked_min(log_seq, rows),
        },
        histograms={"mismatch/iw": importance.log_weight_histogram(log_w, mask)},
    )


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
    (``batching.build_batch(dpo_pairs=True)``); the count is the pairs with a preference."""
    del staleness, old_logp
    mask = mb["loss_mask"]
    seq = losses.sequence_logprobs(logp, mask)  # [b]
    ref_seq = losses.sequence_logprobs(ref_logp, mask)  # [b]
    per_pair, diag = losses.online_dpo_per_pair(
        seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], beta=beta, kind=kind
    )
    pairs = mb["pair_mask"][0::2].astype(jnp.float32)  # [b / 2]
    loss_sum, count = masked_pair(per_pair, pairs)
    stats = Stats(
        means={
            "dpo/margin_mean": masked_pair(diag["margin"], pairs),
            "dpo/accuracy": masked_pair(diag["accuracy"], pairs),
            "dpo/chosen_reward": masked_pair(diag["chosen_reward"], pairs),
            "dpo/rejected_reward": masked_pair(diag["rejected_reward"], pairs),
        },
        totals={"dpo/num_pairs": count},
    )
    return loss_sum, count, stats


def _make_ppo(s: StepSettings, rule: prox.ProxRule | None) -> TermFn:
    _check_choice("cap_mode", s.cap_mode, losses.CAP_MODES)
    _check_choice("seq_cap_mode", s.seq_cap_mode, importance.SEQ_CAP_MODES)
    _check_choice("seq_weight_form", s.seq_weight_form, importance.SEQ_FORMS)
    seq_correction = None
    if s.seq_weight_cap > 0:
        if s.behav_weight_cap > 0:
            raise ValueError(
                "behav_weight_cap (token-level cap) and seq_weight_cap (sequence-level cap) "
                "are alternatives: set one of them to 0"
            )
        seq_correction = importance.make_sequence_correction(
            s.seq_weight_cap, mode=s.seq_cap_mode, form=s.seq_weight_form
        )
    return functools.partial(
        ppo_term,
        prox_fn=rule.fn,
        aggregate=aggregator(s.aggregation),
        clip_eps=s.clip_eps,
        clip_eps_high=s.clip_eps_high or None,
        dual_clip=s.dual_clip or None,
        behav_weight_cap=s.behav_weight_cap or None,
        cap_mode=s.cap_mode,
        seq_correction=seq_correction,
    )


def _make_dpo(s: StepSettings, rule: prox.ProxRule | None) -> TermFn:
    del rule
    _check_choice("dpo_kind", s.dpo_kind, losses.DPO_KINDS)
    return functools.partial(dpo_term, beta=s.dpo_beta, kind=s.dpo_kind)


LOSS_TERMS: Mapping[str, LossTerm] = {
    "ppo": LossTerm(_make_ppo, uses_prox=True, needs_reference=False),
    "dpo": LossTerm(_make_dpo, uses_prox=False, needs_reference=True),
}


def build_algorithm(settings: StepSettings) -> Algorithm:
    """Resolve every name in ``settings`` against its table, once, before anything is traced.

    Raises:
      ValueError: for an unknown loss, prox rule, advantage, aggregation, KL kind, cap mode
        or DPO kind, naming the value and the allowed ones.
    """
    s = settings
    _check_choice("loss", s.loss, LOSS_TERMS)
    _check_choice("aggregation", s.aggregation, losses.AGGREGATIONS)
    _check_choice("kl_kind", s.kl_kind, losses.KL_KINDS)
    estimate = advantages.estimator(s.advantage)
    term = LOSS_TERMS[s.loss]
    rule = None
    if term.uses_prox:
        rule = prox.make_prox_rule(
            s.prox, zero_staleness=s.a3po_zero_staleness, one_pass_old=s.one_pass_old
        )
    kl_in_loss = kl_in_reward = None
    if s.kl_coef > 0 and s.kl_in_reward:
        kl_in_reward = functools.partial(
            advantages.kl_in_reward_advantages,
            estimate=estimate,
            kl_coef=s.kl_coef,
            kl_kind=s.kl_kind,
        )
    elif s.kl_coef > 0:
        kl_in_loss = functools.partial(_kl_estimate, estimate=losses.KL_ESTIMATORS[s.kl_kind])
    forward = packing.packed_token_logprobs if s.packed_prompts else forward_logprobs
    # KL to the initial policy as a metric only (the paper's reward-vs-KL frontier): the
    # reference pass runs, nothing is added to the loss.
    kl_metric = (
        functools.partial(_kl_estimate, estimate=losses.KL_ESTIMATORS["k3"])
        if s.track_ref_kl
        else None
    )
    needs_reference = term.needs_reference or kl_in_loss is not None or kl_metric is not None
    return Algorithm(
        forward=functools.partial(forward, temperature=s.temperature),
        loss_term=term.make(s, rule),
        kl_in_loss=kl_in_loss,
        kl_coef=s.kl_coef,
        kl_metric=kl_metric,
        kl_in_reward=kl_in_reward,
        aggregate=aggregator(s.aggregation),
        needs_old_pass=rule is not None and rule.needs_old_pass,
        needs_reference=needs_reference,
        keeps_reference=needs_reference or kl_in_reward is not None,
        num_minibatches=s.num_minibatches,
        micro_batch_size=s.micro_batch_size,
        packed=s.packed_prompts,
    )


def aggregator(mode: str) -> Aggregator:
    """``losses.aggregate_sum`` with its mode resolved now, from ``losses.AGGREGATORS``."""
    _check_choice("aggregation", mode, losses.AGGREGATORS)
    reduce = losses.AGGREGATORS[mode]

    def aggregate(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        mask = mask.astype(jnp.float32)
        return reduce(values.astype(jnp.float32) * mask, mask, None)

    return aggregate


def _kl_estimate(logp: jax.Array, ref_logp: jax.Array, *, estimate) -> jax.Array:
    """``losses.kl_penalty`` with its kind resolved at build time (x = ref - logp)."""
    return estimate(ref_logp.astype(jnp.float32) - logp.astype(jnp.float32))


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


# --------------------------------------------------------------------------------------
# Forward pieces.
# --------------------------------------------------------------------------------------


def batch_hidden(params: Params, batch: Batch, *, model_config: model.ModelConfig) -> jax.Array:
    """[B, T, D] float32 final-norm hidden states of a ``TrainBatch.arrays()`` batch (no
    lm_head; ``packing.packed_hidden`` is the packed layout's)."""
    hidden, _ = model.hidden_states(
        params,
        batch["tokens"],
        batch["positions"],
        config=model_config,
        segment_ids=batch["segment_ids"],
    )
    return hidden


def forward_logprobs(
    params: Params, batch: Batch, *, model_config: model.ModelConfig, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Token log-probs of the targets under ``softmax(logits / temperature)`` and entropies.

    The behaviour log-probs from the inference host are taken at the sampling temperature,
    so the trainer's must be too, or the importance ratio is off by the temperature.

    The head runs chunk by chunk over tokens (:func:`logprobs.chunked_token_logprobs`,
    which recomputes each chunk's logits in the backward pass), so neither pass holds the
    [B, T, V] logits; the values equal ``token_logprobs(apply(...) / temperature)``.

    Returns:
      (logp [B, T], entropy [B, T]) float32.
    """
    hidden = batch_hidden(params, batch, model_config=model_config)  # [B, T, D] float32
    head, is_table = model.lm_head_for_logprobs(params, model_config)  # [V, D] tied, [D, V]
    return logprobs.chunked_token_logprobs(
        hidden, head, batch["targets"], temperature=temperature, head_is_table=is_table
    )


def _no_grad_logprobs(params, micro_batches, *, algo, model_config):
    """[M, b, T] log-probs of every micro-batch, no gradient (old-policy / reference pass)."""

    def one(mb):
        logp, _ = algo.forward(params, mb, model_config=model_config)
        return jax.lax.stop_gradient(logp)

    return jax.lax.map(one, micro_batches)


def auxiliary_logprobs(
    params: Params,
    ref_params: Params | None,
    micro_batches: Batch,
    *,
    algo: Algorithm,
    model_config: model.ModelConfig,
) -> tuple[jax.Array | None, jax.Array | None]:
    """The no-grad passes the algorithm needs, ``[M, b, T]`` each or None: the old policy
    (``params`` = the step's starting weights) and the frozen reference."""
    old = ref = None
    if algo.needs_old_pass:
        old = _no_grad_logprobs(params, micro_batches, algo=algo, model_config=model_config)
    if algo.needs_reference:
        ref = _no_grad_logprobs(ref_params, micro_batches, algo=algo, model_config=model_config)
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
    model_config: model.ModelConfig,
) -> tuple[jax.Array, tuple[jax.Array, Stats]]:
    """Loss *sum* of one micro-batch, its count, and its metric :class:`Stats`.

    Args:
      params: current policy parameters (differentiated).
      mb: micro-batch arrays ``[b, T]`` from :class:`a3po_jax.core.batching.TrainBatch`.
      version: int32 scalar trainer version v_θ for this optimizer step.
      old_logp: ``[b, T]`` old-policy log-probs when ``algo.needs_old_pass``, else None.
      ref_logp: ``[b, T]`` reference log-probs when ``algo.needs_reference``, else None.

    Returns:
      (loss_sum, (count, stats)): the loss is ``Σ loss_sum / Σ count`` over micro-batches.
    """
    logp, ent = algo.forward(params, mb, model_config=model_config)
    mask = mb["loss_mask"]
    # Staleness d = v_θ - v_behav per token; masked positions get 0 (their versions are 0
    # by construction and carry no meaning).
    staleness = jnp.where(mask > 0, version - mb["versions"], 0).astype(jnp.int32)
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
# Gradients and updates.
# --------------------------------------------------------------------------------------


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
    version: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    algo: Algorithm,
    model_config: model.ModelConfig,
) -> Accumulated:
    """Sum of loss-sum gradients over ``[M, b, T]`` micro-batches (a ``lax.scan``)."""
    grad_fn = jax.value_and_grad(
        functools.partial(loss_sums, algo=algo, model_config=model_config), has_aux=True
    )

    def one(mb, old, ref):
        (loss, (count, stats)), grads = grad_fn(
            params, mb, version=version, old_logp=old, ref_logp=ref
        )
        return Accumulated(grads, jax.lax.stop_gradient(loss), count, stats)

    def body(acc, xs):
        return add_accumulated(acc, one(*xs)), None

    # The first micro-batch seeds the carry so the scan carry has a fixed structure.
    xs = (micro_batches, old_logp, ref_logp)
    first = one(*jax.tree.map(lambda x: x[0], xs))
    acc, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], xs))
    return acc


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
    holds them all at once (0.64 GiB of temporaries and 0.37 s against 0.13 s without the
    norm, SmolLM2-135M float32 on the 2-core EPYC; design §6). Here each leaf's gradient
    carries a zero-valued dependency on the previous leaf's applied update and norm
    (``g + 0 * dep``: XLA keeps it, as ``x * 0`` is not 0 for a NaN or an infinity, and it
    drops optimization barriers before scheduling), so one leaf's update is alive at a time
    (0.21 GiB, 0.25 s). A compiler that folded it would give the same values with the old
    memory.

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
    denominator = jnp.maximum(acc.count, _TINY)
    # Norms as dot products (every axis contracted): XLA's CPU reductions run far below
    # memory speed, its dots do not (README, "optimizer update", for the figures).
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
            # On a CPU only: XLA:GPU fuses the whole-tree update and its norm well, and the
            # leaf-by-leaf chain made it slower and larger there (H200, Qwen2.5-1.5B shapes,
            # float32: 15.6 -> 18.6 ms, temporaries 1.44 -> 5.75 GiB; design §6).
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
        # (gloo across processes: "collective mismatch"); tests/test_trainer_multiprocess.py
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


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Params | None,
    *,
    algo: Algorithm,
    model_config: model.ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One training step on a batch that is all at hand.

    1. the old-policy pass over the whole batch with the step's starting weights, when the
       prox rule needs one (decoupled PPO's extra pass; A-3PO exists to remove it);
    2. reference log-probs with the frozen ``ref_params`` if the loss needs them;
    3. ``num_minibatches`` optimizer steps; minibatch k trains at version v₀ + k, so its
       staleness is v₀ + k − v_behav.

    Args:
      state: the current :class:`TrainState` (donate it under jit).
      batch: ``[B, T]`` arrays of a :class:`a3po_jax.core.batching.TrainBatch` (or
        ``PackedBatch.arrays()`` when ``algo.packed``).
      ref_params: frozen reference params, or None.

    Returns:
      (new_state, metrics): metrics over every minibatch (means weighted by their counts,
      ``optim/*`` averaged over the minibatches, maxima / minima over all of them;
      ``step/skipped`` is 1 if any minibatch was skipped).
    """
    k = algo.num_minibatches
    rows = batch["loss_mask"].shape[0]
    per_minibatch = rows // k
    mb_size = algo.micro_batch_size or per_minibatch
    n_micro = per_minibatch // mb_size
    minibatches = split_micro_batches(batch, k * n_micro)  # [k*M, b, T]
    old_all, ref_all = auxiliary_logprobs(
        state.params, ref_params, minibatches, algo=algo, model_config=model_config
    )

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
            model_config=model_config,
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
    model_config: model.ModelConfig,
) -> Accumulated:
    """One arriving group's contribution at the iteration's weights ``params``.

    The old-policy pass (when the prox rule needs one) runs over ``params``: nothing has
    been applied since the iteration began, so they are the step's starting weights, and
    folding every group then one :func:`apply_accumulated` equals :func:`train_step` on
    the whole batch up to summation order.
    """
    old, ref = auxiliary_logprobs(
        params, ref_params, micro_batches, algo=algo, model_config=model_config
    )
    return accumulate_grads(
        params,
        micro_batches,
        version=version,
        old_logp=old,
        ref_logp=ref,
        algo=algo,
        model_config=model_config,
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
    model_config: model.ModelConfig,
    group_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Rewards minus β·Σ_t KL_t under the current and reference policies, and the group
    advantages recomputed from them (``algo.kl_in_reward`` must be set).

    Args:
      batch: the step's arrays (``[B, T]``; packed arrays when ``algo.packed``).
      rewards: ``[B]`` sequence rewards in the batch's row order.
      group_size: G; groups are contiguous rows.

    Returns:
      (rewards [B], advantages [B, T]).
    """
    logp, _ = algo.forward(params, batch, model_config=model_config)
    ref, _ = algo.forward(ref_params, batch, model_config=model_config)
    return algo.kl_in_reward(rewards, logp, ref, batch["loss_mask"], group_size=group_size)


# --------------------------------------------------------------------------------------
# Placement on a mesh and the jit boundary.
# --------------------------------------------------------------------------------------


def batch_shardings(mesh: jax.sharding.Mesh, batch_size: int) -> jax.sharding.NamedSharding:
    """Sharding of every train-step batch array: the leading axis (rows, or groups when
    packed) over ("data", "fsdp"), the rest replicated. One spec fits every rank, since a
    PartitionSpec shorter than the array's rank replicates the trailing axes.

    Raises a ValueError naming both numbers when the mesh does not divide ``batch_size``.
    """
    from a3po_jax.parallel import sharding

    sharding.check_batch_divisible(batch_size, mesh, sharding.TRAIN_RULES)
    rows = sharding.batch_sharding(mesh, sharding.TRAIN_RULES).spec[0]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rows))


def place_train_state(
    params: Params, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh
) -> TrainState:
    """A copy of the params laid out by ``sharding.TRAIN_RULES`` (FSDP + tensor parallel) and
    an optimizer state initialised under jit, so Adam's moments inherit the params' shardings."""
    from a3po_jax.parallel import sharding

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
    batch_size: int,
    *,
    algo: Algorithm,
    model_config: model.ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
    with_reference: bool,
):
    """``train_step`` jitted at the boundary with explicit shardings; the state is donated.

    Args:
      state: a placed state (from :func:`place_train_state`); its shardings are reused for
        the output so the step never moves parameters.
      batch_size: rows per batch (checked against the mesh).
      with_reference: whether a reference params tree (same layout as params) is passed.

    Returns:
      ``fn(state, batch, ref_params) -> (state, metrics)``.
    """
    from a3po_jax.parallel import sharding

    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    ref_shardings = state_shardings.params if with_reference else None
    fn = functools.partial(
        train_step,
        algo=algo,
        model_config=model_config,
        optimizer=optimizer,
        grad_clip=grad_clip,
    )
    return jax.jit(
        fn,
        in_shardings=(state_shardings, batch_shardings(mesh, batch_size), ref_shardings),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
    )
