"""The typed spec an objective is built from, the proximal policy bound once, and the checks
of an objective's own settings.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

The shell converts its run configuration once into an :class:`ObjectiveSpec`; an
objective's ``make(spec)`` reads nothing else:

* ``spec.settings``: the objective's own settings, the frozen dataclass it registered
  (``register(name, settings=...)``; ``algo.<name>.<field>`` on the command line), or None;
* ``spec.clip``: the clip and the weight caps the clip family shares (:class:`ClipSpec`);
* ``spec.aggregate``: the loss aggregation, bound;
* ``spec.anchor``: the prox rule (:class:`ProxSpec`) bound once into an :class:`Anchor`,
  for the objectives whose trust region is anchored at π_prox (PPO, GSPO, IcePop), whose
  term is :func:`token_term` of their sums (``spec.anchored(sums, ...)``).

A settings dataclass validates itself in ``__post_init__`` with :func:`check_number` and
:func:`a3po_jax.core.checks.check_choice`, whose messages start with the field's name (the
config prefixes ``algo.<name>.``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax

from a3po_jax.core import importance, prox
from a3po_jax.core.aggregation import aggregate_sum
from a3po_jax.core.objectives.registry import Term
from a3po_jax.core.stats import Stats

Batch = dict[str, jax.Array]
# (logp, prox_logp, behav_logp, advantages, mask, *, staleness, **hyper) -> sums
Sums = Callable[..., tuple[jax.Array, jax.Array, Stats]]


def check_number(name: str, value: Any, *, above: float, below: float | None = None) -> None:
    """Refuse ``value`` unless it is a finite number (not a bool) in ``(above, below)``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not (above < value and (below is None or value < below)):
        bound = f"> {above}" if below is None else f"in ({above}, {below})"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ProxSpec:
    """Where π_prox comes from (:mod:`a3po_jax.core.prox`)."""

    rule: str = "a3po"  # a key of prox.PROX_RULES
    zero_staleness: str = "current"  # A-3PO at d = 0
    staleness_unit: str = "step"  # the d A-3PO's α reads
    one_pass_old: bool = False  # recompute with old = sg(current), no pass


@dataclasses.dataclass(frozen=True)
class ClipSpec:
    """The trust-region clip and the behaviour-weight caps of the clip family (0 = off)."""

    clip_eps: float = 0.2  # ε_low
    clip_eps_high: float = 0.0  # ε_high; 0 = clip_eps
    dual_clip: float = 0.0  # c > 1
    behav_weight_cap: float = 0.0  # token-level cap on w_t
    cap_mode: str = "mask"
    seq_weight_cap: float = 0.0  # sequence-level cap C > 1 on Π w_t
    seq_cap_mode: str = "truncate"
    seq_weight_form: str = "product"

    @property
    def clip(self) -> dict[str, Any]:
        """``clip_eps``, ``clip_eps_high``, ``dual_clip`` as the losses take them (None: off)."""
        return {
            "clip_eps": self.clip_eps,
            "clip_eps_high": self.clip_eps_high or None,
            "dual_clip": self.dual_clip or None,
        }

    @property
    def clip_and_caps(self) -> dict[str, Any]:
        """:attr:`clip` with the token or sequence cap (PPO's keyword arguments)."""
        seq_correction = None
        if self.seq_weight_cap > 0:
            seq_correction = importance.make_sequence_correction(
                self.seq_weight_cap, mode=self.seq_cap_mode, form=self.seq_weight_form
            )
        return {
            **self.clip,
            "behav_weight_cap": self.behav_weight_cap or None,
            "cap_mode": self.cap_mode,
            "seq_correction": seq_correction,
        }


@dataclasses.dataclass(frozen=True)
class Anchor:
    """The prox rule bound once: ``anchor(logp, mb, staleness, old_logp)`` is ``[b, T]``
    log π_prox of a micro-batch, A-3PO reading the d its staleness unit picks."""

    fn: prox.ProxFn  # (logp, behav_logp, d, old_logp) -> prox_logp
    staleness: Callable[[Batch, jax.Array], jax.Array]  # (mb, d in updates) -> d it reads
    needs_old_pass: bool  # the step runs a no-grad pass of its starting weights

    @classmethod
    def bind(cls, spec: ProxSpec) -> Anchor:
        rule = prox.make_prox_rule(
            spec.rule, zero_staleness=spec.zero_staleness, one_pass_old=spec.one_pass_old
        )
        return cls(rule.fn, prox.staleness_for_prox(spec.staleness_unit), rule.needs_old_pass)

    def __call__(
        self, logp: jax.Array, mb: Batch, staleness: jax.Array, old_logp: jax.Array | None
    ) -> jax.Array:
        return self.fn(logp, mb["behav_logp"], self.staleness(mb, staleness), old_logp)


def token_term(
    logp: jax.Array,
    mb: Batch,
    *,
    staleness: jax.Array,
    old_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    sums: Sums,
    anchor: Anchor | None = None,
    **hyper: Any,
) -> tuple[jax.Array, jax.Array, Stats]:
    """One micro-batch of a token-level objective: ``sums(logp, prox_logp, behav_logp,
    advantages, mask, staleness=..., **hyper)`` of its arrays, log π_prox from ``anchor``
    (None: an objective with no proximal policy, M2PO, whose ``sums`` take no prox_logp).
    ``staleness`` is in optimizer updates (the ``staleness/*`` metrics)."""
    del ref_logp
    prox_logp = () if anchor is None else (anchor(logp, mb, staleness, old_logp),)
    arrays = (logp, *prox_logp, mb["behav_logp"], mb["advantages"], mb["loss_mask"])
    return sums(*arrays, staleness=staleness, **hyper)


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """What an objective's ``make`` builds its term from, converted once from the run's
    configuration by the shell (``a3po_jax.training.step_builder``)."""

    settings: Any = None  # the objective's registered settings dataclass, or None
    aggregation: str = "token_mean"  # a key of aggregation.AGGREGATIONS
    prox: ProxSpec = ProxSpec()
    clip: ClipSpec = ClipSpec()

    @property
    def aggregate(self) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """``(per_token [b, T], mask [b, T]) -> (numerator, count)`` of the aggregation."""
        return functools.partial(aggregate_sum, mode=self.aggregation)

    @functools.cached_property
    def anchor(self) -> Anchor:
        """The prox rule, bound once."""
        return Anchor.bind(self.prox)

    def anchored(self, sums: Sums, **hyper: Any) -> Term:
        """The :class:`Term` of an objective anchored at π_prox: :func:`token_term` of
        ``sums`` with the bound prox rule and ``hyper``; an old-policy pass where it needs one."""
        fn = functools.partial(token_term, sums=sums, anchor=self.anchor, **hyper)
        return Term(fn, needs_old_pass=self.anchor.needs_old_pass)
