"""Each objective's own settings in the run configuration (``algo.<name>.<field>``), and the
conversion of a validated config into the core's objective spec.

Training layer (host-side shell).

An objective registers a frozen settings dataclass with itself
(:func:`a3po_jax.core.objectives.register`); :class:`~a3po_jax.training.config.AlgoSection`
holds one instance per objective that has one, in an :class:`ObjectiveSettings` mapping,
read as ``cfg.algo.m2po.tau``. This module builds that mapping from what an experiment file
(``{"m2po": {"tau": 0.02}}`` or ``M2POSettings(tau=0.02)``), the command line
(``algo.m2po.tau=0.02``) or a saved ``config.json`` (``"algo": {"m2po": {"tau": 0.02}}``)
gives; the flat spellings the fields had before they moved to their objective
(``algo.m2po_tau``) still read, with a one-line deprecation notice.
:func:`objective_spec` converts a validated config into the
:class:`~a3po_jax.core.objectives.spec.ObjectiveSpec` its objective is built from, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from a3po_jax.core import objectives
from a3po_jax.core.objectives.spec import ClipSpec, ObjectiveSpec, ProxSpec
from a3po_jax.training.config_values import (
    ConfigError,
    _check_field,
    _check_types,
    _hints,
    _parse_value,
    announce_renamed,
)


class ObjectiveSettings(Mapping[str, Any]):
    """Objective name -> its settings dataclass; immutable and hashable, as a frozen
    section's field must be."""

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(sorted((items or {}).items()))

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return f"ObjectiveSettings({self._items!r})"


def _settings_class(name: str, where: str) -> type:
    """The settings dataclass the objective ``name`` registered (its module imported if
    needed); ``where`` is the config key the error names."""
    objective = objectives.get(name, what=f"{where}: objective", error=ConfigError)
    if objective.settings is None:
        raise ConfigError(f"{where}: objective {name!r} has no settings of its own")
    return objective.settings


def build(name: str, value: Any) -> Any:
    """The settings of objective ``name`` from an instance of its class or a mapping of
    its fields (the others default); every error names ``algo.<name>.<field>``."""
    where = f"algo.{name}"
    cls = _settings_class(name, where)
    if not isinstance(value, cls):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a {cls.__name__} or a mapping, got {value!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown} in {where}; {where} has: {known}")
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, item in fields.items():  # types first: the class's own checks compare numbers
            _check_field(f"{where}.{key}", _hints(cls)[key], item, defaults[key])
        try:
            value = cls(**fields)
        except ValueError as err:  # the core's message starts with the field's name
            raise ConfigError(f"{where}.{err}") from None
    _check_types(where, value)
    return value


def normalized(given: Any) -> ObjectiveSettings:
    """Every registered objective's settings: those ``given`` (objective name -> instance or
    mapping), the defaults of the others."""
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"algo.settings must map objective names to their settings, got {given!r}"
        )
    built = {str(name): build(str(name), value) for name, value in given.items()}
    for name in objectives.names():
        cls = objectives.get(name).settings
        if cls is not None and name not in built:
            built[name] = cls()
    return ObjectiveSettings(built)


def updated(current: Mapping[str, Any], changes: Mapping[str, Mapping[str, Any]]) -> dict:
    """``current`` with the fields in ``changes`` (objective name -> {field: value}) set."""
    merged = dict(current)
    for name, fields in changes.items():
        base = merged.get(name) or _settings_class(name, f"algo.{name}")()
        merged[name] = {**dataclasses.asdict(base), **fields}
    return merged


def flat(key: str) -> tuple[str, str] | None:
    """``(objective, field)`` of a flat spelling ``<objective>_<field>`` (``m2po_tau``), or
    None; announces it once per process."""
    for name in objectives.names():
        cls = objectives.get(name).settings
        field = key[len(name) + 1 :]
        if cls is not None and key.startswith(f"{name}_") and field in _hints(cls):
            announce_renamed(f"algo.{key}", f"algo.{name}.{field}")
            return name, field
    return None


def parse_override(key: str, text: str) -> tuple[str, str, Any] | None:
    """``(objective, field, value)`` of an override ``algo.<key>=<text>`` that sets an
    objective's setting (``m2po.tau``, or the flat ``m2po_tau``), else None."""
    if "." in key:
        name, field = key.split(".", 1)
        hints = _hints(_settings_class(name, f"algo.{key}"))
        if field not in hints:
            raise ConfigError(
                f"unknown config field 'algo.{key}'; algo.{name} has: {', '.join(hints)}"
            )
    else:
        found = flat(key)
        if found is None:
            return None
        name, field = found
        hints = _hints(objectives.get(name).settings)
    return name, field, _parse_value(text, hints[field], f"algo.{name}.{field}")


def saved_algo(data: Mapping[str, Any], fields: set[str]) -> dict[str, Any]:
    """``AlgoSection`` keyword arguments from a saved ``algo`` dict: its ``fields`` as they
    are, each objective's settings from the dict under its name or from the flat names
    the fields had before (announced)."""
    kwargs: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in fields:
            kwargs[key] = value
        elif (found := flat(key)) is not None:
            settings.setdefault(found[0], {})[found[1]] = value
        elif isinstance(value, Mapping):
            settings.setdefault(key, {}).update(value)
        else:
            raise ConfigError(f"unknown config field(s) [{key!r}] in section 'algo'")
    return {**kwargs, "settings": settings} if settings else kwargs


def objective_spec(cfg: Any) -> ObjectiveSpec:
    """The core's :class:`ObjectiveSpec` of a validated ``TrainConfig``: its objective's
    settings, the aggregation, the prox rule and the clip, read here once."""
    a = cfg.algo
    return ObjectiveSpec(
        settings=a.settings.get(a.loss),
        aggregation=a.aggregation,
        prox=ProxSpec(
            rule=a.prox,
            zero_staleness=a.a3po_zero_staleness,
            staleness_unit=a.a3po_staleness_unit,
            one_pass_old=cfg.system.batch.one_pass_old,
        ),
        clip=ClipSpec(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ClipSpec)}),
    )
