"""Staleness admission: when may the producer start another prompt (rollout layer, host side).

Staleness is counted in **optimizer versions** everywhere: a token sampled by the policy of
version ``v_b`` and trained by an optimizer step that starts from version ``v_θ`` has
staleness ``d = v_θ - v_b``. One batch of B groups is trained in ``k = algo.num_minibatches``
optimizer steps, minibatch ``i`` (rows ``[i·R/k, (i+1)·R/k)`` of the R-row batch) at version
``v0 + i``, so the trainer's version advances by k per batch. Three pieces share this one
definition:

* :class:`StalenessController` (AReaL's ``staleness_manager.py`` rule, in versions) admits a
  group only if it will be trained, in whichever minibatch it lands, at staleness <= η;
* :func:`a3po_jax.training.config.staleness_bound` says what η is for each training mode
  (one rule, asked by the config check, the trainer and the results tables);
* :func:`trained_staleness` gives the staleness of every trained token of a batch, from
  which every ``staleness/*`` metric is computed (:func:`staleness_metrics`).

Plain Python + numpy; nothing here enters jit.
"""

from __future__ import annotations

import threading

import numpy as np

from a3po_jax.rollout.waiting import QueueClosed, wait_until


class AdmissionError(RuntimeError):
    """``StalenessController.admit`` was called with no capacity left."""


