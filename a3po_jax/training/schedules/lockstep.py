"""Lockstep (``system.lockstep_decode_steps``): the trainer's thread drives the embedded
host one decode step at a time, so a run's asynchrony is the same on every run.

Training layer (host-side shell). A wrapper around the mode's schedule, not a mode.
"""

from __future__ import annotations

from a3po_jax.core.types import RolloutGroup
from a3po_jax.rollout.queue import RolloutTimeout, WaitInterrupted
from a3po_jax.training.schedules.base import Schedule, Trained, Wrapped


class Lockstep(Wrapped):
    """The mode's schedule with the host driven from the trainer's thread: the batch is
    generated decode step by decode step until it is there, and ``decode_steps`` more run
    while each dispatched train step computes.

    A checkpoint holds the groups in flight (several versions generated them); the heap is
    not trimmed after a push (the swap comes with the next decode step this thread runs);
    one-step-off's wait before a push is not needed (nothing runs behind this thread)."""

    def __init__(self, inner: Schedule, decode_steps: int):
        super().__init__(inner)
        inner.producer_behind = self.producer_behind = False
        self.holds_groups = True
        self.decode_steps = decode_steps

    def train(self, version: int, timings: dict[str, float]) -> Trained | None:
        return Schedule.train(self, version, timings)

    def take(self, version: int) -> list[RolloutGroup]:
        """The step's batch, driving the host until it is there; `WaitInterrupted` on a
        stop request."""
        run = self.run
        stop = run.stop_while_waiting()
        while True:
            try:
                return run.workers.get_batch(run.batch_groups, trainer_version=version, timeout=0)
            except RolloutTimeout:
                pass
            if stop is not None and stop():
                raise WaitInterrupted("stop requested while generating the batch")
            if not run.workers.drive():
                try:  # a sample filed by the last iteration may have completed it
                    return run.workers.get_batch(
                        run.batch_groups, trainer_version=version, timeout=0
                    )
                except RolloutTimeout:
                    raise RuntimeError(
                        "lockstep: the host has nothing left to generate and the batch is "
                        "not complete (groups lost?)"
                    ) from None

    def while_training(self) -> None:
        for _ in range(self.decode_steps):
            self.run.workers.drive()

    def settle_older_than(self, version: int) -> int | None:
        return None  # every group in flight: several versions generated them

    @property
    def releases_replaced_weights(self) -> bool:
        return False
