"""What the commands share: an argument or input a command refuses is one line on stderr,
naming it, and exit status 2, with nothing written.

CLI layer (entry points): only the commands import it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Refused(Exception):
    """An argument or input the command refuses: the message is printed, the status is 2."""


def run_refusing(prog: str, run: Callable[[Any], int], args: Any) -> int:
    """``run(args)``'s exit status, or 2 with ``prog: message`` on stderr if it refuses."""
    try:
        return run(args)
    except Refused as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
