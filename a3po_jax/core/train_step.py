"""The jitted training step: logits → logp → prox → loss → grads → optax update.

Pure functions of arrays and params pytrees. The pieces:

* :func:`loss_sums` — one micro-batch's loss *sum* (denominator 1) and metric sums. Sums add
  across micro-batches and across arrival order, so the caller divides once by the whole
  batch's count (design §3: reduce once, at the top).
* :func:`accumulate_grads` — gradients of ``loss_sums`` scanned over micro-batches.
* :func:`apply_grads` — divide by the global count, clip, AdamW, skip the update if
  anything is non-finite, bump the version.
* :func:`train_step` — the whole step for a batch that is all at hand (``sync``,
  ``one_step_off``, ``async``): optional ``recompute`` prox pass and reference pass, then
  ``num_minibatches`` optimizer steps. ``periodic`` mode calls ``accumulate_grads`` per
  arriving micro-batch and ``apply_grads`` once per iteration instead.

Shape letters: M micro-batches, B sequences (per micro-batch b), T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from a3po_jax import model
from a3po_jax.core import losses
from a3po_jax.training.config import TrainConfig

Params = Any
Batch = dict[str, jax.Array]


class TrainState(NamedTuple):
    """Everything the step changes, as one pytree."""

    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: optimizer steps applied = the policy version


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The static (hashable) knobs of the step, taken from a :class:`TrainConfig`."""

    loss: str = "ppo"
    prox: str = "a3po"
    zero_staleness: str = "current"
    aggregation: str = "token_mean"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    behav_weight_cap: float | None = None
    cap_mode: str = "mask"
    kl_coef_in_loss: float = 0.0
    kl_kind: str = "k3"
    dpo_beta: float = 0.1
    dpo_kind: str = "sigmoid"
    temperature: float = 1.0
    num_minibatches: int = 1
    micro_batch_size: int = 0  # 0 = whole minibatch
    packed: bool = False  # batches come from packing.pack_groups (shared-prompt rows)
    one_pass_old: bool = False  # recompute's prox taken from this pass (old == current)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> StepSettings:
        a = cfg.algo
        return cls(
            loss=a.loss,
            prox=a.prox,
            zero_staleness=a.a3po_zero_staleness,
            aggregation=a.aggregation,
            clip_eps=a.clip_eps,
            clip_eps_high=a.clip_eps_high or None,
            dual_clip=a.dual_clip or None,
            behav_weight_cap=a.behav_weight_cap or None,
            cap_mode=a.cap_mode,
            kl_coef_in_loss=0.0 if a.kl_in_reward else a.kl_coef,
            kl_kind=a.kl_kind,
            dpo_beta=a.dpo_beta,
            dpo_kind=a.dpo_kind,
            temperature=cfg.rollout.temperature,
            num_minibatches=a.num_minibatches,
            micro_batch_size=cfg.system.micro_batch_size,
            packed=cfg.system.packed_prompts,
            one_pass_old=cfg.system.one_pass_old,
        )

    @property
    def needs_reference(self) -> bool:
        return self.loss == "dpo" or self.kl_coef_in_loss > 0


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up; gradient clipping happens in :func:`apply_grads` so the
    pre-clip norm can be reported."""
    o = cfg.optim
    if o.warmup_steps:
        lr = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
    else:
        lr = o.learning_rate
    return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(
        params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32)
    )


# --------------------------------------------------------------------------------------
# Forward pieces.
# --------------------------------------------------------------------------------------


def policy_logprobs(
    params: Params, batch: Batch, *, settings: StepSettings, model_config: model.ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """``forward_logprobs`` or, for shared-prompt packed batches, its packed twin; both give
    ``[B, T]`` log-probs in ``batching.build_batch``'s target-aligned layout."""
    if settings.packed:
        from a3po_jax.core import packing

        fn = packing.packed_token_logprobs
    else:
        fn = forward_logprobs
    return fn(params, batch, model_config=model_config, temperature=settings.temperature)


