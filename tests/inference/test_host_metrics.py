"""The serving loop's clock: its parts never overlap, whichever part a device wait happens
in, and they add up to the loop's time."""

import collections

import pytest

from a3po_jax.inference.host_metrics import LOOP_PARTS, HostMetrics, LoopClock


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_laps_charge_their_part_less_the_waits_inside_them():
    t = FakeClock()
    loop_s: collections.Counter[str] = collections.Counter()
    clock = LoopClock(loop_s, clock=t)
    t.now = 5.0  # before the iteration starts: idle, charged to nothing
    clock.start()
    t.now = 5.5
    clock.waited("decode_wait", 0.25)  # a swap's flush waits inside inbox_and_swap
    clock.lap("inbox_and_swap")
    t.now = 6.0
    clock.lap("admit")
    t.now = 7.0
    clock.waited("decode_wait", 0.5)
    clock.waited("prefill_wait", 0.125)
    clock.lap("collect")
    assert loop_s == pytest.approx(
        {
            "inbox_and_swap": 0.25,
            "decode_wait": 0.75,
            "admit": 0.5,
            "prefill_wait": 0.125,
            "collect": 0.375,
        }
    )
    assert sum(loop_s.values()) == pytest.approx(7.0 - 5.0)  # the iteration's time, once


def test_stats_report_every_part_and_busy_as_their_sum():
    metrics = HostMetrics()
    metrics.loop_s.update({"admit": 0.5, "decode_wait": 2.0, "collect": 0.25})
    totals = metrics.totals()
    assert set(totals["loop_s"]) == set(LOOP_PARTS)
    assert totals["loop_s"]["dispatch"] == 0.0
    assert totals["busy_s"] == pytest.approx(2.75)
