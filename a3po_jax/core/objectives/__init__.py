"""Training objectives, one module per family, and the registry that names them.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

* :mod:`~a3po_jax.core.objectives.ppo`: decoupled PPO with its prox rules (``algo.loss=ppo``);
* :mod:`~a3po_jax.core.objectives.dpo`: Online DPO on pairs (``algo.loss=dpo``);
* :mod:`~a3po_jax.core.objectives.m2po`: M2PO, the second-moment trust region for stale
  data (``algo.loss=m2po``);
* :mod:`~a3po_jax.core.objectives.gspo`: GSPO, the clipped sequence-level ratio
  (``algo.loss=gspo``);
* :mod:`~a3po_jax.core.objectives.icepop`: IcePop, decoupled PPO with a two-sided mask of
  the train/inference ratio (``algo.loss=icepop``);
* :mod:`~a3po_jax.core.objectives.registry`: :func:`register`, :func:`get`, :func:`names`;
* :mod:`~a3po_jax.core.objectives.spec`: :class:`ObjectiveSpec`, what an objective is built
  from (its own settings, the clip, the aggregation, the prox rule bound once).

Each module holds its per-token maths, the public loss (``decoupled_ppo_loss``,
``online_dpo_loss``), the train step's term built from the same sums, its metrics, its
settings dataclass (``algo.<name>.<field>``) and its registration. Adding an objective is
one module that registers itself (see :mod:`~a3po_jax.core.objectives.registry`);
``algo.loss=<name>`` finds it.
"""

from a3po_jax.core.objectives import dpo, gspo, icepop, m2po, ppo, spec
from a3po_jax.core.objectives.registry import (
    PAIRS,
    ROWS,
    BatchLayout,
    Objective,
    Term,
    TermFn,
    get,
    names,
    register,
)
from a3po_jax.core.objectives.spec import ObjectiveSpec

__all__ = [
    "PAIRS",
    "ROWS",
    "BatchLayout",
    "Objective",
    "ObjectiveSpec",
    "Term",
    "TermFn",
    "dpo",
    "get",
    "gspo",
    "icepop",
    "m2po",
    "names",
    "ppo",
    "register",
    "spec",
]
