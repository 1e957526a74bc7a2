"""The run configuration's value checks and override parsing, shared by its sections.

Training layer (host-side shell).

Every error is a :class:`ConfigError` naming the field (``section.field``) and, for
choices, the allowed values. :func:`_check_types` checks every field of a section against
its annotation, so a field added to a section is checked without a line of its own;
:func:`_parse_value` turns override text into a value of the field's type.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import types
import typing
from typing import Any

from a3po_jax.core.batch_plan import AUTO
from a3po_jax.core.checks import check_choice, check_finite

log = logging.getLogger(__name__)
# Renamed spellings (``algo.m2po_tau``) already announced in this process.
RENAMED_READ: set[str] = set()


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or inconsistent."""


def announce_renamed(old: str, new: str) -> None:
    """Says once per process that the spelling ``old`` is read as ``new``, deprecated."""
    if old not in RENAMED_READ:
        RENAMED_READ.add(old)
        log.warning("%s is deprecated: write %s", old, new)


def _choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    check_choice(f"{section}.{name}", value, allowed, error=ConfigError)


def _name(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name  # top-level fields have no section


def _positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    check_finite(_name(section, name), value, error=ConfigError)  # NaN passes `value < 0`
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{_name(section, name)} must be {bound}, got {value!r}")


# Every int of a run (steps, sizes, seeds, versions) ends up in int32 arrays or in NumPy's
# and JAX's seeds: a value outside int32 is a typo, refused rather than wrapped.
INT_LIMIT = 2**31
# Numbers are >= 0 (sizes, seeds, rates, coefficients, caps, seconds), or -1 where -1 means
# "all" or "automatic": in the fields named here and in every field whose default is -1. A
# field added to a section gets this rule without a line of its own.
MINUS_ONE_FIELDS = frozenset({"system.mesh.data", "system.mesh.fsdp", "system.mesh.tensor"})
# Durations (fields named *_s) end up as thread wait timeouts, which refuse longer ones.
MAX_SECONDS = threading.TIMEOUT_MAX


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(section: str, obj: Any) -> None:
    """Every field of the dataclass ``obj`` against its annotation, before any range check:
    bools are bools, ints are ints (not bools) inside int32, floats are finite numbers,
    strings are strings, ``tuple[int, ...]`` holds such ints, ``bool | str`` is true, false
    or "auto". A field added to a section is checked without a line of its own (an
    experiment file can hand any Python value in)."""
    for field in dataclasses.fields(obj):
        where = _name(section, field.name)
        _check_field(where, _hints(type(obj))[field.name], getattr(obj, field.name), field.default)


def _check_field(where: str, hint: Any, value: Any, default: Any) -> None:
    """One field of :func:`_check_types` (``default``: -1 there makes -1 a value)."""
    if hint == tuple[int, ...]:
        if not isinstance(value, tuple):
            raise ConfigError(f"{where} must be a tuple of ints, got {value!r}")
        for item in value:
            _check_value(where, int, item)
    elif hint == bool | str:  # a switch with an automatic setting
        if not (isinstance(value, bool) or (isinstance(value, str) and value == AUTO)):
            raise ConfigError(f"{where} must be true, false or {AUTO!r}, got {value!r}")
    elif hint in (bool, int, float, str):
        _check_value(where, hint, value)
        if hint in (int, float) and value < 0:
            minus_one = where in MINUS_ONE_FIELDS or default == -1
            if not (minus_one and value == -1):
                allowed = ">= 0 (or -1)" if minus_one else ">= 0"
                raise ConfigError(f"{where} must be {allowed}, got {value!r}")
    elif dataclasses.is_dataclass(hint) and not isinstance(value, hint):
        raise ConfigError(f"{where} must be a {hint.__name__} section, got {value!r}")


def _check_value(where: str, hint: type, value: Any) -> None:
    kinds = {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string"}
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if hint is float:  # an int is a float's value too (clip_eps=1), a bool is not
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{where} must be {kinds[hint]}, got {value!r}")
    if hint is float:
        check_finite(where, value, error=ConfigError)
        if where.endswith("_s") and value > MAX_SECONDS:
            raise ConfigError(f"{where} must be <= {MAX_SECONDS:.0f} seconds, got {value!r}")
    if hint is int and not -INT_LIMIT <= value < INT_LIMIT:
        raise ConfigError(f"{where} must fit in int32 (|{where}| < 2**31), got {value!r}")
    if hint is str and "\x00" in value:
        raise ConfigError(f"{where} must not contain a NUL character, got {value!r}")


def json_object(where: str, text: str, *, error: type[Exception] = ConfigError) -> dict:
    """``text`` parsed as a JSON object (task options); ``error`` naming ``where`` if it is
    not valid JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise error(f"{where} must be a JSON object, got {text!r}")
    return value


def _check_address(address: str) -> None:
    """One ``system.placement.inference_hosts`` entry: ``host:port`` (empty entries are skipped)."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    ok_host = host and host.isascii() and host.isprintable() and " " not in host
    if not (ok_host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"system.placement.inference_hosts entry {address!r} is not host:port (port 1-65535)"
        )


def _parse_value(text: str, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if annotation == bool | str:  # a switch: true, false or "auto"
        if text.lower() == AUTO:
            return AUTO
        try:
            return _parse_value(text, bool, where)
        except ConfigError:
            raise ConfigError(f"{where} expects true, false or {AUTO}, got {text!r}") from None
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} expects a bool (true/false), got {text!r}")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where} expects an int, got {text!r}") from None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where} expects a float, got {text!r}") from None
    if origin is tuple:
        parts = [p for p in text.replace("(", "").replace(")", "").split(",") if p.strip()]
        (elem,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        return tuple(_parse_value(p.strip(), elem, where) for p in parts)
    if annotation is str or origin in (types.UnionType, typing.Union):
        return text
    raise ConfigError(f"{where}: cannot parse a value of type {annotation}")
