"""The rollout queue's cumulative counters: what they count, how they add up, and how a
checkpoint's counters come back (rollout layer, host side; plain Python, never enters jit).

:class:`QueueCounters` is the bookkeeping half of :class:`a3po_jax.rollout.queue.RolloutQueue`
(which holds the groups and the lock): every count changes through one of its methods,
:meth:`QueueCounters.as_dict` is the queue's ``counters()``, :func:`check_invariant` says
whether those add up, and :meth:`QueueCounters.from_state` is the arithmetic of a restore.
"""

from __future__ import annotations

import collections
import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from a3po_jax.core.types import Rollout, RolloutGroup


def _counter(counts: Mapping[str, int]) -> collections.Counter[str]:
    return collections.Counter({k: int(v) for k, v in counts.items()})


@dataclasses.dataclass
class QueueCounters:
    """Cumulative counts of a :class:`a3po_jax.rollout.queue.RolloutQueue` (see its
    docstring for what each means and the invariants they satisfy); the caller holds the
    queue's lock."""

    # Groups (a group counts as produced from its first sample).
    produced_groups: int = 0
    completed_groups: int = 0
    consumed_groups: int = 0
    filtered_groups: int = 0
    refilled_groups: int = 0
    overtaking_groups: int = 0
    # Empty slots taken by batches, and those in the ready order not taken yet.
    empty_slots: int = 0
    held_empty_slots: int = 0
    # Samples and their completion tokens (discarded: late samples of a dropped group).
    produced_samples: int = 0
    discarded_samples: int = 0
    consumed_samples: int = 0
    filtered_samples: int = 0
    generated_tokens: int = 0
    consumed_tokens: int = 0
    held_tokens: int = 0
    filtered_tokens: int = 0
    # By drop reason.
    dropped_groups: Counter[str] = dataclasses.field(default_factory=Counter)
    dropped_samples: Counter[str] = dataclasses.field(default_factory=Counter)
    dropped_tokens: Counter[str] = dataclasses.field(default_factory=Counter)

    def sample(self, rollout: Rollout) -> None:
        """One sample filed (generated, held from now on)."""
        self.produced_samples += 1
        self.generated_tokens += rollout.num_tokens
        self.held_tokens += rollout.num_tokens

    def drop(self, reason: str, samples: Iterable[Rollout]) -> None:
        """One group dropped with the samples it had received."""
        samples = list(samples)
        tokens = sum(r.num_tokens for r in samples)
        self.held_tokens -= tokens
        self.dropped_samples[reason] += len(samples)
        self.dropped_tokens[reason] += tokens
        self.dropped_groups[reason] += 1

    def filter(self, rollouts: list[Rollout], *, refilled: bool) -> None:
        """One complete group filtered: refilled, or held as an empty slot."""
        tokens = sum(r.num_tokens for r in rollouts)
        self.held_tokens -= tokens
        self.filtered_groups += 1
        self.filtered_samples += len(rollouts)
        self.filtered_tokens += tokens
        if refilled:
            self.refilled_groups += 1
        else:
            self.held_empty_slots += 1

    def consume(self, taken: list[RolloutGroup], *, empty: int, group_size: int) -> None:
        """A batch took ``taken`` and ``empty`` empty slots."""
        tokens = sum(r.num_tokens for g in taken for r in g.rollouts)
        self.empty_slots += empty
        self.held_empty_slots -= empty
        self.consumed_groups += len(taken)
        self.consumed_samples += len(taken) * group_size
        self.consumed_tokens += tokens
        self.held_tokens -= tokens

    def held_group(self, group: RolloutGroup) -> None:
        """A complete group put back at a restore: produced once, before the save."""
        tokens = sum(r.num_tokens for r in group.rollouts)
        self.produced_groups += 1
        self.completed_groups += 1
        self.produced_samples += group.size
        self.generated_tokens += tokens
        self.held_tokens += tokens

    def as_dict(self, *, pending_groups: int, pending_samples: int, ready: int) -> dict:
        """The queue's ``counters()``; ``ready`` counts the ready order's entries (empty
        slots included)."""
        return {
            "produced_samples": self.produced_samples,
            "discarded_samples": self.discarded_samples,
            "consumed_samples": self.consumed_samples,
            "produced_groups": self.produced_groups,
            "completed_groups": self.completed_groups,
            "consumed_groups": self.consumed_groups,
            "dropped_groups": dict(self.dropped_groups),
            "dropped_total": sum(self.dropped_groups.values()),
            "generated_tokens": self.generated_tokens,
            "consumed_tokens": self.consumed_tokens,
            "dropped_samples": dict(self.dropped_samples),
            "dropped_tokens": dict(self.dropped_tokens),
            "held_tokens": self.held_tokens,
            "overtaking_groups": self.overtaking_groups,
            "filtered_groups": self.filtered_groups,
            "filtered_samples": self.filtered_samples,
            "filtered_tokens": self.filtered_tokens,
            "refilled_groups": self.refilled_groups,
            "empty_slots": self.empty_slots,
            "held_empty_slots": self.held_empty_slots,
            "pending_groups": pending_groups,
            "pending_samples": pending_samples,
            "ready_groups": ready - self.held_empty_slots,
        }

    @classmethod
    def from_state(
        cls,
        state: dict,
        *,
        group_size: int,
        regenerated: bool,
        held: Sequence[RolloutGroup] = (),
    ) -> QueueCounters:
        """The counters of a checkpoint's ``state`` in an empty queue: the groups held at
        save time are counted as dropped (``"restart"``), or with ``regenerated`` taken out
        of the produced counts, to be produced again, all but ``held`` (complete groups saved
        with the checkpoint, put back: counted as produced once, before the save). Fields
        absent in checkpoints from before they existed start at 0; empty slots held at save
        time are given back (their groups are not re-issued): counted as refilled.

        Raises:
          ValueError: ``held`` without ``regenerated``, more held groups than the
            checkpoint's queue had complete, or a group size that is not ``group_size``.
        """
        _check_held(state, group_size=group_size, regenerated=regenerated, held=held)

        def get(key: str) -> int:
            return int(state.get(key, 0))

        def held_samples() -> int:
            return int(state["pending_samples"]) + int(state["ready_groups"]) * group_size

        lost = int(state["pending_groups"]) + int(state["ready_groups"])
        counters = cls(
            produced_samples=int(state["produced_samples"]),
            discarded_samples=int(state["discarded_samples"]),
            consumed_samples=int(state["consumed_samples"]),
            produced_groups=int(state["produced_groups"]),
            completed_groups=int(state["completed_groups"]),
            consumed_groups=int(state["consumed_groups"]),
            dropped_groups=_counter(state["dropped_groups"]),
            generated_tokens=get("generated_tokens"),
            consumed_tokens=get("consumed_tokens"),
            dropped_samples=_counter(state.get("dropped_samples", {})),
            dropped_tokens=_counter(state.get("dropped_tokens", {})),
            overtaking_groups=get("overtaking_groups"),
            filtered_groups=get("filtered_groups"),
            filtered_samples=get("filtered_samples"),
            filtered_tokens=get("filtered_tokens"),
            refilled_groups=get("refilled_groups") + get("held_empty_slots"),
            empty_slots=get("empty_slots"),
        )
        if regenerated:
            counters.produced_groups -= lost
            counters.completed_groups -= int(state["ready_groups"])
            counters.produced_samples -= held_samples()
            counters.generated_tokens -= get("held_tokens")
        elif lost:
            counters.dropped_groups["restart"] += lost
            if "held_tokens" in state:  # the held samples are lost with the groups
                counters.dropped_samples["restart"] += held_samples()
                counters.dropped_tokens["restart"] += int(state["held_tokens"])
        for group in held:
            counters.held_group(group)
        return counters


