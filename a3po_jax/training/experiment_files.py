"""Experiment files: a Python file whose ``config()`` returns a run's ``TrainConfig``.

Training layer (host-side shell).

:func:`load_config` imports the file and calls ``config()``; :func:`import_experiment`
imports it alone (its ``SWEEP`` too). Whatever goes wrong is one :class:`ConfigError`
naming the file and the line of it the error came from; a keyword of ``AlgoSection`` that
moved to its objective's settings (``m2po_tau``) is named with its new place.
"""

from __future__ import annotations

import importlib.util
import re
import traceback
import types
from pathlib import Path
from typing import Any

from a3po_jax.training import objective_settings
from a3po_jax.training.config_values import ConfigError


def import_experiment(path: str | Path) -> types.ModuleType:
    """Import an experiment file as a module (its ``config()``, maybe its ``SWEEP``).

    Raises:
      ConfigError: the file does not exist, or importing it raised; the message names the
        file, the error and the line of the experiment file it came from.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError(
            f"experiment file {_where(path, err)} failed to import: {_describe(err)}"
        ) from err
    return module


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    # AlgoSection(m2po_tau=...) in an old experiment file: name the field's new place.
    moved = re.search(r"unexpected keyword argument '(\w+)'", text)
    found = moved and objective_settings.flat(moved.group(1))
    return text + (f" (now algo.{found[0]}.{found[1]}: docs/losses.md)" if found else "")


def _where(path: Path, err: BaseException) -> str:
    """``'experiments/x.py' line 12``: the innermost line of ``path`` in ``err``'s traceback."""
    line = None
    if (
        isinstance(err, SyntaxError)
        and err.filename
        and Path(err.filename).resolve() == path.resolve()
    ):
        line = err.lineno  # raised while compiling the file: no frame of it to point at
    for frame in traceback.extract_tb(err.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{str(path)!r}" + (f" line {line}" if line else "")


def load_config(path: str | Path, kind: type) -> Any:
    """Import an experiment file and call its ``config()``, which must return a ``kind``
    (``TrainConfig``: :func:`a3po_jax.training.config.load_experiment`).

    Raises:
      ConfigError: for a missing file, one that fails to import, has no ``config()``, or
        whose ``config()`` raises or returns something other than a ``kind``.
    """
    path = Path(path)
    module = import_experiment(path)
    if not hasattr(module, "config"):
        raise ConfigError(f"experiment file {str(path)!r} has no config() function")
    try:
        config = module.config()
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"experiment file {_where(path, err)}: config() raised {_describe(err)}"
        ) from err
    if not isinstance(config, kind):
        raise ConfigError(f"{path}: config() returned {type(config).__name__}, not {kind.__name__}")
    return config
