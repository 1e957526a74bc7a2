"""From a run's :class:`TrainConfig` to the core's algorithm and optimizer.

Training layer: the trainer's one call into the core's assembly. The config has validated
every value once (names against their tables, the batch plan, the objective's
constraints and settings); the objective's part is converted here, once, into the core's
:class:`~a3po_jax.core.objectives.spec.ObjectiveSpec`
(:func:`a3po_jax.training.objective_settings.objective_spec`), so an objective's new
hyperparameter is a field of its own settings dataclass and nothing else.
"""

from __future__ import annotations

import dataclasses

import optax

from a3po_jax.core import optim
from a3po_jax.core.algorithm import Algorithm, build_algorithm
from a3po_jax.core.batch_plan import BatchPlan
from a3po_jax.model import ModelConfig
from a3po_jax.training.config import TrainConfig
from a3po_jax.training.objective_settings import objective_spec


def algorithm(cfg: TrainConfig, model_config: ModelConfig, *, batch_shards: int = 1) -> Algorithm:
    """The step's algorithm for ``cfg`` and the policy's architecture, with the config's
    batch plan (computed here once; the trainer reads it back as ``algo.plan``), its
    ``system.batch.packed_prompts="auto"`` resolved for a mesh that splits the batch into
    ``batch_shards`` parts."""
    plan = (
        cfg.batch_plan
        if batch_shards == 1
        else BatchPlan.from_config(cfg, batch_shards=batch_shards)
    )
    return build_algorithm(cfg, model_config, plan, spec=objective_spec(cfg))


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW as ``cfg.optim`` describes it (``grad_clip`` is applied by the step itself)."""
    fields = {f.name for f in dataclasses.fields(cfg.optim)} - {"grad_clip"}
    return optim.make_optimizer(**{name: getattr(cfg.optim, name) for name in fields})