class StalenessController:
    """AReaL's capacity rule counted in optimizer versions.

    With B groups per batch, k optimizer steps (versions) per batch and max staleness η, at
    most ``⌊(η + v + 1) / k⌋ · B`` groups may have been admitted in total (net of
    releases) while the trainer is at version v.

    Why this bounds staleness: the trainer takes B groups per batch in admission order, so
    the j-th admitted group (0-based, net of releases) is trained in batch ``⌊j/B⌋``, which
    starts at version ``⌊j/B⌋·k`` (skipped steps release their groups and do not advance the
    version) and ends at ``⌊j/B⌋·k + k - 1``. Admitted at version ``v_a``, its tokens have
    ``v_b >= v_a``, and ``j < ⌊(η + v_a + 1)/k⌋·B`` gives ``⌊j/B⌋·k + k - 1 - v_a <= η``:
    every token of every minibatch obeys ``d <= η``. Groups that will never be consumed
    (dropped or aborted, thrown away with a skipped step, lost in a restart) are given back
    with :meth:`release` so they do not eat the budget, as AReaL does for rejected rollouts.
    ``η = k - 1`` admits exactly B groups per batch: synchronous training.

    Group ids are the admission count (0, 1, 2, …), so they stay unique across a resume.
    Thread-safe; ``notify_version``/``wait_admit`` let a producer thread block until the
    trainer's next step instead of polling.
    """

    def __init__(self, *, batch_groups: int, max_staleness: int, versions_per_batch: int = 1):
        if not isinstance(batch_groups, int) or batch_groups < 1:
            raise ValueError(f"batch_groups must be an int >= 1, got {batch_groups!r}")
        if not isinstance(versions_per_batch, int) or versions_per_batch < 1:
            raise ValueError(f"versions_per_batch must be an int >= 1, got {versions_per_batch!r}")
        if not isinstance(max_staleness, int) or max_staleness < versions_per_batch - 1:
            # Below k - 1 the budget of version 0 is empty: nothing could ever be admitted.
            raise ValueError(
                f"max_staleness must be an int >= versions_per_batch - 1 = "
                f"{versions_per_batch - 1}, got {max_staleness!r}"
            )
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.versions_per_batch = versions_per_batch
        self._admitted = 0  # total admissions ever; also the next group id
        self._released = 0  # admissions given back (dropped or lost groups)
        self._trainer_version = 0  # last version passed to notify_version
        self._unsubmitted = 0  # taken by wait_admit, not yet reported by submitted()
        self._closed_reason: str | None = None
        self._cond = threading.Condition()

    # -- the rule ---------------------------------------------------------------------------

    def budget(self, trainer_version: int) -> int:
        """``⌊(η + v + 1)/k⌋·B``: how many admissions (net of releases) version v allows."""
        if trainer_version < 0:
            raise ValueError(f"trainer_version must be >= 0, got {trainer_version}")
        batches = (self.max_staleness + trainer_version + 1) // self.versions_per_batch
        return batches * self.batch_groups

    @property
    def max_in_flight(self) -> int:
        """Groups admitted but not yet consumed, at most: ``⌊(η + 1)/k⌋·B`` (the queue's
        capacity, so a producer under this controller never blocks on the queue)."""
        return (self.max_staleness + 1) // self.versions_per_batch * self.batch_groups

    def capacity(self, trainer_version: int) -> int:
        """How many more groups may be admitted now."""
        with self._cond:
            return max(0, self.budget(trainer_version) - self._counted())

    def can_admit(self, trainer_version: int) -> bool:
        return self.capacity(trainer_version) > 0

    def _counted(self) -> int:
        return self._admitted - self._released

    def _admit_locked(self) -> int:
        group_id = self._admitted
        self._admitted += 1
        return group_id

    def admit(self, trainer_version: int) -> int:
        """Counts one admission and returns its group id; raises ``AdmissionError`` when
        the budget of ``trainer_version`` is spent."""
        with self._cond:
            self._raise_if_closed()
            if self._counted() >= self.budget(trainer_version):
                raise AdmissionError(
                    f"no admission capacity at trainer version {trainer_version}: "
                    f"{self._counted()} groups counted (admitted {self._admitted}, released "
                    f"{self._released}) >= floor((max_staleness {self.max_staleness} + "
                    f"version {trainer_version} + 1) / versions_per_batch "
                    f"{self.versions_per_batch}) * batch_groups {self.batch_groups}"
                )
            return self._admit_locked()

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

        def admitted() -> tuple[int, int] | None:
            self._raise_if_closed()
            version = self._trainer_version
            if self._counted() < self.budget(version):
                self._unsubmitted += 1
                return self._admit_locked(), version
            return None

        with self._cond:
            return wait_until(
                self._cond,
                admitted,
                timeout=timeout,
                timeout_message=lambda: (
                    f"no admission capacity within {timeout}s at trainer version "
                    f"{self._trainer_version}: {self._counted()} groups counted, budget "
                    f"{self.budget(self._trainer_version)}"
                ),
            )

    def submitted(self) -> None:
        """The producer is done with one admission of ``wait_admit``: its request reached
        the host (or failed to); :meth:`wait_submitted` counts it as settled."""
        with self._cond:
            if self._unsubmitted <= 0:
                raise ValueError("submitted() without an admission from wait_admit")
            self._unsubmitted -= 1
            self._cond.notify_all()

    def wait_submitted(self, timeout: float | None = None) -> None:
        """Blocks until the budget of the last notified version is spent and every
        admission taken from it was reported by :meth:`submitted`, or the controller
        closes (returns then too). ``one_step_off`` asks this before it pushes the next
        weights, so that each group reaches the host before the weights it must not see.

        Raises:
          RolloutTimeout: after ``timeout`` seconds.
        """

        def settled() -> bool | None:
            if self._closed_reason is not None:
                return True
            full = self._counted() >= self.budget(self._trainer_version)
            return True if full and self._unsubmitted == 0 else None

        with self._cond:
            wait_until(
                self._cond,
                settled,
                timeout=timeout,
                timeout_message=lambda: (
                    f"the producer did not submit the admissions of trainer version "
                    f"{self._trainer_version} within {timeout}s: {self._counted()} groups "
                    f"counted, budget {self.budget(self._trainer_version)}, "
                    f"{self._unsubmitted} admitted but not submitted"
                ),
            )

    def close(self, reason: str = "closed") -> None:
        """Wakes producers blocked in ``wait_admit`` with ``QueueClosed``."""
        with self._cond:
            if self._closed_reason is None:
                self._closed_reason = reason
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed_reason is not None:
            raise QueueClosed(f"StalenessController closed: {self._closed_reason}")

    # -- checkpointing ----------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-able counters for a checkpoint."""
        with self._cond:
            return {
                "batch_groups": self.batch_groups,
                "max_staleness": self.max_staleness,
                "versions_per_batch": self.versions_per_batch,
                "admitted": self._admitted,
                "released": self._released,
                "trainer_version": self._trainer_version,
            }

    def restore(
        self, state: dict, *, consumed_groups: int | None = None, in_flight_groups: int = 0
    ) -> None:
        """Restores the counters of :meth:`state`.

        Pass ``consumed_groups`` (the groups trained up to the checkpoint) to give back the
        admissions of the groups that will not arrive after the resume: afterwards exactly
        ``consumed_groups + in_flight_groups`` count against the budget, where
        ``in_flight_groups`` are the checkpoint's pending groups the workers re-issue (0
        when nothing is re-issued). Group ids keep counting from ``admitted``.
        """
        admitted = int(state["admitted"])
        released = int(state["released"])
        if consumed_groups is not None:
            counted = consumed_groups + in_flight_groups
            if not (0 <= consumed_groups and 0 <= in_flight_groups and counted <= admitted):
                raise ValueError(
                    f"consumed_groups must be in [0, admitted={admitted} - in_flight_groups="
                    f"{in_flight_groups}], got {consumed_groups} (in_flight_groups must be >= 0)"
                )
            released = admitted - counted
        if not 0 <= released <= admitted:
            raise ValueError(f"invalid controller state {state!r}")
        with self._cond:
            self._admitted = admitted
            self._released = released
            self._trainer_version = int(state.get("trainer_version", 0))
            self._cond.notify_all()


