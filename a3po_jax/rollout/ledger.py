"""The per-run prompt ledger: every admission, training, drop, checkpoint and resume of a
run, one JSON line each, and :func:`audit`, which replays it and proves (or refutes) that
every prompt drawn was trained exactly once or dropped with a reason.

Rollout layer (host-side shell; plain Python, nothing pickled, nothing enters jit).

``run_dir/ledger.jsonl`` is append-only; each event is one line, flushed when written (a
``kill -9`` loses at most the line being written, which :func:`read_events` skips). Events:

* ``start``: a fresh run (everything before it belongs to an abandoned attempt);
* ``admit``: group id, prompt id, iterator position (epoch, index), admitted version;
* ``train``: group id, the training step (1-based, the checkpoint/metrics step) and the
  version the step started from;
* ``drop``: group id and reason (``stale``, ``host_error``, ``host_lost``, ``aborted``,
  ``nonfinite_step``, ...), with the step for a skipped step;
* ``filter``: group id and reason (``zero_variance``: every sample got the same reward,
  ``rollout.dynamic_sampling``) and whether a fresh prompt was drawn in its place
  (``refilled``). A filtered group is finished like a dropped one: never trained, never
  re-issued, its position not drawn again (unless a resume voids the event);
* ``checkpoint``: the moment the rollout workers' state was taken for the checkpoint of a
  step, with the ids of the groups admitted and not yet trained (the pending set) and, where
  the checkpoint saves complete ones beside it (``one_step_off``, lockstep ``async``), the
  ids of those (``held``);
* ``resume``: the run restarted from the checkpoint of a step; every event after that
  checkpoint's ``checkpoint`` event is void (those steps are redone, those prompts drawn
  again);
* ``reissue``: a pending group of the checkpoint regenerated after the resume (same group
  id, same position);
* ``restore_held``: a pending group of the checkpoint put back after the resume as it was
  saved beside it (complete, with its admitted version): not regenerated.

Check a run: ``python -m a3po_jax.cli.ledger RUN_DIR`` (exit status 1 if the audit
fails).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"


def ledger_path(run_dir: str | Path) -> Path:
    """Where a run's ledger lives."""
    return Path(run_dir) / LEDGER_FILE


def _position(position: Any) -> list[int]:
    """``{"epoch", "index"}`` (a prompt iterator state) or a pair as ``[epoch, index]``."""
    if isinstance(position, dict):
        return [int(position["epoch"]), int(position["index"])]
    epoch, index = position
    return [int(epoch), int(index)]


class Ledger:
    """Appends ledger events to ``path`` (thread-safe; one flushed JSON line per event).

    Args:
      path: the ledger file (``run_dir/ledger.jsonl``); created if missing, appended to.
      fsync: also ``os.fsync`` after every event (survives a machine crash, not only a
        killed process; costs a disk sync per event).
    """

    def __init__(self, path: str | Path, *, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        # A line cut short by a kill -9 must not glue onto the next event.
        if self._file.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._file.write("\n")
                    self._file.flush()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields, "t": round(time.time(), 3)})
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
                if self._fsync:
                    os.fsync(self._file.fileno())
            except OSError as err:  # a failed write() does not say which file
                raise OSError(err.errno, err.strerror, str(self.path)) from err

    def start(self, **fields: Any) -> None:
        self.write("start", **fields)

    def admit(self, group_id: int, prompt_id: str, position: Any, version: int) -> None:
        self._group_event("admit", group_id, prompt_id, position, version)

    def train(self, group_id: int, *, step: int, version: int | None = None) -> None:
        self.write(
            "train",
            group=int(group_id),
            step=int(step),
            version=None if version is None else int(version),
        )

    def drop(self, group_id: int, reason: str, *, step: int | None = None) -> None:
        self.write("drop", group=int(group_id), reason=str(reason), step=step)

    def filter(self, group_id: int, reason: str, *, refilled: bool) -> None:
        self.write("filter", group=int(group_id), reason=str(reason), refilled=bool(refilled))

    def checkpoint(
        self, step: int, pending: Iterable[int], *, held: Iterable[int] | None = None
    ) -> None:
        fields = {} if held is None else {"held": sorted(int(g) for g in held)}
        self.write("checkpoint", step=int(step), pending=sorted(int(g) for g in pending), **fields)

    def resume(self, step: int, *, version: int | None = None) -> None:
        self.write("resume", step=int(step), version=version)

    def reissue(self, group_id: int, prompt_id: str, position: Any, version: int) -> None:
        self._group_event("reissue", group_id, prompt_id, position, version)

    def restore_held(self, group_id: int, prompt_id: str, position: Any, version: int) -> None:
        self._group_event("restore_held", group_id, prompt_id, position, version)

    def _group_event(
        self, kind: str, group_id: int, prompt_id: str, position: Any, version: int
    ) -> None:
        # admit, reissue and restore_held each put one prompt's group in flight at a version.
        self.write(
            kind,
            group=int(group_id),
            prompt=str(prompt_id),
            pos=_position(position),
            version=int(version),
        )

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()


