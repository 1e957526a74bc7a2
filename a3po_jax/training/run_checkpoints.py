"""A run's checkpoints as the loop uses them: what a save holds, the resume, the save on a
stop (:class:`RunCheckpoints`).

Training layer (host-side shell). The files and their format are
:mod:`a3po_jax.training.checkpointing`'s; this module decides what goes in them:

* the train state, the rollout workers' state (prompt iterator, counters, pending groups) and
  the skipped-step count;
* in the schedules that hold groups (``Schedule.holds_groups``: one-step-off and async), the
  complete untrained groups beside it, after letting the groups in flight from older
  weights complete (a resume could not regenerate them exactly);
* on resume the ledger's events after the checkpoint are voided and the held groups go back
  to the workers as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from a3po_jax.rollout.queue import RolloutTimeout
from a3po_jax.training.checkpointing import (
    CheckpointManager,
    prune_held_groups,
    read_held_groups,
    restore_train_state,
    save_train_state,
    write_held_groups,
)
from a3po_jax.training.stopping import signal_name

log = logging.getLogger(__name__)


class RunCheckpoints:
    """Saves and resumes one run (its trainer calls it at step boundaries).

    Args:
      manager: the run's checkpoint manager.
      workers: the rollout source (``state``, ``snapshot``, ``settle``, ``restore``).
      schedule: the mode's schedule (``holds_groups``, ``settle_older_than``).
      book: the step book (the skipped-step count saved and restored).
      leader: whether this is process 0 (the only one that holds groups).
      rollout_timeout_s: how long a save waits for the groups in flight to complete.
      interrupted: what ends that wait early (a stop request), or None.
      stop_signum: the signal a stop came with (for the log lines), read when needed.
      trim: hands freed heap pages back after a synchronous save (None: no trimming).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        workers: Any,
        schedule: Any,
        book: Any,
        leader: bool,
        rollout_timeout_s: float,
        interrupted: Callable[[], bool] | None,
        stop_signum: Callable[[], int | None],
        trim: Callable[[], None] | None,
    ):
        self.manager = manager
        self.workers, self.schedule, self.book = workers, schedule, book
        self.leader = leader
        self.rollout_timeout_s = rollout_timeout_s
        self.interrupted = interrupted
        self.stop_signum = stop_signum
        self.trim = trim

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, *, force: bool = False) -> None:
        """Saves ``state`` as step ``step`` when due (every ``checkpoint_every``) or forced."""
        hold = self.leader and self.schedule.holds_groups
        hold = hold and (force or self.manager.should_save(step))
        if hold:
            self._settle_in_flight(step, int(state.step))
            workers, held = self.workers.snapshot(hold=True)
            # Before the save starts: a committed step always has its groups.
            write_held_groups(self.manager, step, held, trainer_version=int(state.step))
        else:
            workers = self.workers.state()
        extra = {**workers, "skipped_steps": self.book.skipped_steps}
        saved = save_train_state(self.manager, step, state, extra=extra, force=force)
        if hold:
            prune_held_groups(self.manager, keep=step)  # (orbax dropped old steps)
        if saved and not self.manager.async_save and self.trim is not None:
            self.trim()  # the write's buffers, before the next step's temporaries

    def _settle_in_flight(self, step: int, version: int) -> None:
        """Lets the groups in flight that a resume could not regenerate exactly complete
        (`RolloutWorkers.settle`); the uninterrupted run does the same at the same step, so
        both go on alike. A stop request ends the wait: those groups are then re-issued on
        resume, with the saved weights."""
        timeout = self.rollout_timeout_s
        try:
            settled = self.workers.settle(
                older_than=self.schedule.settle_older_than(version),
                timeout=timeout,
                interrupted=self.interrupted,
            )
        except RolloutTimeout as err:
            raise RolloutTimeout(
                f"checkpoint of step {step}: the groups in flight from older weights did not "
                f"complete within system.hosts.rollout_timeout_s={timeout}s: {err}"
            ) from err
        if not settled:
            log.warning(
                "%s: saving step %d without waiting for the groups in flight (a resume "
                "regenerates them with the saved weights)",
                signal_name(self.stop_signum()),
                step,
            )

    def resume(self, state: Any, ledger: Any) -> tuple[Any, int]:
        """The newest complete checkpoint restored into ``state``'s structure and the step to
        continue from (``state`` and 0 when there is none). The caller pushes the resumed
        weights to the host before it generates anything."""
        step = self.manager.latest_step()
        if step is None:
            log.info("no checkpoint in %s: starting fresh", self.manager.directory)
            return state, 0
        state, extra, step = restore_train_state(self.manager, state)
        version = int(extra["version"])
        if ledger is not None:  # voids the ledger's events after this checkpoint
            ledger.resume(step, version=version)
        held_ids = extra.get("held_groups")
        if held_ids:  # complete groups saved with the checkpoint: back as they were
            held = read_held_groups(self.manager, step, held_ids)
            self.workers.restore(extra, version=version, held=held)
        else:
            self.workers.restore(extra, version=version)
        self.book.resumed(int(extra.get("skipped_steps", 0)))
        log.info("resumed from step %d (version %d)", step, version)
        return state, step

    def save_on_stop(self, step: int, state: Any, what: str) -> None:
        """A stop (``what``: the signal and when it came) with ``step`` steps done: saves
        them unless they are saved already or nothing was trained."""
        self.manager.wait_until_finished()  # an asynchronous save counts once on disk
        if step == 0:
            log.warning("%s: stopping before any step trained (no checkpoint to make)", what)
        elif self.manager.latest_step() == step:
            log.warning("%s: step %d is saved; stopping", what, step)
        else:
            log.warning("%s: saving step %d and stopping", what, step)
            self.save(step, state, force=True)