# -- the staleness of trained tokens --------------------------------------------------------


def minibatch_versions(num_rows: int, start_version: int, num_minibatches: int) -> np.ndarray:
    """The version each row of a batch is trained at, ``[R]`` int64.

    The step splits the R rows into k equal, contiguous minibatches and takes one optimizer
    step per minibatch, so row r trains at ``v0 + ⌊r·k/R⌋``. (Packed batches split their
    groups the same way; a group's rows are contiguous, so this holds row by row.)
    """
    if num_minibatches < 1 or num_rows % num_minibatches:
        raise ValueError(
            f"num_minibatches={num_minibatches} must be >= 1 and divide the {num_rows} rows"
        )
    return start_version + np.arange(num_rows) * num_minibatches // num_rows


def trained_staleness(
    versions: np.ndarray, loss_mask: np.ndarray, start_version: int, num_minibatches: int
) -> np.ndarray:
    """Staleness ``d = v_θ - v_b`` of every trained token of a batch, in optimizer versions.

    Args:
      versions: ``[R, T]`` policy version that sampled each token (``TrainBatch.versions``).
      loss_mask: ``[R, T]`` 1 on trained (completion) tokens.
      start_version: the trainer version the step starts from (its first minibatch's).
      num_minibatches: k, optimizer steps in the step; row r trains at
        :func:`minibatch_versions`.
    Returns:
      ``[N]`` int32, N = trained tokens, row-major.
    """
    versions = np.asarray(versions)
    loss_mask = np.asarray(loss_mask)
    if versions.shape != loss_mask.shape or versions.ndim != 2:
        raise ValueError(
            f"versions {versions.shape} and loss_mask {loss_mask.shape} must be the same [R, T]"
        )
    trained_at = minibatch_versions(versions.shape[0], start_version, num_minibatches)
    d = trained_at[:, None] - versions
    return d[loss_mask > 0].astype(np.int32)


def staleness_counts(staleness: np.ndarray) -> list[int]:
    """Exact histogram: ``counts[d]`` = tokens at staleness d, for d = 0 .. max.

    Raises ValueError on a negative staleness (a token newer than the policy training it:
    a version bookkeeping bug).
    """
    staleness = np.asarray(staleness).reshape(-1)
    if staleness.size and staleness.min() < 0:
        raise ValueError(f"negative staleness {int(staleness.min())}: versions are out of sync")
    return np.bincount(staleness.astype(np.int64)).tolist() if staleness.size else []


def staleness_metrics(staleness: np.ndarray) -> dict:
    """Every ``staleness/*`` metric of a step, from one array of trained-token staleness.

    ``staleness/counts`` is the exact histogram (a JSON list, counts[d] = tokens at d);
    ``staleness/max`` equals ``staleness/max_observed`` (the name kept for older readers)
    and the largest d with a non-zero count; ``staleness/mean`` is the token mean.
    """
    staleness = np.asarray(staleness).reshape(-1)
    counts = staleness_counts(staleness)
    top = float(staleness.max()) if staleness.size else 0.0
    return {
        "staleness/counts": counts,
        "staleness/tokens": staleness,
        "staleness/max": top,
        "staleness/max_observed": top,
        "staleness/mean": float(staleness.mean()) if staleness.size else 0.0,
    }
