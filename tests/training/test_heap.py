"""training/heap.py: freed heap memory goes back to the operating system (glibc), so a CPU
run's resident memory follows its live arrays instead of creeping up (issue 15)."""

import ctypes
import os
import subprocess
import sys
import time

import pytest

from a3po_jax.training import heap

LIBC = ctypes.CDLL(None)
GLIBC = hasattr(LIBC, "malloc_trim")
MiB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # 64 KiB on some ARM


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_returns_the_freed_middle_of_the_heap():
    malloc, free = LIBC.malloc, LIBC.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    block, n = 64 * 1024, 2048  # 128 MiB in blocks below glibc's mmap threshold: heap memory
    blocks = [malloc(block) for _ in range(n)]
    assert all(blocks)
    for p in blocks:
        ctypes.memset(p, 1, block)  # resident
    top = malloc(block)  # allocated last, above the others: the heap cannot shrink past it
    try:
        before = rss_bytes()
        for p in blocks:
            free(p)
        freed = rss_bytes()
        # free() keeps the memory: this is the creep trim() exists for.
        assert freed > before - 32 * MiB, (before, freed)
        assert heap.trim()
        trimmed = rss_bytes()
        assert trimmed < freed - 96 * MiB, (freed, trimmed)
    finally:
        free(top)


# In a fresh process: a worker's heap, after other tests, has free chunks large enough to
# serve the blocks, and malloc takes a free chunk before it considers an mmap.
MMAP_CHILD = """
import ctypes, os
from a3po_jax.training import heap
LIBC = ctypes.CDLL(None)
malloc, free = LIBC.malloc, LIBC.free
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
free.argtypes = [ctypes.c_void_p]
MiB = 2**20

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

if os.environ["SET"] == "1":
    assert heap.mmap_large_blocks()
# Blocks of a few MiB, as the host's per-layer weights are; a large freed block raises
# glibc's default threshold above them (heap memory, kept at free).
free(malloc(16 * MiB))
blocks = [malloc(2 * MiB) for _ in range(64)]
assert all(blocks)
for p in blocks:
    ctypes.memset(p, 1, 2 * MiB)
top = malloc(2 * MiB)  # allocated last: in the heap it would keep the others resident
ctypes.memset(top, 1, 2 * MiB)
before = rss()
for p in blocks:
    free(p)
print((before - rss()) // MiB)
"""


def released_at_free_mib(set_threshold: bool) -> int:
    env = {**os.environ, "SET": "1" if set_threshold else "0"}
    out = subprocess.run(
        [sys.executable, "-c", MMAP_CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="mallopt's M_MMAP_THRESHOLD is glibc's")
def test_blocks_from_the_threshold_up_go_back_at_free():
    # 128 MiB freed in 2 MiB blocks: all of it back at once with the threshold fixed (what
    # the trainer's Trimmer sets), none of it without (kept in the heap until a trim).
    assert released_at_free_mib(True) >= 120
    assert released_at_free_mib(False) < 32


@pytest.mark.parametrize(
    "setting, mib, calls",
    [("1", None, [1 << 20]), ("1", 4, [4 << 20]), ("1", 0, []), ("0", None, []), ("0", 4, [])],
)
def test_the_trimmer_fixes_the_threshold_unless_told_not_to(monkeypatch, setting, mib, calls):
    # The run's system.run.mmap_threshold_mib (default 1 MiB; 0 = glibc's own), unless the
    # environment's A3PO_MMAP_LARGE_BLOCKS=0 says to leave glibc's threshold.
    called = []
    monkeypatch.setattr(heap, "mmap_large_blocks", lambda size: called.append(size) or True)
    monkeypatch.setenv("A3PO_MMAP_LARGE_BLOCKS", setting)
    kwargs = {} if mib is None else {"mmap_threshold_mib": mib}
    trimmer = heap.Trimmer(1.0, **kwargs)
    trimmer.close()
    assert called == calls
    assert trimmer.mmap_threshold_set is bool(calls)  # what a benchmark reports it ran under


def test_a_negative_mmap_threshold_is_refused_naming_the_field():
    from a3po_jax.training.config import ConfigError, RunSection

    with pytest.raises(ConfigError, match="system.run.mmap_threshold_mib"):
        RunSection(mmap_threshold_mib=-1)
    with pytest.raises(ValueError, match="mmap_threshold_mib"):
        heap.Trimmer(1.0, mmap_threshold_mib=-1)


def test_mmap_threshold_without_mallopt_does_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_mallopt", lambda: None)
    assert heap.mmap_large_blocks() is False


def test_trim_without_malloc_trim_does_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert heap.trim() is False


def test_trimmer_trims_until_closed(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(time.monotonic()) or True)
    trimmer = heap.Trimmer(0.01)
    deadline = time.monotonic() + 10
    while trimmer.trims < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    trimmer.close()
    assert trimmer.trims >= 3 and len(calls) == trimmer.trims
    after = len(calls)
    time.sleep(0.05)
    assert len(calls) == after  # closed: no more trims
    with pytest.raises(ValueError, match="period_s"):
        heap.Trimmer(0)
