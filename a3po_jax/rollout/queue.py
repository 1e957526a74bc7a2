"""Host-side rollout queue and staleness admission (design §2, §5).

Everything here is plain Python + numpy and never enters jit. Two pieces:

* :class:`StalenessController` decides when the producer may admit a new prompt (a *group*
  of G samples), by AReaL's capacity rule: with a consumer batch of B groups and max
  staleness η, at most ``(η + v + 1)·B`` groups may have been admitted in total while the
  trainer is at version ``v``.
* :class:`RolloutQueue` assembles samples into groups, holds at most ``capacity_groups``
  groups (producers block beyond that: backpressure, never unbounded growth), and hands the
  trainer whole groups, first completed first out, dropping any group with a token staler
  than η.

Wiring (one producer thread, the trainer in the main thread)::

    controller = StalenessController(batch_groups=B, max_staleness=eta)
    queue = RolloutQueue(group_size=G, capacity_groups=(eta + 1) * B, max_staleness=eta,
                         on_drop=lambda group_id, reason: controller.release())
    # producer:  group_id, v_admit = controller.wait_admit()
    #            ... generate G samples; queue.put(Rollout(..., admitted_at_version=v_admit))
    # trainer:   groups = queue.get_batch(B, trainer_version=v, timeout=600.0)
    #            ... train ...; controller.notify_version(v + 1)

The controller bounds the groups in flight to ``(η + 1)·B`` once the consumer takes B per
step, so with ``capacity_groups ≥ (η + 1)·B`` a producer never blocks on the queue; the
queue's own bound is the safety net for producers without a controller.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from a3po_jax.core.types import Rollout, RolloutGroup, oldest_version


class RolloutTimeout(TimeoutError):
    """No batch (or no room) arrived in time; the message carries the queue counters so a
    dead or stalled producer is visible in the trainer's traceback."""


class QueueClosed(RuntimeError):
    """The queue or controller was closed while a caller waited on it (or before)."""


class AdmissionError(RuntimeError):
    """``StalenessController.admit`` was called with no capacity left."""


