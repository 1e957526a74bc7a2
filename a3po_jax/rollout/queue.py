"""Host-side queue of whole rollout groups (rollout layer, host side; design §2, §5).

Plain Python + numpy; never enters jit. :class:`RolloutQueue` assembles samples into groups,
holds at most ``capacity_groups`` groups (producers block beyond that: backpressure, never
unbounded growth), and hands the trainer whole groups, first completed first out, dropping
any group with a token that would train staler than η (in optimizer versions, at the last
minibatch of the batch). Admission (when a producer may start a group) is
:mod:`a3po_jax.rollout.admission`; the counters are :mod:`a3po_jax.rollout.queue_counters`,
the wait loop :mod:`a3po_jax.rollout.waiting`.

Wiring (one producer thread, the trainer in the main thread; k = versions per batch)::

    controller = StalenessController(batch_groups=B, max_staleness=eta, versions_per_batch=k)
    queue = RolloutQueue(group_size=G, capacity_groups=controller.max_in_flight,
                         max_staleness=eta, versions_per_batch=k,
                         on_drop=lambda group_id, reason: controller.release())
    # producer:  group_id, v_admit = controller.wait_admit()
    #            ... generate G samples; queue.put(Rollout(..., admitted_at_version=v_admit))
    # trainer:   groups = queue.get_batch(B, trainer_version=v, timeout=600.0)
    #            ... train (k optimizer steps) ...; controller.notify_version(v + k)

The controller bounds the groups in flight to ``controller.max_in_flight`` once the consumer
takes B per batch, so with that capacity a producer never blocks on the queue; the queue's
own bound is the safety net for producers without a controller.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable

from a3po_jax.core.types import Rollout, RolloutGroup, oldest_version
from a3po_jax.rollout.queue_counters import QueueCounters, check_invariant

# Re-exported: callers wait on the queue and catch these where they always found them.
from a3po_jax.rollout.waiting import QueueClosed, wait_until
from a3po_jax.rollout.waiting import RolloutTimeout as RolloutTimeout
from a3po_jax.rollout.waiting import WaitInterrupted as WaitInterrupted

# The order in which get_batch hands out complete groups (``system.consume_order``):
# "completion": first finished first out; "admission": the oldest admitted (smallest group
# id) first, waiting for it, so long responses are not overtaken by short ones.
CONSUME_ORDERS = ("completion", "admission")


# Why a complete group is filtered (never trained; rollout.dynamic_sampling): every sample
# got the same reward, so every advantage is 0 and the group carries no gradient (DAPO's
# dynamic sampling, arXiv 2503.14476).
ZERO_VARIANCE = "zero_variance"


class _EmptySlot:
    """Stands in ``_ready`` for a filtered group whose admission was not given back (the
    refill budget was spent): a batch takes it as a slot left empty."""

    def __repr__(self) -> str:
        return "EMPTY_SLOT"


EMPTY_SLOT = _EmptySlot()


def zero_reward_variance(rollouts: Iterable[Rollout]) -> bool:
    """True when every sample has a reward and all rewards are equal (exactly: then every
    group-relative advantage is exactly 0, whatever the estimator)."""
    rewards = [r.reward for r in rollouts]
    return bool(rewards) and None not in rewards and len(set(rewards)) == 1


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
    * ``get_batch`` returns whole groups in completion order (``consume_order="completion"``)
      or strictly oldest admitted first (``"admission"``: the ``num_groups`` smallest group
      ids not yet consumed or dropped, waiting until all of them are complete; group ids are
      admission counts, see :class:`a3po_jax.rollout.admission.StalenessController`). The
      queue knows a group from its first sample; ``admitted_ids`` (a callable returning the
      ids admitted and not yet consumed, e.g. the workers' in-flight table) makes groups with
      no sample yet block too. The batch is trained in
      ``versions_per_batch`` (k) optimizer steps, the last at ``trainer_version + k - 1``; a
      group with any token of staleness ``trainer_version + k - 1 - v > max_staleness``
      (it could land in the last minibatch) is dropped (reason ``"stale"``), never
      returned; so is a still-incomplete group that is already too stale. If not
      enough groups arrive within ``timeout`` it raises :class:`RolloutTimeout` (with the
      counters in the message) and keeps what it has: the trainer notices a dead producer
      instead of training on a short batch.
    * A group with an ``"aborted"`` sample is dropped as ``"aborted"`` (unless
      ``drop_aborted=False``); ``drop_group`` drops one explicitly, e.g. when its host died.
      Samples that arrive later for a dropped group are discarded and counted.
    * ``on_drop(group_id, reason)`` is called (outside the lock) for every dropped group;
      wire it to ``StalenessController.release`` so dropped groups free their admission.
    * Dynamic sampling (``filter_zero_variance``): a group that completes with all G rewards
      equal is *filtered* (reason ``"zero_variance"``), never handed out. Up to
      ``max_refills`` filtered groups per training step (:meth:`new_refill_window`) are
      *refilled*:
      ``on_filter(group_id, True)`` (wire it to ``StalenessController.release``) lets the
      producer draw a fresh prompt in its place. Past that budget ``on_filter(group_id,
      False)`` keeps its admission and the group becomes an *empty slot* in the ready order:
      ``get_batch`` counts it as one of its ``num_groups`` but returns only the real groups,
      so the batch is short. Every batch thus still consumes ``num_groups`` admissions and
      the staleness controller's bound holds unchanged for everything that trains.

    Invariant (``counters()``): ``produced_groups == consumed_groups + dropped_total +
    filtered_groups + pending_groups + ready_groups``, where a group counts as produced from
    its first sample (or its ``drop_group`` call); and ``filtered_groups == refilled_groups
    + empty_slots + held_empty_slots`` (empty slots held at a restart are given back: counted
    as refilled). ``empty_slots`` are the slots batches were short by.

    Length counters (cumulative, checkpointed): ``produced_samples``/``generated_tokens``
    for every sample filed (generated), ``consumed_samples``/``consumed_tokens`` for the
    samples handed to the trainer, ``dropped_samples``/``dropped_tokens`` by drop reason (a
    dropped incomplete group counts the samples it had received); ``held_tokens`` are the
    completion tokens of the samples still held; ``overtaking_groups`` counts groups handed
    out while an older group (smaller id, admitted, not consumed or dropped) still waited:
    the reordering that completion order does and admission order never. So
    ``produced_samples == consumed_samples + Σ dropped_samples + filtered_samples +
    pending_samples + ready_groups·G``, and the same for tokens.
    """

    def __init__(
        self,
        *,
        group_size: int,
        capacity_groups: int,
        max_staleness: int | None,
        versions_per_batch: int = 1,
        drop_aborted: bool = True,
        on_drop: Callable[[int, str], None] | None = None,
        consume_order: str = "completion",
        admitted_ids: Callable[[], Iterable[int]] | None = None,
        filter_zero_variance: bool = False,
        max_refills: int | None = None,
        on_filter: Callable[[int, bool], None] | None = None,
    ):
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if not isinstance(capacity_groups, int) or capacity_groups < 1:
            raise ValueError(f"capacity_groups must be an int >= 1, got {capacity_groups!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        if not isinstance(versions_per_batch, int) or versions_per_batch < 1:
            raise ValueError(f"versions_per_batch must be an int >= 1, got {versions_per_batch!r}")
        if consume_order not in CONSUME_ORDERS:
            raise ValueError(
                f"consume_order must be one of {', '.join(CONSUME_ORDERS)}, got {consume_order!r}"
            )
        if max_refills is not None and (not isinstance(max_refills, int) or max_refills < 0):
            raise ValueError(f"max_refills must be None or an int >= 0, got {max_refills!r}")
        self.consume_order = consume_order
        self.filter_zero_variance = filter_zero_variance
        self.max_refills = max_refills  # per training step; None = no limit
        self._on_filter = on_filter
        self._admitted_ids = admitted_ids
        # Admission order with admitted_ids: consumed or dropped ids the callable may still
        # list (kept only while it lists them).
        self._finished: set[int] = set()
        self.group_size = group_size
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self.versions_per_batch = versions_per_batch
        self.drop_aborted = drop_aborted
        self._on_drop = on_drop
        self._cond = threading.Condition()
        self._pending: dict[int, _PendingGroup] = {}
        self._ready: collections.OrderedDict[int, RolloutGroup] = collections.OrderedDict()
        # Dropped group id -> samples still to come; late samples are discarded. Entries of
        # groups whose host died stay (one int each), bounded by the number of such drops.
        self._expect_discard: dict[int, int] = {}
        self._closed_reason: str | None = None
        self._n = QueueCounters()
        # The refill budget's window: refills since the trainer's last step.
        self._refills_in_window = 0

    # -- producer side ----------------------------------------------------------------------

    def put(self, rollout: Rollout, timeout: float | None = None) -> None:
        """Adds one sample; blocks while a new group would exceed ``capacity_groups``.

        Raises:
          ValueError: on a sample index outside [0, G), a duplicate sample index, a
            ``prompt_id``/``admitted_at_version`` differing from the group's, or a sample
            for a group that is already complete.
          RolloutTimeout: when no room appeared within ``timeout`` seconds.
          QueueClosed: once :meth:`close` was called.
        """
        if not isinstance(rollout, Rollout):
            raise TypeError(f"put expects a Rollout, got {type(rollout).__name__}")
        group_id = rollout.group_id
        if not 0 <= rollout.sample_index < self.group_size:
            raise ValueError(
                f"sample_index {rollout.sample_index} of group {group_id} is outside "
                f"[0, group_size={self.group_size})"
            )
        drops: list[tuple[int, str]] = []
        filters: list[tuple[int, bool]] = []

        def room() -> str | None:
            self._raise_if_closed()
            if group_id in self._expect_discard:
                return "discard"
            if group_id in self._ready:
                raise ValueError(
                    f"group {group_id} is already complete ({self.group_size} "
                    f"samples); got sample_index {rollout.sample_index} again"
                )
            if group_id in self._pending or self._held_groups() < self.capacity_groups:
                return "add"
            return None

        try:
            with self._cond:
                outcome = wait_until(
                    self._cond,
                    room,
                    timeout=timeout,
                    timeout_message=lambda: (
                        f"put of group {group_id} found no room within {timeout}s: "
                        f"{self._counters_text()}"
                    ),
                )
                if outcome == "discard":
                    self._discard_late_sample(group_id)
                    return
                self._add_sample(rollout, drops, filters)
                self._cond.notify_all()
        finally:
            self._run_drop_callbacks(drops)
            self._run_filter_callbacks(filters)

    def _add_sample(
        self, rollout: Rollout, drops: list[tuple[int, str]], filters: list[tuple[int, bool]]
    ) -> None:
        group_id = rollout.group_id
        group = self._pending.get(group_id)
        if group is None:
            group = _PendingGroup(rollout.prompt_id, rollout.admitted_at_version, {})
        else:
            if rollout.sample_index in group.samples:
                raise ValueError(
                    f"duplicate sample_index {rollout.sample_index} for group {group_id}"
                )
            for field in ("prompt_id", "admitted_at_version"):
                if getattr(rollout, field) != getattr(group, field):
                    raise ValueError(
                        f"group {group_id} mixes {field} {getattr(group, field)!r} and "
                        f"{getattr(rollout, field)!r}"
                    )
        if group_id not in self._pending:
            self._pending[group_id] = group
            self._n.produced_groups += 1
        group.samples[rollout.sample_index] = rollout
        self._n.sample(rollout)
        if self.drop_aborted and rollout.finish_reason == "aborted":
            self._drop_locked(group_id, "aborted", drops)
            return
        if len(group.samples) == self.group_size:
            del self._pending[group_id]
            rollouts = [group.samples[i] for i in range(self.group_size)]
            if self.filter_zero_variance and zero_reward_variance(rollouts):
                self._filter_locked(group_id, rollouts, filters)
                return
            admitted = group.admitted_at_version
            if admitted is None:
                admitted = oldest_version(rollouts, default=0)
            self._ready[group_id] = RolloutGroup(
                prompt_id=group.prompt_id,
                group_id=group_id,
                rollouts=rollouts,
                admitted_at_version=admitted,
            )
            self._n.completed_groups += 1

    def _filter_locked(
        self, group_id: int, rollouts: list[Rollout], filters: list[tuple[int, bool]]
    ) -> None:
        """A complete group with zero reward variance: refilled while the version's budget
        lasts, else an empty slot of the ready order (see the class docstring)."""
        refill = self.max_refills is None or self._refills_in_window < self.max_refills
        self._n.filter(rollouts, refilled=refill)
        if refill:
            self._refills_in_window += 1
            if self._admitted_ids is not None:
                self._finished.add(group_id)
        else:
            self._ready[group_id] = EMPTY_SLOT
        filters.append((group_id, refill))

    def _run_filter_callbacks(self, filters: list[tuple[int, bool]]) -> None:
        # Outside the lock, like the drop callbacks.
        if self._on_filter is not None:
            for group_id, refilled in filters:
                self._on_filter(group_id, refilled)

    def new_refill_window(self) -> None:
        """The trainer finished a step (trained, skipped or empty): ``max_refills`` more
        filtered groups may be refilled."""
        with self._cond:
            self._refills_in_window = 0

    def _discard_late_sample(self, group_id: int) -> None:
        self._n.discarded_samples += 1
        self._expect_discard[group_id] -= 1
        if self._expect_discard[group_id] <= 0:
            del self._expect_discard[group_id]

    # -- consumer side ----------------------------------------------------------------------

    def get_batch(
        self,
        num_groups: int,
        *,
        trainer_version: int,
        timeout: float | None,
        interrupted: Callable[[], bool] | None = None,
    ) -> list[RolloutGroup]:
        """Takes ``num_groups`` whole groups after dropping stale ones: first completed first,
        or (``consume_order="admission"``) the oldest ``num_groups`` admitted, once complete.

        Args:
          num_groups: groups to return, in [1, capacity_groups].
          trainer_version: the version the step starts from (its first minibatch's); the
            last minibatch trains at ``trainer_version + versions_per_batch - 1``, and
            staleness is measured against that.
          timeout: seconds to wait for enough groups; None waits forever.
          interrupted: asked while waiting; true ends the wait (`WaitInterrupted`).
        Returns:
          ``num_groups`` groups, none with a token that would train staler than
          ``max_staleness`` in any minibatch; with ``filter_zero_variance``, fewer (maybe
          none) when empty slots take some of the ``num_groups`` places.
        Raises:
          RolloutTimeout if not enough groups arrived in time (nothing is taken).
          WaitInterrupted if ``interrupted()`` said so first (nothing is taken).
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
        drops: list[tuple[int, str]] = []
        try:
            with self._cond:
                return wait_until(
                    self._cond,
                    lambda: self._take_locked(num_groups, trainer_version, drops),
                    timeout=timeout,
                    timeout_message=lambda: (
                        f"get_batch({num_groups}) at trainer version {trainer_version} timed "
                        f"out after {timeout}s (producer dead or too slow?): "
                        f"{self._counters_text()}"
                    ),
                    interrupted=interrupted,
                )
        finally:
            self._run_drop_callbacks(drops)

    def _take_locked(
        self, num_groups: int, trainer_version: int, drops: list[tuple[int, str]]
    ) -> list[RolloutGroup] | None:
        """One try of :meth:`get_batch` (lock held): drops the stale groups, then takes the
        batch, or returns None while it is not there yet."""
        self._raise_if_closed()
        self._drop_stale_locked(trainer_version, drops)
        if self.consume_order == "admission":
            ids = self._oldest_live_locked(num_groups)
            if len(ids) < num_groups or any(gid not in self._ready for gid in ids):
                return None
            entries = [(gid, self._ready.pop(gid)) for gid in ids]
        else:
            if len(self._ready) < num_groups:
                return None
            entries = [self._ready.popitem(last=False) for _ in range(num_groups)]
        taken = [g for _, g in entries if g is not EMPTY_SLOT]
        self._n.consume(taken, empty=num_groups - len(taken), group_size=self.group_size)
        if self._admitted_ids is not None:
            self._finished.update(gid for gid, _ in entries)
        # Groups that jumped an older one still waiting (0 in admission order).
        waiting = self._oldest_live_locked(1)
        self._n.overtaking_groups += sum(1 for g in taken if waiting and g.group_id > waiting[0])
        self._cond.notify_all()  # room for blocked producers
        return taken

    def _oldest_live_locked(self, num_groups: int) -> list[int]:
        """The ``num_groups`` smallest ids of the groups admitted and neither consumed nor
        dropped, as far as the queue knows them (fewer if it knows fewer)."""
        live = set(self._pending) | set(self._ready)
        if self._admitted_ids is not None:
            admitted = set(self._admitted_ids())
            self._finished &= admitted  # ids no longer listed need no memory
            live |= admitted - self._finished - set(self._expect_discard)
        return sorted(live)[:num_groups]

    def _drop_stale_locked(self, trainer_version: int, drops: list[tuple[int, str]]) -> None:
        ready = {gid: g for gid, g in self._ready.items() if g is not EMPTY_SLOT}  # no tokens
        for group_id, group in ready.items():
            self._check_not_future(group_id, group.max_version, trainer_version)
        if self.max_staleness is None:
            return
        # Staleness only grows with the trainer version, so a group stale now stays stale:
        # drop incomplete ones too, to free their room early.
        # A group may land in the batch's last minibatch, trained k - 1 versions on.
        last_version = trainer_version + self.versions_per_batch - 1
        oldest = {gid: g.min_version for gid, g in ready.items()}
        for group_id, group in self._pending.items():
            oldest[group_id] = oldest_version(list(group.samples.values()), default=trainer_version)
        for group_id, min_version in oldest.items():
            if last_version - min_version > self.max_staleness:
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
                if group_id in self._expect_discard or self._ready.get(group_id) is EMPTY_SLOT:
                    return False
                if group_id not in self._pending and group_id not in self._ready:
                    self._n.produced_groups += 1
                    self._pending[group_id] = _PendingGroup("", None, {})
                self._drop_locked(group_id, reason, drops)
                self._cond.notify_all()
                return True
        finally:
            self._run_drop_callbacks(drops)

    def _drop_locked(self, group_id: int, reason: str, drops: list[tuple[int, str]]) -> None:
        if group_id in self._ready:
            samples = self._ready.pop(group_id).rollouts
        else:
            samples = list(self._pending.pop(group_id).samples.values())
            received = len(samples)
            if received < self.group_size:
                self._expect_discard[group_id] = self.group_size - received
        self._n.drop(reason, samples)
        if self._admitted_ids is not None:
            self._finished.add(group_id)
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
        """Complete groups waiting to be consumed (empty slots not counted)."""
        with self._cond:
            return len(self._ready) - self._n.held_empty_slots

    def counters(self) -> dict:
        """Counts of samples and groups; see the class docstring for the invariant."""
        with self._cond:
            return self._counters_locked()

    def _counters_locked(self) -> dict:
        return self._n.as_dict(
            pending_groups=len(self._pending),
            pending_samples=sum(len(g.samples) for g in self._pending.values()),
            ready=len(self._ready),
        )

    def _counters_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._counters_locked().items())

    def check_invariant(self) -> None:
        """Raises AssertionError if the group counts do not add up."""
        check_invariant(self.counters())

    def state(self) -> dict:
        """JSON-able cumulative counters for a checkpoint (the groups themselves are not
        in it: on resume the rollout workers re-issue them or restore those saved beside
        the checkpoint, see :meth:`restore`)."""
        return self.snapshot()[0]

    def snapshot(self) -> tuple[dict, list[RolloutGroup]]:
        """:meth:`state` and the complete groups not yet consumed (in hand-out order, empty
        slots left out), taken together: the counters count exactly those groups."""
        with self._cond:
            state = self._counters_locked()
            ready = [g for g in self._ready.values() if g is not EMPTY_SLOT]
        state["group_size"] = self.group_size
        return state, ready

    def ready_ids(self) -> set[int]:
        """Ids of the complete groups not yet consumed (empty slots left out)."""
        with self._cond:
            return {gid for gid, g in self._ready.items() if g is not EMPTY_SLOT}

    def wait_complete(
        self,
        group_ids: Callable[[], Iterable[int]],
        *,
        timeout: float | None,
        interrupted: Callable[[], bool] | None = None,
    ) -> None:
        """Waits until every id ``group_ids()`` lists is a complete group here; the callable
        is asked again while waiting (at least every `INTERRUPT_POLL_S`), so a group that
        leaves it (dropped elsewhere) stops counting. `RolloutTimeout` after ``timeout``
        seconds, `WaitInterrupted` when ``interrupted()`` says so."""

        def complete() -> bool | None:
            self._raise_if_closed()
            return True if all(gid in self._ready for gid in group_ids()) else None

        with self._cond:
            wait_until(
                self._cond,
                complete,
                timeout=timeout,
                timeout_message=lambda: (
                    f"groups {sorted(set(group_ids()) - set(self._ready))} not complete "
                    f"within {timeout}s: {self._counters_text()}"
                ),
                # Polled: a drop callback forgets its group after the queue's notify.
                interrupted=interrupted or (lambda: False),
            )

    def restore(
        self, state: dict, *, regenerated: bool = False, held: Iterable[RolloutGroup] = ()
    ) -> None:
        """Restores :meth:`state` into an empty queue. Groups that were held at save time
        are counted as dropped with reason ``"restart"``, so the invariant still holds;
        with ``regenerated=True`` (the workers re-issue every pending group of the
        checkpoint) they are instead taken out of the produced counts, to be produced
        again, all but ``held``: complete groups of the checkpoint saved with it, which are
        put back as they were (ready, in the given order, still counted as produced)."""
        held = list(held)
        counters = QueueCounters.from_state(
            state, group_size=self.group_size, regenerated=regenerated, held=held
        )
        with self._cond:
            if self._held_groups() or self._n.produced_samples or self._expect_discard:
                raise ValueError("RolloutQueue.restore needs a fresh, empty queue")
            self._n = counters
            for group in held:
                self._ready[group.group_id] = group
