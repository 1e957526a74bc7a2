"""The objectives registry: one table from ``algo.loss`` names to training objectives.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

An objective module registers itself when imported (Tunix's ``rl/function_registry.py``
does the same for its losses)::

    @register("reinforce", settings=ReinforceSettings)
    def reinforce(spec) -> Term:
        return Term(functools.partial(reinforce_term, cap=spec.settings.max_advantage))

``make(spec)`` runs once, when the step is built, with the
:class:`~a3po_jax.core.objectives.spec.ObjectiveSpec` the shell converted from the validated
run configuration; it binds the objective's hyperparameters (its own ``spec.settings``, an
instance of the frozen dataclass it registered, and the shared ``spec.clip``,
``spec.aggregate``, ``spec.anchor``) and returns the :class:`Term` the differentiated
function calls. The settings dataclass validates itself when built; its fields are
``algo.<name>.<field>`` in the run configuration, which holds one instance per objective.
The registration also says what the step must prepare: a frozen reference's log-probs
(``needs_reference``) and the batch layout (:data:`ROWS`, or :data:`PAIRS` for a pairwise
loss such as Online DPO); and, for an objective that is meaningless under some prox rules,
the ``algo.prox`` values it accepts (``prox_rules``; the config refuses the others before
anything loads).

:func:`get` finds an objective by name. A name not registered yet is looked for as a
module, first ``a3po_jax.core.objectives.<name>`` and then ``<name>`` on the Python path,
which must register that name when imported: so a new objective is one module, wherever it
lives, and ``algo.loss=<name>`` selects it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from a3po_jax.core.checks import registered
from a3po_jax.core.stats import Stats

Batch = dict[str, jax.Array]
# (logp [b, T], micro-batch, *, staleness [b, T], old_logp [b, T] | None,
#  ref_logp [b, T] | None) -> (loss_sum, count, Stats); the loss is Σ loss_sum / Σ count.
TermFn = Callable[..., tuple[jax.Array, jax.Array, Stats]]


class Term(NamedTuple):
    """What the differentiated function calls for an objective, built by its ``make``."""

    fn: TermFn  # one micro-batch's (loss_sum, count, Stats); hyperparameters bound
    needs_old_pass: bool = False  # a no-grad pass of the step's starting weights (old_logp)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a batch's rows are ordered for an objective, and the group size it needs."""

    name: str
    pairs: bool  # each group of 2 ordered (chosen, rejected) by reward; pair_mask set
    group_size: int | None  # rollout.group_size the layout needs; None: any


ROWS = BatchLayout("rows", pairs=False, group_size=None)
PAIRS = BatchLayout("pairs", pairs=True, group_size=2)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered training objective."""

    name: str  # the algo.loss value that selects it
    make: Callable[[Any], Term]  # (ObjectiveSpec) -> Term, called once per build
    settings: type | None = None  # its frozen settings dataclass (algo.<name>.*); None: none
    needs_reference: bool = False  # the term reads ref_logp (a frozen reference's pass)
    layout: BatchLayout = ROWS
    prox_rules: tuple[str, ...] | None = None  # algo.prox values it accepts; None: any

    @property
    def origin(self) -> str:
        """``module.function`` of ``make``: where the objective was registered."""
        return f"{self.make.__module__}.{self.make.__qualname__}"


_REGISTRY: dict[str, Objective] = {}
_PACKAGE = __name__.rsplit(".", 1)[0]  # a3po_jax.core.objectives


def register(
    name: str,
    *,
    settings: type | None = None,
    needs_reference: bool = False,
    layout: BatchLayout = ROWS,
    prox_rules: tuple[str, ...] | None = None,
) -> Callable[[Callable[[Any], Term]], Callable[[Any], Term]]:
    """Decorator registering ``make`` as the objective ``name``.

    ``settings`` is the objective's own frozen dataclass of hyperparameters (every field with
    a default; ``__post_init__`` refuses a bad value naming the field), handed to ``make``
    as ``spec.settings``. ``prox_rules`` lists the ``algo.prox`` values the objective makes
    sense with (None: any, or it reads no prox); the config refuses the others, naming them.

    Raises:
      TypeError: ``settings`` is not a frozen dataclass.
      ValueError: ``name`` is already registered by another function (the message names
        it and the registered names). Importing the same module again re-registers its own
        function, which is allowed.
    """

    frozen = dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen
    if settings is not None and not frozen:  # the config holds it in a frozen section
        raise TypeError(f"settings of objective {name!r} must be a frozen dataclass: {settings}")

    def decorate(make: Callable[[Any], Term]) -> Callable[[Any], Term]:
        objective = Objective(
            name,
            make,
            settings=settings,
            needs_reference=needs_reference,
            layout=layout,
            prox_rules=prox_rules,
        )
        known = _REGISTRY.get(name)
        if known is not None and known.origin != objective.origin:
            raise ValueError(
                f"objective {name!r} is already registered by {known.origin}; choose another "
                f"name (registered: {', '.join(names())})"
            )
        _REGISTRY[name] = objective
        return make

    return decorate


def names() -> tuple[str, ...]:
    """The registered objective names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(name: str, *, what: str = "objective", error: type[Exception] = ValueError) -> Objective:
    """The objective registered as ``name``, importing its module first if needed.

    Args:
      name: a registered name, or the name of a module that registers it
        (``a3po_jax.core.objectives.<name>``, else ``<name>`` on the Python path).
      what: how the name is called in an error (``"algo.loss"`` for the config).
      error: the exception type raised for an unknown name.

    Raises:
      Exception: ``error``, naming ``what``, the value and the registered names.
    """
    return registered(name, _REGISTRY, package=_PACKAGE, names=names, what=what, error=error)
