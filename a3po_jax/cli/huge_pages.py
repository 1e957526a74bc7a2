"""Transparent huge pages for XLA:CPU's buffers: the entry points restart once with them on.

CLI layer (entry points): only the entry points (and the benchmarks) import it; nothing in
the rest of the package does.

XLA:CPU maps each program's temporaries afresh at every execution and unmaps them after it
(one ``mmap`` of 1.26 GiB per quickstart train step), and every array it allocates is a
fresh mapping too. Where the kernel's transparent huge pages are in ``madvise`` mode (the
usual default), those mappings get 4 KiB pages: a train step takes some 330 000 page faults
and its matmuls miss the TLB at every 4 KiB. glibc's tunable ``glibc.malloc.hugetlb=1``
(glibc >= 2.35) makes malloc advise the kernel to back its mappings with 2 MiB pages. On the
2-core AMD EPYC it took the a3po step at SmolLM2 shapes from 2.98 to 2.72 s (README,
"Huge pages"); values are unchanged: the same programs run on the same numbers.

glibc reads its tunables once, when the process starts, so a running interpreter cannot
turn them on. ``reexec_with_huge_pages`` therefore replaces the process (``os.execve``,
same PID, same arguments) with one whose environment has the tunable, once, before
anything heavy is imported. It does nothing where it cannot help (not Linux, glibc older
than 2.35, huge pages ``never``), when ``GLIBC_TUNABLES`` already sets
``glibc.malloc.hugetlb`` (the user's choice wins), or when ``A3PO_HUGE_PAGES=0``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
ENABLE = f"{TUNABLE}=1"
OPT_OUT_ENV = "A3PO_HUGE_PAGES"  # "0": never restart for huge pages
# Set in the restarted process: a second restart can never happen, whatever glibc did with
# GLIBC_TUNABLES (it may drop tunables it does not know).
RESTARTED_ENV = "A3PO_HUGE_PAGES_RESTARTED"
MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``: the
    bracketed word of ``enabled``), or None where there is no such file (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library, or None when it is not glibc (musl, macOS)."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (ValueError, OSError, AttributeError):
        return None
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def huge_page_env(
    environ: Mapping[str, str], *, thp: str | None, glibc: tuple[int, int] | None
) -> dict[str, str] | None:
    """The environment to restart with (``environ`` plus ``glibc.malloc.hugetlb=1`` in
    ``GLIBC_TUNABLES``, other tunables kept), or None when no restart is wanted: opted out,
    restarted already, the tunable set by the user, huge pages unavailable or ``never``,
    or a C library that does not know the tunable."""
    if environ.get(OPT_OUT_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if environ.get(RESTARTED_ENV):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(item.split("=")[0] == TUNABLE for item in tunables.split(":") if item):
        return None
    if thp not in ("always", "madvise") or glibc is None or glibc < MIN_GLIBC:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{ENABLE}" if tunables else ENABLE
    env[RESTARTED_ENV] = "1"
    return env


def reexec_with_huge_pages() -> None:
    """Restart this interpreter with huge pages on (see the module docstring), or return.

    Call it first thing in a program's entry point (never from library code: it replaces
    the process). The restarted process runs the same command line (``sys.orig_argv``:
    ``-m module`` and interpreter flags included) in the same PID, stdin and stdout.
    """
    env = huge_page_env(os.environ, thp=thp_mode(), glibc=glibc_version())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def anon_huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory in transparent huge pages (``AnonHugePages``
    of ``/proc/self/smaps_rollup``), or None where the kernel does not report it."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def status() -> str:
    """One line for a benchmark's header: whether malloc asks for huge pages, and how much
    of this process sits in them now."""
    on = ENABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
    held = anon_huge_page_bytes()
    held_text = "" if held is None else f", {held / 2**30:.2f} GiB in 2 MiB pages now"
    return f"huge pages {'on' if on else 'off'} (THP {thp_mode() or 'n/a'}{held_text})"
