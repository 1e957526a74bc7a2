"""Stopping a run on request: SIGTERM (a preemption notice) and SIGINT (Ctrl-C).

Training layer (host-side shell).

The first stop signal only sets a flag (:func:`install_sigterm_handler`); the trainer saves
a checkpoint at the next step boundary, or at once while it waits for rollouts, and stops.
A second one ends the process at once (:func:`exit_now`: exit code 130 / 143 and one line
saying so). :func:`arm_stop_deadline` bounds the whole stop for an entry point that owns
its process: it ends within :data:`STOP_DEADLINE_S` of the first signal wherever the main
thread is (inside an XLA compile, a blocked write). No heavy imports: ``a3po-train``
installs these before it loads anything.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any


class TerminationFlag:
    """Set by :func:`install_sigterm_handler` when a signal arrives; the training loop
    checks ``is_set()`` between steps, saves with ``force=True`` and exits."""

    def __init__(self):
        self._event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signum: int | None = None) -> None:
        """Sets the flag by hand (e.g. the trainer's own stop condition, or tests)."""
        self.signum = signum
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def uninstall(self) -> None:
        """Puts back the handlers that were installed before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


# The signals that ask a run to stop: SIGTERM (a scheduler's preemption notice) and SIGINT
# (Ctrl-C) alike.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a run asked to stop may take to save and stop by itself before
# :func:`arm_stop_deadline` ends it: inside a scheduler's preemption notice (commonly half a
# minute), with room to exit.
STOP_DEADLINE_S = 25.0
_exit_lock = threading.Lock()


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a stop request"


def exit_now(signum: int, message: str) -> None:
    """Writes ``a3po-train: <message>`` to stderr and ends the process at once with the
    shell's code for the signal (128 + signum: 130 for SIGINT, 143 for SIGTERM). No
    cleanup runs: a checkpoint being written is left unfinished, which the next run sets
    aside (its previous complete step is the one restored)."""
    with _exit_lock:  # the handler and the deadline thread may both get here
        os.write(2, f"a3po-train: {message}\n".encode(errors="replace"))
        os._exit(128 + signum)


def _second_signal(signum: int, first: int | None) -> str:
    return (
        f"second stop signal ({signal_name(signum)} after {signal_name(first)}): exiting now "
        "without waiting for a checkpoint"
    )


def install_sigterm_handler(
    callback: Callable[[int], None] | None = None,
    *,
    signals: Iterable[int] = (signal.SIGTERM,),
    exit_on_second: bool = False,
) -> TerminationFlag:
    """Installs a handler that only sets a flag (and calls ``callback(signum)``).

    Saving from inside a signal handler is unsafe (it interrupts the main thread anywhere,
    e.g. halfway through an optimizer update or inside orbax), so the handler just records
    the request; keep ``callback`` as small (log a line). A second signal:

    * with ``exit_on_second`` (the trainer's, over :data:`STOP_SIGNALS`): any second one
      ends the process at once (:func:`exit_now`, exit code 130 / 143, one line saying so);
    * otherwise a second signal of the same kind restores the previous handler and
      re-sends the signal, so a stuck run can still be stopped (with the default SIGTERM
      action: the process ends).

    Must be called from the main thread (a Python rule for signal handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_handler must be called from the main thread")
    flag = TerminationFlag()

    def handler(signum, frame):
        if flag.is_set() and exit_on_second:
            exit_now(signum, _second_signal(signum, flag.signum))
        if flag.is_set() and flag.signum == signum:
            previous = flag._previous.pop(signum, None)
            # None: the previous handler was not installed from Python; use the default.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)
            return
        flag.set(signum)
        if callback is not None:
            callback(signum)

    for signum in signals:
        flag._previous[signum] = signal.signal(signum, handler)
    return flag


def arm_stop_deadline(
    describe: Callable[[], str], *, seconds: float = STOP_DEADLINE_S
) -> Callable[[], None]:
    """Bounds how long this process takes to end once asked to stop, wherever it is.

    Python runs signal handlers in the main thread between bytecodes, so a main thread
    inside a long C call (an XLA compile, a blocked write) would not even notice a
    signal. Here the interpreter's C-level handler also writes each signal's number to a
    pipe (``signal.set_wakeup_fd``), which a daemon thread reads: at the first stop signal
    it starts a ``seconds`` countdown, at a second one it ends the process at once; when
    the countdown runs out it ends the process with a line saying so and ``describe()``
    (e.g. which checkpoint ``--resume`` would continue from). The stop signals need
    Python handlers for the pipe to be written (:func:`install_sigterm_handler`).

    For an entry point that owns its process (``a3po-train``); call from the main thread.
    Returns the function that takes it back (the previous wakeup fd, no countdown).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    timers: list[threading.Timer] = []

    def watch() -> None:
        while chunk := os.read(read_fd, 64):  # b"": disarmed
            for signum in chunk:
                if signum not in STOP_SIGNALS:
                    continue
                if timers:
                    exit_now(signum, _second_signal(signum, timers[0].args[0]))
                timer = threading.Timer(seconds, late, args=(signum,))
                timer.daemon = True  # a run that stops by itself exits without waiting
                timers.append(timer)
                timer.start()
        os.close(read_fd)

    def late(signum: int) -> None:
        exit_now(
            signum,
            f"{signal_name(signum)} {seconds:g} s ago and the run has not stopped: exiting "
            f"now; {describe()}",
        )

    def disarm() -> None:
        signal.set_wakeup_fd(previous)
        for timer in timers:
            timer.cancel()
        os.close(write_fd)

    threading.Thread(target=watch, name="a3po-stop-deadline", daemon=True).start()
    return disarm
