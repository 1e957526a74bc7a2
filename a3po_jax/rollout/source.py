"""The interface a run's batches come from: the rollout workers, or a recording in a replay.

Rollout layer (host-side shell). `RolloutWorkers` (producer and collector threads over an
inference host) and `a3po_jax.training.recording.ReplaySource` (the groups a run recorded,
step by step) both satisfy `RolloutSource`, so the trainer and the schedules are written
once for both.
"""

from __future__ import annotations

from typing import Any, Protocol

from a3po_jax.core.types import RolloutGroup


class RolloutSource(Protocol):
    """What the trainer and its schedule use of where the groups come from (by name)."""

    queue: Any  # the queue the groups wait in (its ``counters()``)

    def close(self, reason: str = "trainer finished") -> None:
        """Stops producing."""

    def consumed(self, groups: list[RolloutGroup], **kwargs: Any) -> None:
        """The trainer trained (or skipped) ``groups`` at a step: the ledger's events."""

    def discard(self, num_groups: int) -> None:
        """Gives back the admissions of a batch that was not trained."""

    def get_batch(self, num_groups: int, *, trainer_version: int, **wait: Any) -> list:
        """``num_groups`` whole groups (fewer when dynamic sampling left slots empty);
        ``wait`` is the queue's ``timeout`` and ``interrupted``."""

    def reward_stats(self) -> dict[str, float]:
        """The reward stage's ``seconds`` spent scoring so far and, for a scorer with
        weights, their ``param_bytes`` (empty where nothing is scored: a replay reads the
        recorded rewards)."""

    def notify_version(self, version: int) -> None:
        """The trainer's version moved on: the producer may admit more."""

    def raise_if_failed(self) -> None:
        """Re-raises the failure of a background thread, if any."""

    def restore(self, state: dict, *, version: int, **kwargs: Any) -> None:
        """Resumes from a checkpoint's ``state``."""

    def start(self) -> None:
        """Starts producing (threads, or nothing in a replay)."""

    def state(self) -> dict:
        """What a checkpoint saves to resume from."""