def read_events(path: str | Path) -> list[dict]:
    """The ledger's events in order; a torn line (a kill mid-write) is skipped with a
    warning, anything else unparsable raises ValueError."""
    events = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: skipping a torn ledger line %r", path, n, line[:80])
            continue
        if not isinstance(event, dict) or "event" not in event:
            raise ValueError(f"{path}:{n}: not a ledger event: {line[:200]!r}")
        events.append(event)
    return events


@dataclasses.dataclass
class Audit:
    """What :func:`audit` found. ``ok`` is True when every position drawn (net of what
    resumes rolled back) was trained exactly once, dropped or filtered with a reason, or is
    still in flight at the end of the ledger, and no bookkeeping anomaly was seen."""

    admitted: int = 0  # positions drawn (effective admissions)
    trained: int = 0  # positions trained (once)
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason
    filtered: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason
    in_flight_at_end: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    trained_twice: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)
    drawn_twice: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)
    trained_and_dropped: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    lost: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # pending, not reissued
    skipped_positions: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    anomalies: list[str] = dataclasses.field(default_factory=list)
    resumes: int = 0
    reissued: int = 0
    restored_held: int = 0  # pending groups put back as saved beside their checkpoint
    voided_events: int = 0
    # Training steps with their trained groups (effective), for checks on order.
    steps: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Effective admissions: group id -> position, in admission order.
    positions: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.trained_twice
            or self.drawn_twice
            or self.trained_and_dropped
            or self.lost
            or self.skipped_positions
            or self.anomalies
        )

    def summary(self) -> str:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        filtered = ", ".join(f"{k} {v}" for k, v in sorted(self.filtered.items())) or "none"
        lines = [
            f"ledger audit: {'OK' if self.ok else 'FAILED'}",
            f"  positions drawn {self.admitted}: trained {self.trained}, dropped "
            f"{sum(self.dropped.values())} ({dropped}), filtered "
            f"{sum(self.filtered.values())} ({filtered}), in flight at the end "
            f"{len(self.in_flight_at_end)}",
            f"  resumes {self.resumes}, groups re-issued {self.reissued}, restored as saved "
            f"{self.restored_held}, events voided by resumes {self.voided_events}",
        ]
        problems = {
            "trained more than once (position: groups)": self.trained_twice,
            "drawn more than once (position: groups)": self.drawn_twice,
            "trained and dropped (or filtered)": self.trained_and_dropped,
            "lost at a resume (pending, never re-issued or restored)": self.lost,
            "positions skipped": self.skipped_positions,
            "anomalies": self.anomalies,
        }
        for name, items in problems.items():
            if items:
                shown = list(items.items() if isinstance(items, dict) else items)
                more = f" ... ({len(shown)} in all)" if len(shown) > 10 else ""
                lines.append(f"  {name}: {shown[:10]}{more}")
        return "\n".join(lines)


def _effective(events: list[dict], result: Audit) -> list[dict]:
    """The events a resume did not roll back: at ``resume`` from step s, everything after
    the last ``checkpoint`` event of step s is void; a ``start`` voids everything before."""
    effective: list[dict] = []
    for event in events:
        kind = event["event"]
        if kind == "start":
            result.voided_events += len(effective)
            effective = [event]
        elif kind == "resume":
            step = int(event["step"])
            result.resumes += 1
            at = None
            for i in range(len(effective) - 1, -1, -1):
                e = effective[i]
                if e["event"] == "checkpoint" and int(e["step"]) == step:
                    at = i
                    break
            if at is None:
                result.anomalies.append(
                    f"resume from step {step} but the ledger has no checkpoint event of "
                    "that step (nothing rolled back)"
                )
                effective.append(event)
                continue
            result.voided_events += len(effective) - at - 1
            effective = effective[: at + 1] + [event]
        else:
            effective.append(event)
    return effective


