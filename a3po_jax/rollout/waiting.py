"""The one wait loop of the rollout queue and the staleness controller, and the exceptions
that end a wait (rollout layer, host side; plain Python, never enters jit).

:func:`wait_until` waits on a condition until a callable has something to return, with a
timeout (:class:`RolloutTimeout`, the counters in its message), an interruption
(:class:`WaitInterrupted`, a SIGTERM to the trainer) and a close (:class:`QueueClosed`,
raised by the callable) as the ways out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# How often an interruptible wait asks whether to stop: well inside a preemption notice.
INTERRUPT_POLL_S = 0.25


class WaitInterrupted(Exception):
    """The waiter asked to stop (a SIGTERM to the trainer) before what it waited for came;
    nothing was taken."""


class RolloutTimeout(TimeoutError):
    """No batch (or no room) arrived in time; the message carries the queue counters so a
    dead or stalled producer is visible in the trainer's traceback."""


class QueueClosed(RuntimeError):
    """The queue or controller was closed while a caller waited on it (or before)."""


def wait_until(
    cond: threading.Condition,
    ready: Callable[[], T | None],
    *,
    timeout: float | None,
    timeout_message: Callable[[], str],
    interrupted: Callable[[], bool] | None = None,
) -> T:
    """The one wait loop of the queue and the controller: with ``cond`` held, calls
    ``ready()`` until it returns something other than None, and returns that.

    ``ready`` runs under the lock each time the condition is notified; it may raise (e.g.
    ``QueueClosed``) to end the wait. After ``timeout`` seconds (None: never) raises
    :class:`RolloutTimeout` with ``timeout_message()``, computed under the lock so it can
    show the counters at that moment. With ``interrupted``, it is asked at least every
    `INTERRUPT_POLL_S` and a true answer raises :class:`WaitInterrupted` (a signal handler
    cannot notify the condition, so the wait comes round to ask).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        result = ready()
        if result is not None:
            return result
        if interrupted is not None and interrupted():
            raise WaitInterrupted("stop requested while waiting for rollouts")
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise RolloutTimeout(timeout_message())
        if interrupted is not None:
            remaining = INTERRUPT_POLL_S if remaining is None else min(remaining, INTERRUPT_POLL_S)
        cond.wait(remaining)
