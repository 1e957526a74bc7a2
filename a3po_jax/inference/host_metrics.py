"""The host's counters: sample accounting and the serving loop's totals behind `stats()`.

Inference layer (host-side shell).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

# Seconds of recent decode steps the host's tokens_per_s is measured over.
THROUGHPUT_WINDOW_S = 10.0


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
    # Seconds the serving loop spent in each of its parts (totals): where the host loses
    # time between decode steps. "wait" is the part of "collect" blocked on the device;
    # the rest is host work, which the pipelined loop overlaps with the next step.
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
            "loop_s": dict(self.loop_s),
            # Seconds the serving loop has spent working (not idle, waiting for requests).
            "busy_s": sum(self.loop_s.values()) - self.loop_s.get("wait", 0.0),
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