@dataclasses.dataclass
class _Replay:
    """What the replay of a ledger's effective events knows so far (see :func:`audit`)."""

    result: Audit
    position: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # group -> the steps that trained it
    trained_at: dict[int, list[int]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    dropped: dict[int, str] = dataclasses.field(default_factory=dict)
    filtered: set[int] = dataclasses.field(default_factory=set)  # dropped by a filter event
    by_position: dict[tuple[int, int], list[int]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    awaiting_reissue: set[int] = dataclasses.field(default_factory=set)
    last_checkpoint_pending: set[int] | None = None
    last_checkpoint_held: set[int] = dataclasses.field(default_factory=set)
    held_at_resume: set[int] = dataclasses.field(default_factory=set)

    def live(self, group: int) -> bool:
        finished = self.trained_at.get(group) or group in self.dropped
        return group in self.position and not finished

    def apply(self, event: dict) -> None:
        kind = event["event"]
        group = int(event["group"]) if "group" in event else None
        if kind == "admit":
            self._admit(group, event)
        elif kind == "train":
            self._train(group, event)
        elif kind in ("drop", "filter"):
            self._finish(group, event)
        elif kind == "checkpoint":
            self._checkpoint(event)
        elif kind == "resume":
            self.lose_awaiting()
            self.awaiting_reissue = set(self.last_checkpoint_pending or ())
            self.held_at_resume = set(self.last_checkpoint_held)
        elif kind in ("reissue", "restore_held"):
            self._reissue(group, event)

    def lose_awaiting(self) -> None:
        """The groups still awaiting their re-issue are lost."""
        self.result.lost.extend(
            self.position[g] for g in sorted(self.awaiting_reissue) if g in self.position
        )

    def _admit(self, group: int, event: dict) -> None:
        if group in self.position:
            self.result.anomalies.append(f"group {group} admitted twice")
            return
        pos = tuple(event["pos"])
        self.position[group] = pos
        self.by_position[pos].append(group)

    def _train(self, group: int, event: dict) -> None:
        if group not in self.position:
            self.result.anomalies.append(f"group {group} trained but never admitted")
            return
        if group in self.dropped:
            self.result.trained_and_dropped.append(self.position[group])
        self.trained_at[group].append(int(event["step"]))
        self.result.steps.setdefault(int(event["step"]), []).append(group)

    def _finish(self, group: int, event: dict) -> None:
        if group not in self.position:
            return  # dropped before its admission was logged (nothing was drawn)
        if self.trained_at.get(group):
            self.result.trained_and_dropped.append(self.position[group])
        if group not in self.dropped and event["event"] == "filter":
            self.filtered.add(group)
        self.dropped.setdefault(group, str(event["reason"]))

    def _checkpoint(self, event: dict) -> None:
        pending = {int(g) for g in event["pending"]}
        expected = {g for g in self.position if self.live(g)}
        if pending != expected:
            self.result.anomalies.append(
                f"checkpoint of step {event['step']}: pending {sorted(pending)} but the "
                f"ledger has {sorted(expected)} admitted and not finished"
            )
        self.last_checkpoint_pending = pending
        held = {int(g) for g in event.get("held", ())}
        if held - pending:
            self.result.anomalies.append(
                f"checkpoint of step {event['step']}: holds {sorted(held - pending)}, "
                "which are not pending"
            )
        self.last_checkpoint_held = held

    def _reissue(self, group: int, event: dict) -> None:
        kind = event["event"]
        what = "re-issued" if kind == "reissue" else "restored as saved"
        if group not in self.awaiting_reissue:
            self.result.anomalies.append(f"group {group} {what} but was not pending")
        elif self.position.get(group) != tuple(event["pos"]):
            self.result.anomalies.append(
                f"group {group} {what} at position {event['pos']}, admitted at "
                f"{self.position.get(group)}"
            )
        elif kind == "restore_held" and group not in self.held_at_resume:
            self.result.anomalies.append(
                f"group {group} restored as saved but its checkpoint did not hold it"
            )
        self.awaiting_reissue.discard(group)
        if kind == "reissue":
            self.result.reissued += 1
        else:
            self.result.restored_held += 1

    def tally(self) -> None:
        """The totals of the replayed events into the result."""
        result, position, trained_at, dropped = (
            self.result,
            self.position,
            self.trained_at,
            self.dropped,
        )
        for pos, groups in self.by_position.items():
            if len(groups) > 1:
                result.drawn_twice[pos] = groups
            steps = [s for g in groups for s in trained_at.get(g, [])]
            if len(steps) > 1:
                result.trained_twice[pos] = steps
        result.admitted = len(self.by_position)
        result.trained = sum(1 for g in position if trained_at.get(g))
        finished = [g for g in position if g in dropped]
        result.dropped = dict(
            collections.Counter(dropped[g] for g in finished if g not in self.filtered)
        )
        result.filtered = dict(
            collections.Counter(dropped[g] for g in finished if g in self.filtered)
        )
        result.in_flight_at_end = sorted(position[g] for g in position if self.live(g))
        result.positions = dict(position)
        # The prompt order is drawn without gaps: within each epoch, indices 0..max are all there.
        epochs: dict[int, set[int]] = collections.defaultdict(set)
        for epoch, index in self.by_position:
            epochs[epoch].add(index)
        for epoch, indices in sorted(epochs.items()):
            result.skipped_positions.extend(
                (epoch, i) for i in range(max(indices) + 1) if i not in indices
            )


def audit(path: str | Path) -> Audit:
    """Replays the ledger at ``path`` (a file or a run dir) and checks exactly-once.

    Resumes roll back what the resumed run redoes (see :func:`_effective`): train events of
    steps after the checkpoint, admissions after the checkpoint's snapshot (their positions
    are drawn again), drops after it. What remains must satisfy: each position drawn once;
    each drawn position trained exactly once, dropped with a reason, or in flight when the
    ledger ends; every group pending at a checkpoint that a resume rolled back to is
    re-issued or restored as saved (``restore_held``, only groups the checkpoint says it
    holds); no position skipped in the prompt order. A ``filter`` event finishes its group as
    a ``drop`` does (counted apart, by reason, in ``Audit.filtered``).
    """
    path = Path(path)
    if path.is_dir():
        path = ledger_path(path)
    result = Audit()
    replay = _Replay(result)
    for event in _effective(read_events(path), result):
        replay.apply(event)
    replay.lose_awaiting()
    replay.tally()
    return result
