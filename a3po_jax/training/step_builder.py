"""From a run's :class:`TrainConfig` to the core's step settings, algorithm and optimizer.

Training layer: the one place that reads the configuration for the jitted step, so the
core (``a3po_jax.core.train_step``) never imports the config. The core's
:class:`~a3po_jax.core.train_step.StepSettings` names its fields as the config sections do;
each is taken from the one section that has a field of that name, so no field is copied by
hand and a rename on either side fails here, loudly, naming the field.
"""

from __future__ import annotations

import dataclasses

import optax

from a3po_jax.core import train_step as ts
from a3po_jax.training.config import TrainConfig

# Sections the step's settings are read from (the rest configure the shell).
_STEP_SECTIONS = ("algo", "system", "rollout")


def _by_name(sections: dict[str, object], names: list[str], what: str) -> dict[str, object]:
    """``{name: value}`` with each name looked up in the one section that has it."""
    values = {}
    for name in names:
        owners = [s for s, sec in sections.items() if name in _field_names(sec)]
        if len(owners) != 1:
            where = ", ".join(owners) if owners else "no section"
            raise TypeError(
                f"{what} field {name!r} must be a field of exactly one of the config sections "
                f"{', '.join(sections)}; found in {where}"
            )
        values[name] = getattr(sections[owners[0]], name)
    return values


def _field_names(section: object) -> set[str]:
    return {f.name for f in dataclasses.fields(section)}


def step_settings(cfg: TrainConfig) -> ts.StepSettings:
    """The core's step settings, every field read from the config section of that name."""
    sections = {name: getattr(cfg, name) for name in _STEP_SECTIONS}
    names = [f.name for f in dataclasses.fields(ts.StepSettings)]
    return ts.StepSettings(**_by_name(sections, names, "StepSettings"))


def algorithm(cfg: TrainConfig) -> ts.Algorithm:
    """The step's algorithm, resolved from the config's names once (see
    :func:`a3po_jax.core.train_step.build_algorithm`)."""
    return ts.build_algorithm(step_settings(cfg))


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW as ``cfg.optim`` describes it (``grad_clip`` is applied by the step itself)."""
    fields = _field_names(cfg.optim) - {"grad_clip"}
    return ts.make_optimizer(**{name: getattr(cfg.optim, name) for name in fields})
