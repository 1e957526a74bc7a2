"""Run a Python snippet in a fresh interpreter (a clean ``sys.modules``), for tests of what
a process imports or does at start-up."""

from __future__ import annotations

import subprocess
import sys


def run_snippet(code: str, *args: str, timeout: float = 300) -> str:
    """``python -c code args...``; fails the test with the snippet's stderr unless it exits
    0, else returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
