"""The step book's reading of which side waited: the trainer's wait and the host's serving
time, as shares of each step, from the step's own record; and the host's time by part."""

from types import SimpleNamespace

import pytest

from a3po_jax.inference.host_metrics import LOOP_PARTS
from a3po_jax.training.step_book import StepBook


def book() -> StepBook:
    cfg = SimpleNamespace(rollout=SimpleNamespace(groups_per_step=2))
    return StepBook(cfg, workers=None)


def test_wait_and_host_busy_are_shares_of_the_step():
    b = book()
    # The first record: the host's busy seconds so far have no earlier figure to subtract.
    first = b.demand({"time/step_s": 2.0, "time/wait_rollouts_s": 0.5, "host/busy_s": 10.0})
    assert first == {"time/wait_frac": 0.25}
    second = b.demand({"time/step_s": 2.0, "time/wait_rollouts_s": 0.0, "host/busy_s": 11.5})
    assert second == pytest.approx({"time/wait_frac": 0.0, "host/busy_frac": 0.75})


def test_a_replay_or_an_empty_step_has_no_host_share():
    b = book()
    assert b.demand({"time/step_s": 1.0, "time/wait_rollouts_s": 0.0}) == {"time/wait_frac": 0.0}
    assert b.demand({"time/wait_rollouts_s": 1.0}) == {}  # no step time: nothing to share


def loop_stats(hosts: int | None = None, **parts: float) -> dict:
    stats = {"loop_s": {part: parts.get(part, 0.0) for part in LOOP_PARTS}}
    if hosts is not None:
        stats["hosts_healthy"] = hosts
    return stats


def test_host_time_by_part_is_the_difference_since_the_last_record():
    b = book()
    # The first record: cumulative totals, nothing to subtract them from.
    assert b.host_time(loop_stats(admit=5.0, decode_wait=7.0), 100.0) == {}
    second = b.host_time(loop_stats(admit=5.25, decode_wait=8.0, collect=0.25), 102.0)
    assert set(second) == {f"host/{p}_s" for p in LOOP_PARTS} | {"host/idle_s"}
    assert second["host/admit_s"] == pytest.approx(0.25)
    assert second["host/decode_wait_s"] == pytest.approx(1.0)
    assert second["host/collect_s"] == pytest.approx(0.25)
    assert second["host/dispatch_s"] == 0.0
    # Idle: the 2 s since the last record less the 1.5 s worked.
    assert second["host/idle_s"] == pytest.approx(0.5)
    # A pool of two hosts: two host-seconds per second; a part summed over fewer hosts
    # than before (one went down) does not go negative.
    third = b.host_time(loop_stats(hosts=2, admit=5.0, decode_wait=8.5), 103.0)
    assert third["host/admit_s"] == 0.0 and third["host/decode_wait_s"] == pytest.approx(0.5)
    assert third["host/idle_s"] == pytest.approx(2 * 1.0 - 0.5)


def test_decode_steps_are_the_steps_run_since_the_last_record():
    b = book()
    assert b.host_time({**loop_stats(decode_wait=2.0), "decode_steps": 40}, 10.0) == {}
    second = b.host_time({**loop_stats(decode_wait=3.5), "decode_steps": 70}, 12.0)
    assert second["host/decode_steps"] == 30
    assert second["host/decode_wait_s"] == pytest.approx(1.5)
    # A pool that lost a host sums fewer steps than before: none, not a negative count.
    third = b.host_time({**loop_stats(decode_wait=3.5), "decode_steps": 50}, 13.0)
    assert third["host/decode_steps"] == 0
    # A host that does not count its steps (an older remote one): the parts alone.
    fourth = b.host_time(loop_stats(decode_wait=4.0), 14.0)
    assert "host/decode_steps" not in fourth and fourth["host/decode_wait_s"] == 0.5


def test_a_host_without_loop_times_or_a_replay_has_no_host_time():
    b = book()
    assert b.host_time({}, 1.0) == {} and b.host_time({"busy_s": 3.0}, 2.0) == {}
    # The first record with the times still has nothing to subtract them from.
    assert b.host_time(loop_stats(admit=1.0), 3.0) == {}


def test_compile_time_is_the_compiling_since_the_last_record(monkeypatch):
    from a3po_jax.training import compilation

    totals = iter([10.0, 12.5, 12.5, 13.0])
    monkeypatch.setattr(compilation, "compile_seconds", lambda: next(totals))
    b = book()  # reads 10.0: the run's start
    assert b.compile_time() == {"time/compile_s": 2.5}
    assert b.compile_time() == {"time/compile_s": 0.0}
    assert b.compile_time() == {"time/compile_s": 0.5}
