"""The membership file of a run's remote hosts (``system.placement.hosts_file``): one
``host:port`` per line, re-read by the pool whenever it changes. The run writes it when it
starts and marks it ended when it stops; a host joins by appending its own line
(``cli.serve --join PATH``) and leaves by removing it. Writers take a lock file beside it
(``PATH.lock``), and a rewrite replaces the file whole, so the pool never reads half a file.

Inference layer (remote).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

# The line the run appends when it stops: a host asked to join then is refused by name.
ENDED_LINE = "# ended: the run that watched this file has stopped"


class MembershipError(ValueError):
    """A join or leave the membership file refuses (no run's file, a run that has ended)."""


def read_hosts_file(path) -> list[str]:
    """The ``host:port`` lines of a membership file, in order, without blank lines, ``#``
    comments or repeats. ValueError names a line that is not ``host:port``."""
    out: list[str] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        address = line.split("#", 1)[0].strip()
        if not address:
            continue
        if not is_address(address):
            raise ValueError(f"{path}, line {number}: {address!r} is not host:port")
        if address not in out:
            out.append(address)
    return out


def is_address(address: str) -> bool:
    """Whether ``address`` reads as ``host:port`` with a port in 1..65535."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def has_ended(path) -> bool:
    """Whether the run that watched the file has stopped (its `ENDED_LINE` is there)."""
    return ENDED_LINE in Path(path).read_text().splitlines()


def start_run(path, addresses: Sequence[str]) -> None:
    """A run starts on ``addresses``: writes the file if absent, else checks that it lists
    exactly them (ValueError naming both lists: the run would make the hosts it does not
    list leave at its first look) and drops the ended mark of a run it resumes."""
    file = Path(path).expanduser()
    with _locked(file):
        if not file.exists():
            _replace(file, list(addresses))
            return
        listed = read_hosts_file(file)
        if sorted(listed) != sorted(addresses):
            raise ValueError(
                f"system.placement.hosts_file={str(path)!r} lists {listed}, but the run starts "
                f"with system.placement.inference_hosts={','.join(addresses)}: make them agree "
                "(or remove the file: the run writes it)"
            )
        lines = file.read_text().splitlines()
        if ENDED_LINE in lines:
            _replace(file, [line for line in lines if line != ENDED_LINE])


def end_run(path) -> None:
    """The run has stopped: marks the file so that a host asked to join is refused."""
    file = Path(path).expanduser()
    with _locked(file):
        if file.exists() and not has_ended(file):
            _replace(file, [*file.read_text().splitlines(), ENDED_LINE])


def check_joinable(path) -> None:
    """MembershipError, naming the file, if no running run watches it: it does not exist
    (the run writes it when it starts) or the run has ended."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise MembershipError(
            f"--join {path}: no membership file there; it is written by a run started with "
            f"system.placement.hosts_file={path} (start the run first, or check the path)"
        )
    if has_ended(file):
        raise MembershipError(
            f"--join {path}: the run that watched this file has ended; a host joins a "
            "running job only (start a new run, or resume it, first)"
        )


def join(path, address: str) -> None:
    """Appends ``address`` to a running run's file (the pool then checks the host, pushes it
    the newest weights and routes requests to it). MembershipError as `check_joinable`."""
    if not is_address(address):
        raise MembershipError(f"--join: {address!r} is not host:port")
    file = Path(path).expanduser()
    with _locked(file):
        check_joinable(file)
        if address not in read_hosts_file(file):
            _replace(file, [*file.read_text().splitlines(), address])


def leave(path, address: str) -> bool:
    """Removes ``address``'s lines (the pool stops giving it requests, lets it finish what it
    holds, re-issues the rest); False if it was not listed or the file is gone."""
    file = Path(path).expanduser()
    with _locked(file):
        if not file.is_file():
            return False
        lines = file.read_text().splitlines()
        kept = [line for line in lines if line.split("#", 1)[0].strip() != address]
        if len(kept) == len(lines):
            return False
        _replace(file, kept)
        return True


@contextlib.contextmanager
def _locked(file: Path) -> Iterator[None]:
    """An exclusive lock on ``PATH.lock``: writers of the file take turns."""
    with open(f"{file}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace(file: Path, lines: Sequence[str]) -> None:
    """Writes ``lines`` to a temporary file beside ``file`` and renames it over it."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, file)