class StalenessController:
    """AReaL's capacity rule (design §2): with consumer batch size B (in groups) and max
    staleness η, at most ``(η + v + 1)·B`` groups may have been admitted in total while the
    trainer is at version v.

    Why this bounds staleness: if the trainer takes B groups per step in admission order,
    the k-th admitted group (0-based) is trained at version ``⌊k/B⌋``; admitted at version
    ``v_a`` it has ``k < (η + v_a + 1)·B``, so it is trained at most η versions later.
    Groups that will never be consumed (dropped as stale or aborted, lost in a restart) are
    given back with :meth:`release` so they do not eat the budget, as AReaL does for
    rejected rollouts. η = 0 admits B groups per version: synchronous training.

    Group ids are the admission count (0, 1, 2, …), so they stay unique across a resume.
    Thread-safe; ``notify_version``/``wait_admit`` let a producer thread block until the
    trainer's next step instead of polling.
    """

    def __init__(self, *, batch_groups: int, max_staleness: int):
        if not isinstance(batch_groups, int) or batch_groups < 1:
            raise ValueError(f"batch_groups must be an int >= 1, got {batch_groups!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self._admitted = 0  # total admissions ever; also the next group id
        self._released = 0  # admissions given back (dropped or lost groups)
        self._trainer_version = 0  # last version passed to notify_version
        self._closed_reason: str | None = None
        self._cond = threading.Condition()

    # -- the rule ---------------------------------------------------------------------------

    def budget(self, trainer_version: int) -> int:
        """``(η + v + 1)·B``: how many admissions (net of releases) version v allows."""
        if trainer_version < 0:
            raise ValueError(f"trainer_version must be >= 0, got {trainer_version}")
        return (self.max_staleness + trainer_version + 1) * self.batch_groups

    def capacity(self, trainer_version: int) -> int:
        """How many more groups may be admitted now."""
        with self._cond:
            return max(0, self.budget(trainer_version) - (self._admitted - self._released))

    def can_admit(self, trainer_version: int) -> bool:
        return self.capacity(trainer_version) > 0

    def admit(self, trainer_version: int) -> int:
        """Counts one admission and returns its group id; raises ``AdmissionError`` when
        the budget of ``trainer_version`` is spent."""
        with self._cond:
            if self._closed_reason is not None:
                raise QueueClosed(f"StalenessController closed: {self._closed_reason}")
            counted = self._admitted - self._released
            if counted >= self.budget(trainer_version):
                raise AdmissionError(
                    f"no admission capacity at trainer version {trainer_version}: "
                    f"{counted} groups counted (admitted {self._admitted}, released "
                    f"{self._released}) >= (max_staleness {self.max_staleness} + version "
                    f"{trainer_version} + 1) * batch_groups {self.batch_groups}"
                )
            group_id = self._admitted
            self._admitted += 1
            return group_id

    def release(self, num_groups: int = 1) -> None:
        """Gives back admissions of groups that will never be consumed."""
        with self._cond:
            if num_groups < 0 or self._released + num_groups > self._admitted:
                raise ValueError(
                    f"cannot release {num_groups} groups: admitted {self._admitted}, "
                    f"already released {self._released}"
                )
            self._released += num_groups
            self._cond.notify_all()

    @property
    def admitted(self) -> int:
        with self._cond:
            return self._admitted

    @property
    def released(self) -> int:
        with self._cond:
            return self._released

    # -- blocking producer side -------------------------------------------------------------

    def notify_version(self, trainer_version: int) -> None:
        """The trainer reached ``trainer_version``; wakes producers in ``wait_admit``."""
        with self._cond:
            if trainer_version < self._trainer_version:
                raise ValueError(
                    f"trainer version went back from {self._trainer_version} to {trainer_version}"
                )
            self._trainer_version = trainer_version
            self._cond.notify_all()

    def wait_admit(self, timeout: float | None = None) -> tuple[int, int]:
        """Blocks until the last notified version has capacity, then admits.

        Returns:
          ``(group_id, trainer_version)``, the version being the one admitted at (to stamp
          ``Rollout.admitted_at_version``).
        Raises:
          RolloutTimeout after ``timeout`` seconds; QueueClosed once :meth:`close` is called.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed_reason is not None:
                    raise QueueClosed(f"StalenessController closed: {self._closed_reason}")
                version = self._trainer_version
                if self._admitted - self._released < self.budget(version):
                    group_id = self._admitted
                    self._admitted += 1
                    return group_id, version
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RolloutTimeout(
                        f"no admission capacity within {timeout}s at trainer version "
                        f"{version}: {self._admitted - self._released} groups counted, "
                        f"budget {self.budget(version)}"
                    )
                self._cond.wait(remaining)

    def close(self, reason: str = "closed") -> None:
        """Wakes producers blocked in ``wait_admit`` with ``QueueClosed``."""
        with self._cond:
            if self._closed_reason is None:
                self._closed_reason = reason
            self._cond.notify_all()

    # -- checkpointing ----------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-able counters for a checkpoint."""
        with self._cond:
            return {
                "batch_groups": self.batch_groups,
                "max_staleness": self.max_staleness,
                "admitted": self._admitted,
                "released": self._released,
                "trainer_version": self._trainer_version,
            }

    def restore(self, state: dict, *, consumed_groups: int | None = None) -> None:
        """Restores the counters of :meth:`state`.

        Groups in flight at checkpoint time are not saved, so they never arrive after a
        resume. Pass ``consumed_groups`` (the queue's ``consumed_groups`` counter from the
        same checkpoint) to give their admissions back: afterwards exactly the consumed
        groups count against the budget. Group ids keep counting from ``admitted``.
        """
        admitted = int(state["admitted"])
        released = int(state["released"])
        if consumed_groups is not None:
            if not 0 <= consumed_groups <= admitted:
                raise ValueError(
                    f"consumed_groups must be in [0, admitted={admitted}], got {consumed_groups}"
                )
            released = admitted - consumed_groups
        if not 0 <= released <= admitted:
            raise ValueError(f"invalid controller state {state!r}")
        with self._cond:
            self._admitted = admitted
            self._released = released
            self._trainer_version = int(state.get("trainer_version", 0))
            self._cond.notify_all()


@dataclasses.dataclass
class _PendingGroup:
    prompt_id: str
    admitted_at_version: int | None
    samples: dict[int, Rollout]


class RolloutQueue:
    """Thread-safe queue of whole rollout groups between producers and the trainer.

    * ``put`` files a sample under its ``group_id``; a group becomes consumable once all G
      samples arrived. A sample that would open a new group waits while
      ``capacity_groups`` groups (incomplete + complete) are held; samples of groups
      already held are always accepted, so a full queue can still complete its groups.
    * ``get_batch`` returns whole groups in completion order. A group with any token of
      staleness ``trainer_version - v > max_staleness`` is dropped (reason ``"stale"``),
      never returned; so is a still-incomplete group that is already too stale. If not
      enough groups arrive within ``timeout`` it raises :class:`RolloutTimeout` (with the
      counters in the message) and keeps what it has: the trainer notices a dead producer
      instead of training on a short batch.
    * A group with an ``"aborted"`` sample is dropped as ``"aborted"`` (unless
      ``drop_aborted=False``); ``drop_group`` drops one explicitly, e.g. when its host died.
      Samples that arrive later for a dropped group are discarded and counted.
    * ``on_drop(group_id, reason)`` is called (outside the lock) for every dropped group;
      wire it to ``StalenessController.release`` so dropped groups free their admission.

    Invariant (``counters()``):
    ``produced_groups == consumed_groups + dropped_total + pending_groups + ready_groups``,
    where a group counts as produced from its first sample (or its ``drop_group`` call).
    """

    def __init__(
        self,
        *,
        group_size: int,
        capacity_groups: int,
        max_staleness: int | None,
        drop_aborted: bool = True,
        on_drop: Callable[[int, str], None] | None = None,
    ):
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if not isinstance(capacity_groups, int) or capacity_groups < 1:
            raise ValueError(f"capacity_groups must be an int >= 1, got {capacity_groups!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        self.group_size = group_size
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self.drop_aborted = drop_aborted
        self._on_drop = on_drop
        self._cond = threading.Condition()
        self._pending: dict[int, _PendingGroup] = {}
        self._ready: collections.OrderedDict[int, RolloutGroup] = collections.OrderedDict()
        # Dropped group id -> samples still to come; late samples are discarded. Entries of
        # groups whose host died stay (one int each), bounded by the number of such drops.
        self._expect_discard: dict[int, int] = {}
        self._closed_reason: str | None = None
        self._produced_samples = 0
        self._discarded_samples = 0
        self._produced_groups = 0
        self._completed_groups = 0
        self._consumed_groups = 0
        self._consumed_samples = 0
        self._dropped: collections.Counter[str] = collections.Counter()

    # -- producer side ----------------------------------------------------------------------

    def put(self, rollout: Rollout, timeout: float | None = None) -> None:
        """Adds one sample; blocks while a new group would exceed ``capacity_groups``.

        Raises:
          ValueError on a sample index outside [0, G), a duplicate sample index, a
            ``prompt_id``/``admitted_at_version`` differing from the group's, or a sample
            for a group that is already complete.
          RolloutTimeout when no room appeared within ``timeout`` seconds.
          QueueClosed once :meth:`close` was called.
        """
        if not isinstance(rollout, Rollout):
            raise TypeError(f"put expects a Rollout, got {type(rollout).__name__}")
        group_id = rollout.group_id
        if not 0 <= rollout.sample_index < self.group_size:
            raise ValueError(
                f"sample_index {rollout.sample_index} of group {group_id} is outside "
                f"[0, group_size={self.group_size})"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        drops: list[tuple[int, str]] = []
        try:
            with self._cond:
                while True:
                    self._raise_if_closed()
                    if group_id in self._expect_discard:
                        self._discard_late_sample(group_id)
                        return
                    if group_id in self._ready:
                        raise ValueError(
                            f"group {group_id} is already complete ({self.group_size} "
                            f"samples); got sample_index {rollout.sample_index} again"
                        )
                    if group_id in self._pending or self._held_groups() < self.capacity_groups:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise RolloutTimeout(
                            f"put of group {group_id} found no room within {timeout}s: "
                            f"{self._counters_text()}"
                        )
                    self._cond.wait(remaining)
                self._add_sample(rollout, drops)
                self._cond.notify_all()
        finally:
            self._run_drop_callbacks(drops)

    def _add_sample(self, rollout: Rollout, drops: list[tuple[int, str]]) -> None:
        group_id = rollout.group_id
        group = self._pending.get(group_id)
        if group is None:
            group = _PendingGroup(rollout.prompt_id, rollout.admitted_at_version, {})
        else:
            if rollout.sample_index in group.samples:
                raise ValueError(
                    f"duplicate sample_index {rollout.sample_index} for group {group_id}"
                )
            if rollout.prompt_id != group.prompt_id:
                raise ValueError(
                    f"group {group_id} mixes prompt_id {group.prompt_id!r} and "
                    f"{rollout.prompt_id!r}"
                )
            if rollout.admitted_at_version != group.admitted_at_version:
                raise ValueError(
                    f"group {group_id} mixes admitted_at_version "
                    f"{group.admitted_at_version} and {rollout.admitted_at_version}"
                )
        if group_id not in self._pending:
            self._pending[group_id] = group
            self._produced_groups += 1
        group.samples[rollout.sample_index] = rollout
        self._produced_samples += 1
        if self.drop_aborted and rollout.finish_reason == "aborted":
            self._drop_locked(group_id, "aborted", drops)
            return
        if len(group.samples) == self.group_size:
            del self._pending[group_id]
            rollouts = [group.samples[i] for i in range(self.group_size)]
            admitted = group.admitted_at_version
            if admitted is None:
                admitted = oldest_version(rollouts, default=0)
            self._ready[group_id] = RolloutGroup(
                prompt_id=group.prompt_id,
                group_id=group_id,
                rollouts=rollouts,
                admitted_at_version=admitted,
            )
            self._completed_groups += 1

    def _discard_late_sample(self, group_id: int) -> None:
        self._discarded_samples += 1
        self._expect_discard[group_id] -= 1
        if self._expect_discard[group_id] <= 0:
            del self._expect_discard[group_id]

    # -- consumer side ----------------------------------------------------------------------

    def get_batch(
        self, num_groups: int, *, trainer_version: int, timeout: float | None
    ) -> list[RolloutGroup]:
        """Takes ``num_groups`` whole groups, first completed first, after dropping stale ones.

        Args:
          num_groups: groups to return, in [1, capacity_groups].
          trainer_version: the version the returned groups will be trained at; staleness is
            measured against it.
          timeout: seconds to wait for enough groups; None waits forever.
        Returns:
          ``num_groups`` groups, none with a token staler than ``max_staleness``.
        Raises:
          RolloutTimeout if not enough groups arrived in time (nothing is taken).
          QueueClosed once :meth:`close` was called.
          ValueError if a group holds a token newer than ``trainer_version`` (a version
            bookkeeping bug: staleness cannot be negative).
        """
        if not 1 <= num_groups <= self.capacity_groups:
            # More than the capacity could never be satisfied: fail now, not at the timeout.
            raise ValueError(
                f"num_groups must be in [1, capacity_groups={self.capacity_groups}], "
                f"got {num_groups}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        drops: list[tuple[int, str]] = []
        try:
            with self._cond:
                while True:
                    self._raise_if_closed()
                    self._drop_stale_locked(trainer_version, drops)
                    if len(self._ready) >= num_groups:
                        batch = [self._ready.popitem(last=False)[1] for _ in range(num_groups)]
                        self._consumed_groups += num_groups
                        self._consumed_samples += num_groups * self.group_size
                        self._cond.notify_all()  # room for blocked producers
                        return batch
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise RolloutTimeout(
                            f"get_batch({num_groups}) at trainer version {trainer_version} "
                            f"timed out after {timeout}s (producer dead or too slow?): "
                            f"{self._counters_text()}"
                        )
                    self._cond.wait(remaining)
        finally:
            self._run_drop_callbacks(drops)

    def _drop_stale_locked(self, trainer_version: int, drops: list[tuple[int, str]]) -> None:
        for group_id, group in list(self._ready.items()):
            self._check_not_future(group_id, group.max_version, trainer_version)
        if self.max_staleness is None:
            return
        # Staleness only grows with the trainer version, so a group stale now stays stale:
        # drop incomplete ones too, to free their room early.
        oldest = {gid: g.min_version for gid, g in self._ready.items()}
        for group_id, group in self._pending.items():
            oldest[group_id] = oldest_version(list(group.samples.values()), default=trainer_version)
        for group_id, min_version in oldest.items():
            if trainer_version - min_version > self.max_staleness:
                self._drop_locked(group_id, "stale", drops)

    @staticmethod
    def _check_not_future(group_id: int, max_version: int, trainer_version: int) -> None:
        if max_version > trainer_version:
            raise ValueError(
                f"group {group_id} has a token of policy version {max_version} but the "
                f"trainer is at version {trainer_version}: versions are out of sync"
            )

    # -- dropping ---------------------------------------------------------------------------

    def drop_group(self, group_id: int, reason: str) -> bool:
        """Drops a group wherever it is (incomplete, complete, or not seen yet).

        A group never seen before (its host died before any sample) is counted as produced
        and dropped, and its samples are discarded if they arrive after all.

        Returns:
          False if the group was already dropped, else True.
        """
        if not reason:
            raise ValueError("drop_group needs a non-empty reason")
        drops: list[tuple[int, str]] = []
        try:
            with self._cond:
                if group_id in self._expect_discard:
                    return False
                if group_id not in self._pending and group_id not in self._ready:
                    self._produced_groups += 1
                    self._pending[group_id] = _PendingGroup("", None, {})
                self._drop_locked(group_id, reason, drops)
                self._cond.notify_all()
                return True
        finally:
            self._run_drop_callbacks(drops)

    def _drop_locked(self, group_id: int, reason: str, drops: list[tuple[int, str]]) -> None:
        if group_id in self._ready:
            del self._ready[group_id]
        else:
            received = len(self._pending.pop(group_id).samples)
            if received < self.group_size:
                self._expect_discard[group_id] = self.group_size - received
        self._dropped[reason] += 1
        drops.append((group_id, reason))
        self._cond.notify_all()

    def _run_drop_callbacks(self, drops: list[tuple[int, str]]) -> None:
        # Outside the lock: the callback may take other locks (e.g. the controller's).
        if self._on_drop is not None:
            for group_id, reason in drops:
                self._on_drop(group_id, reason)

    # -- lifecycle and bookkeeping ----------------------------------------------------------

    def close(self, reason: str = "queue closed") -> None:
        """Wakes every blocked ``put``/``get_batch`` with ``QueueClosed(reason)``; later
        calls raise it too. Pass the producer's exception text as ``reason`` so the trainer
        sees why."""
        with self._cond:
            if self._closed_reason is None:
                self._closed_reason = reason
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed_reason is not None

    def _raise_if_closed(self) -> None:
        if self._closed_reason is not None:
            raise QueueClosed(f"rollout queue closed: {self._closed_reason}")

    def _held_groups(self) -> int:
        return len(self._pending) + len(self._ready)

    def __len__(self) -> int:
        """Complete groups waiting to be consumed."""
        with self._cond:
            return len(self._ready)

    def counters(self) -> dict:
        """Counts of samples and groups; see the class docstring for the invariant."""
        with self._cond:
            return self._counters_locked()

    def _counters_locked(self) -> dict:
        return {
            "produced_samples": self._produced_samples,
            "discarded_samples": self._discarded_samples,
            "consumed_samples": self._consumed_samples,
            "produced_groups": self._produced_groups,
            "completed_groups": self._completed_groups,
            "consumed_groups": self._consumed_groups,
            "dropped_groups": dict(self._dropped),
            "dropped_total": sum(self._dropped.values()),
            "pending_groups": len(self._pending),
            "pending_samples": sum(len(g.samples) for g in self._pending.values()),
            "ready_groups": len(self._ready),
        }

    def _counters_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._counters_locked().items())

    def check_invariant(self) -> None:
        """Raises AssertionError if the group counts do not add up."""
        c = self.counters()
        held = c["consumed_groups"] + c["dropped_total"] + c["pending_groups"] + c["ready_groups"]
        if c["produced_groups"] != held:
            raise AssertionError(f"produced_groups != consumed + dropped + in queue: {c}")

    def state(self) -> dict:
        """JSON-able cumulative counters for a checkpoint (the groups themselves are not
        saved: on resume they are regenerated, and counted as dropped ``"restart"``)."""
        with self._cond:
            state = self._counters_locked()
        state["group_size"] = self.group_size
        return state

    def restore(self, state: dict) -> None:
        """Restores :meth:`state` into an empty queue. Groups that were held at save time
        are counted as dropped with reason ``"restart"``, so the invariant still holds."""
        if int(state["group_size"]) != self.group_size:
            raise ValueError(
                f"checkpointed group_size {state['group_size']} != queue group_size "
                f"{self.group_size}"
            )
        with self._cond:
            if self._held_groups() or self._produced_samples or self._expect_discard:
                raise ValueError("RolloutQueue.restore needs a fresh, empty queue")
            self._produced_samples = int(state["produced_samples"])
            self._discarded_samples = int(state["discarded_samples"])
            self._consumed_samples = int(state["consumed_samples"])
            self._produced_groups = int(state["produced_groups"])
            self._completed_groups = int(state["completed_groups"])
            self._consumed_groups = int(state["consumed_groups"])
            self._dropped = collections.Counter(
                {k: int(v) for k, v in state["dropped_groups"].items()}
            )
            lost = int(state["pending_groups"]) + int(state["ready_groups"])
            if lost:
                self._dropped["restart"] += lost
