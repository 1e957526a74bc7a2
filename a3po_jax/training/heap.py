"""Freed heap memory back to the operating system while training runs (glibc).

Training layer (host-side shell).

On a CPU every array lives in host memory, and XLA:CPU allocates it with ``malloc``. glibc
keeps what is freed for reuse: blocks above its mmap threshold go back to the system at
``free``, but the threshold rises (up to 32 MiB) as large blocks are freed, and from then on
the many medium blocks of a step (activations, gradients of one layer, the host's decode
temporaries) are carved from heaps that do not shrink while a live block sits above the
free ones, and each thread (the trainer's, the embedded host's) has its own. The process's
resident memory then creeps up step after step with the same live arrays between steps
(docs/performance.md, "Memory of the main job").

``trim()`` calls ``malloc_trim(0)``, which hands every free page of every heap back
(``madvise``); what is touched again is page-faulted once. Elsewhere (musl, macOS, Windows)
there is no ``malloc_trim`` and ``trim()`` does nothing. The trainer runs a `Trimmer`, a
thread calling it every ``system.run.trim_heap_every_s`` seconds: memory is freed at many
points (the step's end, a weight push, the host's swap to new weights, in two threads), so
a trim at a fixed point of the step leaves more resident than one on a clock, at the same
seconds per step (docs/log.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

__all__ = ["MMAP_THRESHOLD_BYTES", "Trimmer", "mmap_large_blocks", "trim"]

# Blocks from this size up are mmapped and unmapped at free (glibc's M_MMAP_THRESHOLD, fixed):
# the embedded host's per-layer weights (1-7 MiB) are made anew at every weight push, and in
# the heaps they spread the live blocks over more and more pages (docs/performance.md).
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's function ``name`` (the library this process already runs on, glibc
    on Linux), typed, or None where it has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def _malloc_trim():
    """glibc's ``int malloc_trim(size_t pad)``, or None where the C library has none."""
    return _libc("malloc_trim", [ctypes.c_size_t])


@functools.cache
def _mallopt():
    """glibc's ``int mallopt(int param, int value)``, or None where the C library has none."""
    return _libc("mallopt", [ctypes.c_int, ctypes.c_int])


def mmap_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serves every block of ``threshold`` bytes or more with its own mmap from now on, so
    that freeing it returns it to the system at once; True if glibc took the setting.

    glibc's default threshold rises (up to 32 MiB) as large blocks are freed, and blocks under
    it come from the heaps. Fixing it keeps blocks of a few MiB, made and freed at every step
    in two threads, from scattering the heaps' live blocks; where the bytes live does not
    change what is computed."""
    fn = _mallopt()
    return bool(fn(_M_MMAP_THRESHOLD, int(threshold))) if fn is not None else False


def trim() -> bool:
    """Returns freed heap pages to the system; True if any were released (glibc), False if
    none were or there is no ``malloc_trim``. Thread-safe (glibc locks each arena); costs
    a walk over the free blocks, milliseconds for gigabytes."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


class Trimmer:
    """A daemon thread calling `trim()` every `period_s` seconds until `close()`.

    From its start, blocks of `mmap_threshold_mib` MiB and up are mmapped
    (`mmap_large_blocks`; ``system.run.mmap_threshold_mib``): what the trimmer cannot hand
    back is pages a live block pins. 0 leaves glibc's own threshold: more resident memory,
    fewer page faults (docs/performance.md). The environment's A3PO_MMAP_LARGE_BLOCKS=0
    leaves it too, whatever the run asks: a process compiling thousands of programs, as a
    test worker does, compiles about a tenth slower with it fixed.
    """

    def __init__(self, period_s: float, *, mmap_threshold_mib: int = MMAP_THRESHOLD_BYTES >> 20):
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        if mmap_threshold_mib < 0:
            raise ValueError(f"mmap_threshold_mib must be >= 0, got {mmap_threshold_mib!r}")
        self.mmap_threshold_mib = int(mmap_threshold_mib)  # as asked (0 = glibc's own)
        # Whether glibc took the fixed threshold (not where the environment said no).
        self.mmap_threshold_set = False
        if mmap_threshold_mib and os.environ.get("A3PO_MMAP_LARGE_BLOCKS", "1") != "0":
            self.mmap_threshold_set = mmap_large_blocks(self.mmap_threshold_mib << 20)
        self.period_s = float(period_s)
        self.trims = 0  # calls made so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-trimmer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            trim()
            self.trims += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