def forward_logprobs(
    params: Params, batch: Batch, *, model_config: model.ModelConfig, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Token log-probs of the targets under ``softmax(logits / temperature)`` and entropies.

    The behaviour log-probs from the inference host are taken at the sampling temperature,
    so the trainer's must be too, or the importance ratio is off by the temperature.

    Returns:
      (logp [B, T], entropy [B, T]) float32.
    """
    logits, _ = model.apply(
        params,
        batch["tokens"],
        batch["positions"],
        config=model_config,
        segment_ids=batch["segment_ids"],
    )
    logits = logits / temperature  # [B, T, V] float32
    return losses.token_logprobs(logits, batch["targets"]), losses.entropy(logits)


def _no_grad_logprobs(params, micro_batches, *, settings, model_config):
    """[M, b, T] log-probs of every micro-batch, no gradient (prox recompute / reference)."""

    def one(mb):
        logp, _ = policy_logprobs(params, mb, settings=settings, model_config=model_config)
        return jax.lax.stop_gradient(logp)

    return jax.lax.map(one, micro_batches)


def global_denominator(batch: Batch, settings: StepSettings) -> jax.Array:
    """The count the loss sums are divided by: valid tokens for ``token_mean``, sequences
    with ≥ 1 valid token for the sequence-level aggregations, informative pairs for DPO."""
    mask = batch["loss_mask"]
    if settings.loss == "dpo":
        return jnp.sum(batch["pair_mask"]) / 2.0
    if settings.aggregation == "token_mean":
        return jnp.sum(mask)
    return jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


# --------------------------------------------------------------------------------------
# Loss sums for one micro-batch.
# --------------------------------------------------------------------------------------

# Metrics combined across micro-batches by max / min; everything else is a weighted mean.
_MAX_METRICS = ("is/weight_max", "staleness/max")
_MIN_METRICS = ("is/weight_min",)


def loss_sums(
    params: Params,
    mb: Batch,
    *,
    version: jax.Array,
    prox_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    settings: StepSettings,
    model_config: model.ModelConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss *sum* of one micro-batch (divide by the global count later) and metric sums.

    Args:
      params: current policy parameters (differentiated).
      mb: micro-batch arrays ``[b, T]`` from :class:`a3po_jax.core.batching.TrainBatch`.
      version: int32 scalar trainer version v_θ for this optimizer step.
      prox_logp: ``[b, T]`` recomputed prox (``settings.prox == "recompute"``), else None.
      ref_logp: ``[b, T]`` reference log-probs when a reference is used, else None.

    Returns:
      (loss_sum, metric_sums): metric sums are weighted by the micro-batch's valid tokens
      (``loss/num_tokens``), except max/min metrics.
    """
    logp, ent = policy_logprobs(params, mb, settings=settings, model_config=model_config)
    mask = mb["loss_mask"]
    n_tok = jnp.sum(mask)
    # Staleness d = v_θ - v_behav per token; masked positions get 0 (their versions are 0
    # by construction and carry no meaning).
    staleness = jnp.where(mask > 0, version - mb["versions"], 0).astype(jnp.int32)

    if settings.loss == "dpo":
        seq = losses.sequence_logprobs(logp, mask)  # [b]
        ref_seq = losses.sequence_logprobs(ref_logp, mask)
        loss, m = losses.online_dpo_loss(
            seq[0::2],
            seq[1::2],
            ref_seq[0::2],
            ref_seq[1::2],
            beta=settings.dpo_beta,
            kind=settings.dpo_kind,
            mask=mb["pair_mask"][0::2],
            denominator=1.0,
        )
        pair_w = m.pop("dpo/num_pairs")
        sums = {k: v * pair_w for k, v in m.items()}
        sums["dpo/num_pairs"] = pair_w
    else:
        behav = mb["behav_logp"]
        if settings.prox == "recompute" and settings.one_pass_old:
            # One optimizer step per batch: the step's starting weights ARE the current ones,
            # so the old policy's log-prob is this pass's, detached (Periodic Asynchrony's
            # unified pass): the value a separate no-grad pass gives, without the pass.
            prox = jax.lax.stop_gradient(logp)
        elif settings.prox == "recompute":
            prox = prox_logp
        elif settings.prox == "a3po":
            prox = losses.a3po_prox_logp(
                logp, behav, staleness, zero_staleness=settings.zero_staleness
            )
        else:
            prox = behav
        loss, m = losses.decoupled_ppo_loss(
            logp,
            prox,
            behav,
            mb["advantages"],
            mask,
            clip_eps=settings.clip_eps,
            clip_eps_high=settings.clip_eps_high,
            dual_clip=settings.dual_clip,
            behav_weight_cap=settings.behav_weight_cap,
            cap_mode=settings.cap_mode,
            aggregation=settings.aggregation,
            denominator=1.0,
            staleness=staleness,
        )
        m.pop("loss/num_tokens")
        sums = {k: (v if k in _MAX_METRICS + _MIN_METRICS else v * n_tok) for k, v in m.items()}
    if settings.kl_coef_in_loss > 0:
        kl = losses.kl_penalty(logp, ref_logp, settings.kl_kind)
        kl_sum = losses.aggregate(kl, mask, mode=settings.aggregation, denominator=1.0)
        loss = loss + settings.kl_coef_in_loss * kl_sum
        sums["kl/ref"] = jnp.sum(jax.lax.stop_gradient(kl) * mask)
    sums["loss/num_tokens"] = n_tok
    sums["policy/entropy"] = jnp.sum(jax.lax.stop_gradient(ent) * mask)
    sums["policy/logp"] = jnp.sum(jax.lax.stop_gradient(logp) * mask)
    return loss, sums


def combine_metric_sums(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Merge two micro-batches' metric sums: max/min metrics by max/min, the rest added."""
    out = {}
    for k in a:
        if k in _MAX_METRICS:
            out[k] = jnp.maximum(a[k], b[k])
        elif k in _MIN_METRICS:
            out[k] = jnp.minimum(a[k], b[k])
        else:
            out[k] = a[k] + b[k]
    return out


def finalize_metrics(sums: dict[str, jax.Array], loss_sum: jax.Array, denom: jax.Array):
    """Turn summed metrics into means (token-weighted; DPO metrics pair-weighted)."""
    n_tok = jnp.maximum(sums["loss/num_tokens"], 1.0)
    n_pairs = jnp.maximum(sums.get("dpo/num_pairs", 1.0), 1.0)
    # A batch with nothing to learn from (e.g. every DPO pair tied) has denom 0: loss 0.
    out = {"loss/total": loss_sum / jnp.maximum(denom, 1e-8)}
    for k, v in sums.items():
        if k in _MAX_METRICS + _MIN_METRICS or k in ("loss/num_tokens", "dpo/num_pairs"):
            out[k] = v
        elif k.startswith("dpo/"):
            out[k] = v / n_pairs
        else:
            out[k] = v / n_tok
    return out


# --------------------------------------------------------------------------------------
# Gradients and updates.
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
    version: jax.Array,
    prox_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    settings: StepSettings,
    model_config: model.ModelConfig,
) -> tuple[Params, jax.Array, dict[str, jax.Array]]:
    """Sum of loss-sum gradients over ``[M, b, T]`` micro-batches (a ``lax.scan``).

    Returns:
      (grad_sums, loss_sum, metric_sums); nothing is divided yet.
    """
    grad_fn = jax.value_and_grad(
        functools.partial(loss_sums, settings=settings, model_config=model_config),
        has_aux=True,
    )

    def body(carry, xs):
        g_acc, l_acc, m_acc = carry
        mb, prox, ref = xs
        (loss, sums), grads = grad_fn(params, mb, version=version, prox_logp=prox, ref_logp=ref)
        g_acc = jax.tree.map(jnp.add, g_acc, grads)
        m_acc = sums if m_acc is None else combine_metric_sums(m_acc, sums)
        return (g_acc, l_acc + loss, m_acc), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    # The first micro-batch seeds the metric dict so the scan carry has a fixed structure.
    first = jax.tree.map(lambda x: x[0], (micro_batches, prox_logp, ref_logp))
    (loss0, sums0), g0 = grad_fn(
        params, first[0], version=version, prox_logp=first[1], ref_logp=first[2]
    )
    rest = jax.tree.map(lambda x: x[1:], (micro_batches, prox_logp, ref_logp))
    (g_sum, l_sum, m_sum), _ = jax.lax.scan(
        body, (jax.tree.map(jnp.add, zeros, g0), loss0, sums0), rest
    )
    return g_sum, l_sum, m_sum


def apply_grads(
    state: TrainState,
    grad_sums: Params,
    denominator: jax.Array,
    *,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
    loss_sum: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """Divide by the global count, clip, update; skip the update if anything is non-finite.

    A skipped step leaves params, optimizer state and version untouched and reports
    ``step/skipped = 1`` so the host can count and stop after N in a row.
    """
    denominator = jnp.maximum(denominator, 1e-8)
    grads = jax.tree.map(lambda g: g / denominator, grad_sums)
    grad_norm = optax.tree.norm(grads)
    if grad_clip > 0:
        # Same rule as optax.clip_by_global_norm, done here to report the pre-clip norm.
        scale = jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(grad_norm)
    if loss_sum is not None:
        finite = finite & jnp.isfinite(loss_sum)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new_state = TrainState(
        params=jax.tree.map(keep, new_params, state.params),
        opt_state=jax.tree.map(keep, new_opt, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
    )
    metrics = {
        "optim/grad_norm": grad_norm,
        "optim/update_norm": optax.tree.norm(updates),
        "optim/param_norm": optax.tree.norm(new_state.params),
        "step/skipped": 1.0 - finite.astype(jnp.float32),
    }
    return new_state, metrics


def train_step(
    state: TrainState,
    batch: Batch,
    ref_params: Params | None,
    *,
    settings: StepSettings,
    model_config: model.ModelConfig,
    optimizer: optax.GradientTransformation,
    grad_clip: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One training step on a batch that is all at hand.

    1. ``prox == "recompute"``: a no-grad forward of the step's starting weights over the
       whole batch (decoupled PPO's extra pass; A-3PO exists to remove it).
    2. reference log-probs with the frozen ``ref_params`` if the loss needs them.
    3. ``num_minibatches`` optimizer steps; minibatch k trains at version v₀ + k, so its
       staleness is v₀ + k − v_behav.

    Args:
      state: the current :class:`TrainState` (donate it under jit).
      batch: ``[B, T]`` arrays of a :class:`a3po_jax.core.batching.TrainBatch`.
      ref_params: frozen reference params, or None.

    Returns:
      (new_state, metrics) with metrics of the last minibatch plus ``time``-free scalars.
    """
    k = settings.num_minibatches
    rows = batch["loss_mask"].shape[0]
    per_minibatch = rows // k
    mb_size = settings.micro_batch_size or per_minibatch
    n_micro = per_minibatch // mb_size
    minibatches = split_micro_batches(batch, k * n_micro)  # [k*M, b, T]

    prox_all = None
    if settings.loss == "ppo" and settings.prox == "recompute" and not settings.one_pass_old:
        prox_all = _no_grad_logprobs(
            state.params, minibatches, settings=settings, model_config=model_config
        )
    ref_all = None
    if settings.needs_reference:
        ref_all = _no_grad_logprobs(
            ref_params, minibatches, settings=settings, model_config=model_config
        )

    metrics = {}
    v0 = state.step
    for i in range(k):
        sl = slice(i * n_micro, (i + 1) * n_micro)
        mbs = jax.tree.map(lambda x: x[sl], minibatches)  # noqa: B023
        prox = None if prox_all is None else prox_all[sl]
        ref = None if ref_all is None else ref_all[sl]
        g_sum, l_sum, m_sum = accumulate_grads(
            state.params,
            mbs,
            version=v0 + i,
            prox_logp=prox,
            ref_logp=ref,
            settings=settings,
            model_config=model_config,
        )
        denom = global_denominator(
            jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), mbs), settings
        )
        state, opt_metrics = apply_grads(
            state, g_sum, denom, optimizer=optimizer, grad_clip=grad_clip, loss_sum=l_sum
        )
        metrics = {**finalize_metrics(m_sum, l_sum, denom), **opt_metrics}
    return state, metrics


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
    settings: StepSettings,
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
        settings=settings,
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
