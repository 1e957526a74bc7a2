"""The host's counters: sample accounting and the serving loop's totals behind `stats()`,
and the clock that splits the loop's time by part (`LoopClock`, `loop_time`).

Inference layer (host-side shell).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

# Seconds of recent decode steps the host's tokens_per_s is measured over.
THROUGHPUT_WINDOW_S = 10.0

# The serving loop's parts (the keys of `loop_s`), disjoint: together they are the seconds
# the loop worked. "inbox_and_swap": taking requests and cancellations, and a weight swap
# (its flush and cache recompute included); "admit": dispatching the prefill and insert of
# new samples; "dispatch": dispatching decode steps; "collect": reading tokens back, stop
# checks and handing results on; "prefill_wait" and "decode_wait": blocked on the device for
# an insert's first tokens (the prefill) and for a decode step's tokens (sampling included:
# it runs inside the step).
LOOP_PARTS = ("inbox_and_swap", "admit", "dispatch", "collect", "prefill_wait", "decode_wait")


@dataclasses.dataclass
class HostMetrics:
    """Counters of one host. Sample accounting and `recent` are written under the host's
    lock; the serving-loop totals by the serving thread alone (read anywhere)."""

    # Sample accounting (`InferenceHost.counters`).
    requests: int = 0
    samples_requested: int = 0
    samples_delivered: int = 0
    lost_reasons: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Serving-loop totals (`InferenceHost.stats`).
    samples_done: int = 0
    tokens_generated: int = 0
    steps: int = 0
    weight_updates: int = 0
    # (time, tokens produced) of the steps within the throughput window.
    recent: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=collections.deque
    )
    last_step_s: float = 0.0
    # In-flight swaps that recomputed running samples' caches, and what that cost.
    kv_recomputes: int = 0
    kv_recompute_tokens: int = 0
    kv_recompute_s: float = 0.0
    last_kv_recompute_s: float = 0.0
    # Seconds the serving loop spent in each of its parts (totals, `LOOP_PARTS`): where the
    # host loses time between decode steps. All but the two waits is host work, which the
    # pipelined loop overlaps with the next step.
    loop_s: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def record_recent(self, now: float, produced: int) -> None:
        """A step read at `now` that produced `produced` tokens (call with the lock held)."""
        self.recent.append((now, produced))
        while self.recent and now - self.recent[0][0] > THROUGHPUT_WINDOW_S:
            self.recent.popleft()

    def record_recompute(self, seconds: float, tokens: int) -> None:
        self.last_kv_recompute_s = seconds
        self.kv_recompute_s += seconds
        self.kv_recompute_tokens += tokens
        self.kv_recomputes += 1

    def tokens_per_s(self, recent: list[tuple[float, int]], now: float) -> float:
        """Tokens per second over `recent` (the window's steps, copied under the lock)."""
        span = (now - recent[0][0]) if len(recent) > 1 else 0.0
        tokens = sum(n for _, n in recent[1:]) if len(recent) > 1 else 0
        return tokens / span if span > 0 else 0.0

    def totals(self) -> dict[str, Any]:
        """The serving loop's totals as `stats()` reports them."""
        # Key by key: the serving thread may be adding to the counter meanwhile.
        loop_s = {part: self.loop_s.get(part, 0.0) for part in LOOP_PARTS}
        return {
            "samples_done": self.samples_done,
            "tokens_generated": self.tokens_generated,
            "decode_steps": self.steps,
            "weight_updates": self.weight_updates,
            "last_step_s": self.last_step_s,
            # Cost of the in-flight cache recompute: swaps that recomputed, tokens
            # recomputed and seconds spent (totals), and the last swap's seconds.
            "kv_recomputes": self.kv_recomputes,
            "kv_recompute_tokens": self.kv_recompute_tokens,
            "kv_recompute_s": self.kv_recompute_s,
            "last_kv_recompute_s": self.last_kv_recompute_s,
            "loop_s": loop_s,
            # Seconds the serving loop has spent working (not idle, waiting for requests).
            "busy_s": sum(loop_s.values()),
        }

    def counters(self, outstanding: int) -> dict[str, Any]:
        """Sample accounting (call with the lock held): `outstanding` samples not returned."""
        lost = dict(self.lost_reasons)
        return {
            "requests": self.requests,
            "samples_requested": self.samples_requested,
            "samples_delivered": self.samples_delivered,
            "samples_lost": sum(lost.values()),
            "samples_outstanding": outstanding,
            "lost_reasons": lost,
        }


def loop_time(
    before: dict[str, float], after: dict[str, float], seconds: float, hosts: int = 1
) -> dict[str, float]:
    """The serving loop's seconds by part between two readings of `stats()["loop_s"]`
    `seconds` apart, and "idle": the rest of those seconds (times `hosts` for a pool, whose
    parts sum its hosts'). A part never goes below zero (a pool's sum loses a host that
    went down)."""
    out = {part: max(after.get(part, 0.0) - before.get(part, 0.0), 0.0) for part in LOOP_PARTS}
    out["idle"] = max(seconds * max(hosts, 1) - sum(out.values()), 0.0)
    return out


class LoopClock:
    """Charges the serving loop's time to its parts (`LOOP_PARTS`) in `loop_s`: `lap(part)`
    charges the seconds since the last lap to `part`, less the device waits `waited`
    recorded meanwhile, which are charged to their own part. So the parts never overlap,
    whichever part a wait happens in (a swap's flush waits inside "inbox_and_swap")."""

    def __init__(
        self, loop_s: collections.Counter[str], clock: Callable[[], float] = time.perf_counter
    ):
        self._loop_s = loop_s
        self._clock = clock
        self._mark = clock()
        self._waited = 0.0  # device waits charged since the mark

    def start(self) -> None:
        """Starts a lap now (a new iteration: the time since the last one was idle)."""
        self._mark, self._waited = self._clock(), 0.0

    def lap(self, part: str) -> None:
        now = self._clock()
        self._loop_s[part] += max(now - self._mark - self._waited, 0.0)
        self._mark, self._waited = now, 0.0

    def waited(self, part: str, seconds: float) -> None:
        """`seconds` blocked on the device, charged to `part` ("prefill_wait" or
        "decode_wait")."""
        self._loop_s[part] += seconds
        self._waited += seconds
