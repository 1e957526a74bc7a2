"""JAX compilation in a run: the persistent compilation cache (``system.run.compile_cache_dir``)
and the seconds spent compiling (``time/compile_s``).

Training layer (host-side shell).

Every new shape of the train step, the decode step or a prefill bucket compiles once per
process (what that costs: docs/performance.md, "Against TRL and Tunix"). With the cache
on, an executable is written under its key (the program, XLA flags, devices, JAX version)
and a later process that meets the same program loads it instead of compiling: a re-run, a
resumed run, the next run of a sweep, the split host's process.

The process's own choice wins: where JAX already has a cache directory
(``JAX_COMPILATION_CACHE_DIR``, or ``jax.config`` set by the caller, as the test suite does)
or the cache is turned off (``JAX_ENABLE_COMPILATION_CACHE=false``), the run leaves it so.
The directory is made readable and writable by its owner only: JAX trusts what it loads
from it (https://docs.jax.dev/en/latest/persistent_compilation_cache.html).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

__all__ = [
    "COMPILE_EVENTS",
    "DEFAULT_DIR",
    "ProgramBound",
    "compile_seconds",
    "enable",
    "environment",
]

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/a3po_jax/jax_compilation_cache"


def environment(directory: str | Path) -> dict[str, str]:
    """The environment variables that put a process's cache in ``directory``, every program
    cached: a run's many small ones load as fast as they compile, its big ones faster. The
    cache is turned on too, whatever the environment they are added to says."""
    return {
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        "JAX_COMPILATION_CACHE_DIR": str(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def enable(directory: str, *, setting: str = "system.run.compile_cache_dir") -> str | None:
    """Turns JAX's persistent compilation cache on in ``directory`` (``~`` expanded, made
    if missing), unless the process already chose: returns the directory programs are
    cached in, or None when there is none (``directory`` empty, or the cache turned off).
    The environment gets the same settings, so the processes a run starts (the split host)
    share the cache. A directory that cannot be made is a ValueError naming ``setting``."""
    import jax  # here: the config imports DEFAULT_DIR without starting JAX

    if not jax.config.jax_enable_compilation_cache:
        return None
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        if directory and Path(os.path.expanduser(directory)) != Path(chosen):
            log.info("compilation cache: keeping the process's %s (not %s)", chosen, directory)
        return str(chosen)
    if not directory:
        return None
    path = Path(os.path.expanduser(directory))
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{setting}={directory!r} cannot be made: {err}") from err
    env = environment(path)
    os.environ.update(env)
    jax.config.update("jax_compilation_cache_dir", env["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("compilation cache: %s", path)
    return str(path)


# JAX's duration events on one program's way to an executable, one of each per program
# (jax/_src/dispatch.py): tracing, lowering to MLIR, and XLA's compile or the cache's load.
COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)
_clock = {"seconds": 0.0, "listening": False}
_clock_lock = threading.Lock()


def _count(event: str, seconds: float, **_) -> None:
    if event in COMPILE_EVENTS:
        with _clock_lock:
            _clock["seconds"] += seconds


def compile_seconds() -> float:
    """Seconds this process has spent making JAX executables (tracing, lowering, compiling or
    loading from the persistent cache), in all its threads, since its first call: the step
    record's ``time/compile_s`` is the difference between two calls."""
    with _clock_lock:
        if not _clock["listening"]:
            import jax

            jax.monitoring.register_event_duration_secs_listener(_count)
            _clock["listening"] = True
        return _clock["seconds"]


class ProgramBound:
    """At most ``limit`` input shapes' compiled programs of a jitted function kept in memory
    (``system.run.max_train_programs``; 0 = every one).

    Each new packed shape of the train step compiles a program that stays resident in the
    process (tens of MiB on SmolLM2; docs/performance.md, "The main job"). Called with a
    step's input arrays before the step runs: when they have a shape not seen since the
    last clearing and ``limit`` shapes are already kept, the function's in-memory programs
    are dropped (``clear_cache``), and the shapes met after that compile again, or load from
    the persistent compilation cache. A program compiled again is the same program: the
    step computes the same numbers.
    """

    def __init__(self, fn, limit: int):
        if limit < 0:
            raise ValueError(f"ProgramBound: limit={limit} must be >= 0 (0 = no bound)")
        self.fn, self.limit = fn, limit
        self.shapes: set[tuple] = set()
        self.clears = 0

    def __call__(self, arrays) -> bool:
        """Notes the shapes of ``arrays`` (a mapping of arrays); True if this call dropped
        the function's programs."""
        key = tuple(sorted((name, tuple(a.shape), str(a.dtype)) for name, a in arrays.items()))
        if key in self.shapes:
            return False
        cleared = bool(self.limit) and len(self.shapes) >= self.limit
        if cleared:
            self.fn.clear_cache()
            self.shapes.clear()
            self.clears += 1
            log.info("dropped %s's compiled programs (%d shapes kept at most)", self.fn, self.limit)
        self.shapes.add(key)
        return cleared