def _check_held(
    state: dict, *, group_size: int, regenerated: bool, held: Sequence[RolloutGroup]
) -> None:
    """That ``held`` and the queue's ``group_size`` fit the checkpoint's ``state``."""
    if held and not regenerated:
        raise ValueError("held groups are restored with regenerated=True")
    if len(held) > int(state["ready_groups"]):
        raise ValueError(
            f"{len(held)} held groups but the checkpoint's queue had "
            f"{state['ready_groups']} complete ones"
        )
    for group in held:
        if group.size != group_size:
            raise ValueError(
                f"held group {group.group_id} has {group.size} samples, the queue's "
                f"group_size is {group_size}"
            )
    if int(state["group_size"]) != group_size:
        raise ValueError(
            f"checkpointed group_size {state['group_size']} != queue group_size {group_size}"
        )


def check_invariant(c: dict) -> None:
    """Raises AssertionError if the group counts of ``c`` (a queue's ``counters()``) do not
    add up."""
    held = c["consumed_groups"] + c["dropped_total"] + c["pending_groups"] + c["ready_groups"]
    if c["produced_groups"] != held + c["filtered_groups"]:
        raise AssertionError(f"produced_groups != consumed + dropped + filtered + held: {c}")
    slots = c["refilled_groups"] + c["empty_slots"] + c["held_empty_slots"]
    if c["filtered_groups"] != slots:
        raise AssertionError(f"filtered_groups != refilled + empty slots: {c}")
