"""Argument checks of the core's public functions: one choice check, ranks, shapes, bounds.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

They run when a function is traced (shapes and Python hyperparameters are static), so they
cost nothing inside jit. :func:`check_choice` is the one check of a name against its
allowed values: the run configuration uses it too (with its own error type), so a refusal
reads the same wherever it comes from.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def check_choice(
    name: str,
    value: str,
    allowed: Iterable[str],
    *,
    error: type[Exception] = ValueError,
    hint: str = "",
) -> None:
    """Raise ``error`` naming ``name``, the value and the allowed values (then ``hint``)
    unless ``value`` is one of ``allowed`` (a tuple of names or a table keyed by them)."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise error(f"{name}={value!r} is not one of {', '.join(allowed)}{hint}")


def registered(
    name: str,
    table: Mapping[str, Any],
    *,
    package: str,
    names: Callable[[], Iterable[str]],
    what: str,
    error: type[Exception] = ValueError,
) -> Any:
    """``table[name]``, importing the module that registers it first if it is not there yet
    (``<package>.<name>``, else ``<name>`` on the Python path): how a plugin objective or
    mode is found by its name alone. Raises ``error`` naming ``what``, the value and
    ``names()`` (:func:`check_choice`) when no such module registers it."""
    plain = isinstance(name, str) and name.isidentifier()
    if name not in table and plain:
        for module in (f"{package}.{name}", name):
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name != module:  # the module exists and an import inside it failed
                    raise
                continue
            if name in table:
                break
    # Only a Python identifier names a module that could register it (and fits in one line).
    hint = (
        f" (nor does a module {package}.{name} or {name} on the Python path register it)"
        if plain
        else ""
    )
    check_choice(what, name, names(), error=error, hint=hint)
    return table[name]


def check_rank(name: str, x: jax.Array, rank: int, what: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} ({what}), got shape {jnp.shape(x)}")


def check_same_shape(ref_name: str, ref: jax.Array, **others: jax.Array | None) -> None:
    for name, x in others.items():
        if x is not None and jnp.shape(x) != jnp.shape(ref):
            raise ValueError(
                f"{name} has shape {jnp.shape(x)} but {ref_name} has shape {jnp.shape(ref)}; "
                "they must match exactly (no implicit broadcasting)"
            )


def check_finite(name: str, value: float, *, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``name`` unless ``value`` is a finite number.

    NaN compares false with everything, so a range check written as "raise if below the
    bound" lets it through (and ±inf passes one side of every range): every range check
    of a float starts here.
    """
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value!r}")


def check_positive(name: str, value: float | None, *, minimum: float = 0.0) -> None:
    if value is None:
        return
    check_finite(name, value)
    if not value > minimum:
        raise ValueError(f"{name} must be > {minimum}, got {value!r}")
