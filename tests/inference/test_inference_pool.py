"""HostPool: placement over several hosts, failure detection, failover and return.

The hosts here are `FakeHost`s: a serving thread that "generates" each sample after a short
delay, whose tokens are a pure function of (seed, sample index, weights version), so a
re-issued request gives the same sample a fresh host would. A fake can be killed (calls fail
and its streams break, as a killed gRPC host looks to its client), frozen (calls time out
and nothing is generated, as a SIGSTOPped host) and revived. The real thing, gRPC host
processes killed under a training run, is tests/e2e/test_trainer_failover.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import numpy as np
import pytest

from a3po_jax.inference.protocol import Host
from a3po_jax.inference.remote.membership_file import has_ended
from a3po_jax.inference.remote.pool import HostPool
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    HostClosedError,
    InferenceError,
    SampleResult,
    SamplingParams,
    error_result,
)

PARAMS = {"w": np.zeros((2, 3), np.float32)}


def expected_tokens(seed: int, sample_index: int, version: int) -> list[int]:
    return [seed % 1000, sample_index, version]


class FakeHost:
    """An in-process stand-in for a remote host, with kill / freeze / revive switches."""

    def __init__(
        self, name: str, *, policy: str = "in_flight", delay: float = 0.02, invariant=False
    ):
        self.address = name
        self.policy = policy
        self.invariant = invariant
        self.delay = delay
        self.version = 0
        self.weight_pushes: list[int] = []
        self.accepted: list[str] = []
        self._work: queue.Queue[GenerateRequest] = queue.Queue()
        self._results: queue.Queue[SampleResult] = queue.Queue()
        self._running: set[str] = set()
        self._requests: dict[str, GenerateRequest] = {}
        self.dead = False
        self.frozen = threading.Event()
        self.stall = False  # answers stats but generates nothing (a hung engine loop)
        self.generated = 0
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # switches
    def kill(self):
        """As a killed process seen through its client: streams break, calls fail."""
        self.dead = True
        for rid in sorted(self._running):
            req = self._requests[rid]
            for i in range(req.num_samples):
                self._results.put(error_result(req, i, ErrorKind.TRANSPORT, "stream failed"))
        self._running.clear()
        while not self._work.empty():
            self._work.get_nowait()

    def revive(self):
        """A fresh process on the same address: own weights (version 0), nothing running."""
        self.version = 0
        self.dead = False

    # host interface
    def _check(self):
        if self.dead:
            raise HostClosedError(f"{self.address}: host unavailable")
        if self.frozen.is_set():
            time.sleep(0.05)
            raise InferenceError(f"{self.address}: Stats failed: DEADLINE_EXCEEDED")

    def submit(self, request: GenerateRequest) -> None:
        self._check()
        if len(request.prompt_tokens) > 8:
            raise ValueError("prompt longer than the largest bucket (8)")
        if request.request_id in self._running:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self._requests[request.request_id] = request
        self._running.add(request.request_id)
        self.accepted.append(request.request_id)
        self._work.put(request)

    def poll(self, timeout=None, max_results=None):
        if self.frozen.is_set():
            time.sleep(timeout or 0)
            return []
        out = []
        try:
            out.append(self._results.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def update_weights(self, params, version):
        self._check()
        if set(params) != set(PARAMS):
            raise ValueError(f"weights have names {sorted(params)}, expected {sorted(PARAMS)}")
        self.version = int(version)
        self.weight_pushes.append(int(version))

    def stats(self):
        self._check()
        return {
            "update_policy": self.policy,
            "batch_invariant": self.invariant,
            "version": self.version,
            "tokens_generated": self.generated,
            "samples_done": self.done,
            "slots_busy": len(self._running),
            "num_slots": 4,
            "queue_depth": 0,
            "tokens_per_s": 1.0,
            "live": True,
            # One second of admitting and two of waiting per sample done.
            "loop_s": {"admit": 1.0 * self.done, "decode_wait": 2.0 * self.done},
            "busy_s": 3.0 * self.done,
            "decode_steps": 5 * self.done,
        }

    def counters(self):
        return {"requests": len(self.accepted)}

    def close(self):
        self._stop.set()

    def _serve(self):
        while not self._stop.is_set():
            if self.frozen.is_set() or self.stall:
                time.sleep(0.01)
                continue
            try:
                req = self._work.get(timeout=0.05)
            except queue.Empty:
                continue
            for i in range(req.num_samples):
                time.sleep(self.delay)
                while (self.frozen.is_set() or self.stall) and not self._stop.is_set():
                    time.sleep(0.01)
                if self.dead or req.request_id not in self._running:
                    break
                tokens = expected_tokens(req.seed, i, self.version)
                self.generated += len(tokens)
                self.done += 1
                self._results.put(
                    SampleResult(
                        request_id=req.request_id,
                        sample_index=i,
                        prompt_tokens=req.prompt_tokens,
                        tokens=tokens,
                        logprobs=[-1.0] * len(tokens),
                        versions=[self.version] * len(tokens),
                        finish_reason="length",
                    )
                )
            self._running.discard(req.request_id)


def request(i: int, n: int = 2) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"g{i}",
        prompt_tokens=(1, 2, 3),
        num_samples=n,
        sampling=SamplingParams(max_new_tokens=3),
        seed=1000 + i,
    )


def collect(pool: HostPool, want: int, timeout: float = 20.0) -> list[SampleResult]:
    out: list[SampleResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < want:
        assert time.monotonic() < deadline, f"only {len(out)} of {want} results: {pool.counters()}"
        out.extend(pool.poll(timeout=0.1))
    time.sleep(0.2)  # nothing more may arrive
    out.extend(pool.poll(timeout=0.0))
    return out


def assert_each_sample_once(results, requests):
    seen = [(r.request_id, r.sample_index) for r in results]
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert set(seen) == {(q.request_id, i) for q in requests for i in range(q.num_samples)}


def make_pool(hosts, **kwargs):
    kwargs = {"health_interval_s": 0.1, "hang_timeout_s": 1.0, **kwargs}
    return HostPool(hosts, **kwargs)


def test_requests_spread_over_healthy_hosts_and_each_sample_arrives_once():
    a, b = FakeHost("a"), FakeHost("b")
    with make_pool([a, b]) as pool:
        reqs = [request(i) for i in range(8)]
        for r in reqs:
            pool.submit(r)
        results = collect(pool, 16)
        assert_each_sample_once(results, reqs)
        # Least-loaded placement with ties in turn: both hosts get work.
        assert len(a.accepted) >= 2 and len(b.accepted) >= 2
        assert len(a.accepted) + len(b.accepted) == 8
        for r in results:
            assert r.tokens.tolist() == expected_tokens(
                1000 + int(r.request_id[1:]), r.sample_index, 0
            )
        c = pool.counters()
        assert c["samples_requested"] == c["samples_delivered"] == 16
        assert c["reissued_requests"] == 0 and c["samples_lost"] == 0
        pool.check_invariant()


def test_killed_host_work_is_reissued_and_no_sample_is_delivered_twice(caplog):
    a, b = FakeHost("a", delay=0.05), FakeHost("b", delay=0.05)
    with make_pool([a, b]) as pool:
        pool.update_weights(PARAMS, 3)
        reqs = [request(i, n=4) for i in range(6)]
        for r in reqs:
            pool.submit(r)
        time.sleep(0.12)  # some samples of a's requests are out, the rest are not
        with caplog.at_level(logging.WARNING, logger="a3po_jax.inference.remote.pool"):
            a.kill()
            results = collect(pool, 24)
        assert_each_sample_once(results, reqs)
        assert all(r.finish_reason == "length" for r in results)
        # Re-issued samples are the ones a fresh host draws: same seed, same weights.
        for r in results:
            assert r.tokens.tolist() == expected_tokens(
                1000 + int(r.request_id[1:]), r.sample_index, 3
            )
        c = pool.counters()
        assert c["host_failures"] == {"a": 1, "b": 0}
        assert c["reissued_requests"] >= 1
        assert c["samples_lost"] == 0 and c["samples_outstanding"] == 0
        pool.check_invariant()
        assert "inference host a is down" in caplog.text
        assert pool.stats()["hosts_healthy"] == 1
        # New work goes to the survivor only.
        b_before = len(b.accepted)
        pool.submit(request(99))
        collect(pool, 2)
        assert len(b.accepted) == b_before + 1


def test_frozen_host_is_detected_its_late_results_discarded_and_it_rejoins_with_new_weights():
    a, b = FakeHost("a", delay=0.05), FakeHost("b", delay=0.05)
    with make_pool([a, b]) as pool:
        pool.update_weights(PARAMS, 1)
        reqs = [request(i, n=3) for i in range(4)]
        for r in reqs:
            pool.submit(r)
        time.sleep(0.06)
        a.frozen.set()  # stats time out, nothing generated
        results = collect(pool, 12)
        assert_each_sample_once(results, reqs)
        assert pool.counters()["host_failures"]["a"] == 1
        pool.update_weights(PARAMS, 2)  # a is down: it does not get this push now...
        assert a.version == 1
        a.frozen.clear()  # ...it wakes up, finishes its old work (discarded), and rejoins
        deadline = time.monotonic() + 10
        while pool.counters()["host_returns"]["a"] == 0:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        assert a.version == 2 and a.weight_pushes[-1] == 2  # newest weights before work
        time.sleep(0.5)
        assert pool.poll(timeout=0.1) == []  # a's late samples never reach the caller
        c = pool.counters()
        assert c["discarded_stale"] >= 1
        pool.check_invariant()
        more = [request(10 + i) for i in range(4)]
        for r in more:
            pool.submit(r)
        results = collect(pool, 8)
        assert_each_sample_once(results, more)
        assert any(rid.startswith("g1") for rid in a.accepted[-4:])  # a serves again


def test_hung_host_that_still_answers_is_marked_down_after_the_hang_timeout():
    a, b = FakeHost("a"), FakeHost("b")
    with make_pool([a, b], hang_timeout_s=0.5) as pool:
        a.stall = True  # stats fine, no token ever generated
        reqs = [request(i) for i in range(4)]
        for r in reqs:
            pool.submit(r)
        results = collect(pool, 8, timeout=10)
        assert_each_sample_once(results, reqs)
        hosts = pool.stats()["hosts"]
        assert not hosts["a"]["healthy"] and hosts["a"]["reason"].startswith("hung:")


def test_requests_wait_while_no_host_is_up_and_go_to_the_first_that_returns(caplog):
    a = FakeHost("a")
    with make_pool([a]) as pool:
        pool.update_weights(PARAMS, 5)
        with caplog.at_level(logging.WARNING, logger="a3po_jax.inference.remote.pool"):
            a.kill()
            pool.submit(request(0))  # transport failure: host down, request parked
            time.sleep(0.3)
            assert pool.poll(timeout=0.1) == []
            assert "all 1 inference hosts are down" in caplog.text
            assert pool.stats()["live"] is False and pool.stats()["queue_depth"] == 2
            a.revive()
            results = collect(pool, 2)
        assert a.weight_pushes[-1] == 5  # the returning host got the weights first...
        assert [r.tokens.tolist()[2] for r in results] == [5, 5]  # ...and served them
        assert "inference host a is back" in caplog.text
        pool.check_invariant()


def test_samples_are_reported_lost_after_max_reissues():
    a, b = FakeHost("a", delay=1.0), FakeHost("b", delay=1.0)
    with make_pool([a, b], max_reissues=1) as pool:
        pool.submit(request(0, n=2))
        time.sleep(0.1)
        victim, other = (a, b) if a.accepted else (b, a)
        victim.kill()  # re-issue 1 goes to the other host
        time.sleep(0.3)
        assert other.accepted == ["g0~retry1"]
        other.kill()  # no re-issue left: both samples lost
        results = collect(pool, 2)
        assert {r.finish_reason for r in results} == {"error"}
        assert all(r.error_kind is ErrorKind.LOST for r in results)
        c = pool.counters()
        assert c["samples_lost"] == 2 and c["reissued_requests"] == 1
        assert sum(c["lost_reasons"].values()) == 2
        pool.check_invariant()


def test_bad_requests_and_bad_weights_raise_and_change_nothing():
    a, b = FakeHost("a"), FakeHost("b")
    with make_pool([a, b]) as pool:
        long = GenerateRequest(request_id="long", prompt_tokens=tuple(range(20)))
        with pytest.raises(ValueError, match="largest bucket"):
            pool.submit(long)
        pool.submit(request(0))
        with pytest.raises(ValueError, match="already in flight"):
            pool.submit(request(0))
        with pytest.raises(ValueError, match="expected"):
            pool.update_weights({"v": np.zeros(2)}, 1)
        with pytest.raises(ValueError, match="~retry"):
            pool.submit(GenerateRequest(request_id="x~retry1", prompt_tokens=(1,)))
        collect(pool, 2)
        c = pool.counters()
        assert c["requests"] == 1 and c["samples_requested"] == 2
        assert pool.stats()["hosts_healthy"] == 2


def test_hosts_must_agree_on_the_update_policy_and_one_must_be_reachable():
    with pytest.raises(ValueError, match="disagree on update_policy"):
        HostPool([FakeHost("a", policy="drain"), FakeHost("b", policy="in_flight")])
    dead = FakeHost("a")
    dead.kill()
    with pytest.raises(InferenceError, match="no inference host reachable"):
        HostPool([dead])
    with pytest.raises(ValueError, match="at least one host"):
        HostPool([])
    with pytest.raises(ValueError, match="hang_timeout_s"):
        HostPool([FakeHost("a")], hang_timeout_s=0)


def test_a_pool_is_batch_invariant_only_if_every_host_is():
    for invariant, expected in (((True, True), True), ((True, False), False)):
        pool = HostPool([FakeHost(n, invariant=i) for n, i in zip("ab", invariant, strict=True)])
        try:
            assert pool.stats()["batch_invariant"] is expected
        finally:
            pool.close()


def test_a_pool_sums_its_hosts_loop_time_by_part_and_decode_steps():
    a, b = FakeHost("a"), FakeHost("b")
    a.done, b.done = 1, 3
    with HostPool([a, b]) as pool:
        stats = pool.stats()
    assert stats["loop_s"] == {"admit": 4.0, "decode_wait": 8.0} and stats["busy_s"] == 12.0
    assert stats["decode_steps"] == 20


def test_every_host_kind_implements_the_host_protocol():
    # The trainer and the rollout workers are typed against `Host`: no duck typing left.
    from a3po_jax.inference.host import InferenceHost
    from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient

    for cls in (InferenceHost, GrpcInferenceClient, HostPool, FakeHost):
        missing = [
            m
            for m in ("submit", "poll", "update_weights", "stats", "counters", "close")
            if not callable(getattr(cls, m, None))
        ]
        assert not missing, (cls.__name__, missing)
    with HostPool([FakeHost("a")]) as pool:
        assert isinstance(pool, Host)


class SlowPushHost(FakeHost):
    """A FakeHost whose weight installs take `push_s` and record the weights' values."""

    def __init__(self, name, push_s):
        super().__init__(name, policy="drain")
        self.push_s = push_s
        self.received: list[np.ndarray] = []

    def update_weights(self, params, version):
        time.sleep(self.push_s)
        self.received.append(np.array(params["w"]))
        super().update_weights(params, version)


def test_background_push_returns_at_once_and_holds_submissions_until_installed():
    a, b = SlowPushHost("a", 0.3), SlowPushHost("b", 0.3)
    with HostPool([a, b], background_push=True) as pool:
        w = np.arange(6, dtype=np.float32).reshape(2, 3)
        t0 = time.monotonic()
        pool.update_weights({"w": w}, 1)
        returned = time.monotonic() - t0
        w[:] = -1  # the caller reuses its buffer at once (the trainer donates it)
        assert returned < 0.25 and a.version == 0, "the call waited for the hosts"
        # A request submitted now starts only once every host has installed version 1.
        pool.submit(request(0, n=1))
        assert a.version == 1 and b.version == 1
        (result,) = collect(pool, 1)
        assert result.tokens.tolist()[2] == 1
        for host in (a, b):  # they received the values at the call, not the overwritten ones
            np.testing.assert_array_equal(host.received[-1], np.arange(6).reshape(2, 3))
        # The next push waits for none (nothing in flight) and the stats describe the last.
        assert pool.wait_pushed(timeout=5)
        stats = pool.stats()
        assert stats["pushes"] == 1 and stats["push_s"] >= 0.3 and stats["push_bytes"] == w.nbytes
        pool.update_weights({"w": w}, 2)
        pool.wait_pushed(timeout=5)
        assert a.weight_pushes == [1, 2] and b.weight_pushes == [1, 2]


def test_a_failed_background_push_is_raised_at_the_next_call():
    a = SlowPushHost("a", 0.0)
    with HostPool([a], background_push=True) as pool:
        pool.update_weights({"w": np.zeros((2, 3), np.float32)}, 1)
        pool.wait_pushed(timeout=5)
        a.update_weights = lambda params, version: (_ for _ in ()).throw(ValueError("expected x"))
        pool.update_weights({"w": np.zeros((2, 3), np.float32)}, 2)
        with pytest.raises(ValueError, match="expected x"):
            pool.wait_pushed(timeout=5)


class StalledPushHost(FakeHost):
    """A FakeHost that freezes in the middle of a weight push (a SIGSTOPped process whose
    socket still accepts bytes): the push returns only when the host is thawed."""

    def __init__(self, name):
        super().__init__(name)
        self.thawed = threading.Event()

    def update_weights(self, params, version):
        if self.frozen.is_set():
            self.thawed.wait(timeout=60)
        super().update_weights(params, version)


def test_a_push_stalled_on_a_frozen_host_does_not_hold_up_the_next_pushes():
    a, b = StalledPushHost("a"), FakeHost("b")
    with make_pool([a, b]) as pool:
        pool.update_weights(PARAMS, 1)
        a.frozen.set()  # a freezes; the next push to it hangs until it is thawed
        pool.update_weights(PARAMS, 2)  # returns once a is marked down
        assert pool.counters()["host_failures"]["a"] == 1
        t0 = time.monotonic()
        for version in range(3, 7):  # the stalled push holds its staged weights meanwhile
            pool.update_weights(PARAMS, version)
        assert time.monotonic() - t0 < 10, "a push waited on the frozen host"
        assert b.weight_pushes == [1, 2, 3, 4, 5, 6] and a.weight_pushes == [1]
        assert pool._staging.num_sets <= 2 + 2
        a.frozen.clear()
        a.thawed.set()  # the stalled push lands; a rejoins with the newest weights
        deadline = time.monotonic() + 10
        while pool.counters()["host_returns"]["a"] == 0:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        assert a.version == 6 and a.weight_pushes == [1, 2, 6]


# ---------------------------------------------------------------- hosts joining and leaving


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


class SpecHost(FakeHost):
    """A FakeHost that says which tensors it serves (as a gRPC host does)."""

    def __init__(self, name, *, shape=(2, 3), dtype="float32", **kwargs):
        super().__init__(name, **kwargs)
        self.specs = [TensorSpec("w", np.dtype(dtype), tuple(shape))]

    def tensor_specs(self):
        return self.specs


class WrongTokenHost(FakeHost):
    def stats(self):
        raise PermissionError("Stats: UNAUTHENTICATED: bad token")


def test_a_host_added_to_a_running_pool_gets_the_newest_weights_before_any_work(caplog):
    a, c = FakeHost("a"), FakeHost("c")
    with make_pool([a]) as pool, caplog.at_level(logging.WARNING, "a3po_jax.inference.remote"):
        pool.update_weights(PARAMS, 3)
        assert pool.add_host(c) == "c"
        reqs = [request(i) for i in range(12)]
        for r in reqs[:6]:  # submitted while c may still be waiting for its weights
            pool.submit(r)
        wait_until(lambda: pool.counters()["joined"] == 1, "c joined")
        for r in reqs[6:]:
            pool.submit(r)
        results = collect(pool, 24)
        assert_each_sample_once(results, reqs)
        assert c.weight_pushes == [3] and c.accepted  # its weights first, then work
        assert {r.tokens.tolist()[2] for r in results} == {3}  # every sample on version 3
        c_counts = pool.counters()
        assert c_counts["served"]["a"] > 0 and c_counts["served"]["c"] > 0
        assert c_counts["host_failures"] == {"a": 0, "c": 0}
        assert c_counts["host_returns"] == {"a": 0, "c": 0} and c_counts["left"] == 0
        assert pool.stats()["hosts"]["c"]["state"] == "serving"
        assert "inference host c joined (serving version 3)" in caplog.text
        with pytest.raises(ValueError, match="host c is already in the pool"):
            pool.add_host(FakeHost("c"))
        pool.check_invariant()


def test_a_host_whose_settings_differ_is_refused_by_name():
    with make_pool([SpecHost("a", invariant=True)]) as pool:
        refusals = {
            "update policy 'drain'": SpecHost("x", policy="drain", invariant=True),
            "x cannot join the run: it is not batch-invariant": SpecHost("x"),
            "x cannot join the run: it serves another model: tensor w has shape": SpecHost(
                "x", shape=(4, 3), invariant=True
            ),
            "x cannot join the run: it serves w in bfloat16, the run's hosts in float32": SpecHost(
                "x", dtype="bfloat16", invariant=True
            ),
            "x cannot join: it refused the token": WrongTokenHost("x"),
        }
        for message, host in refusals.items():
            with pytest.raises(ValueError, match=message):
                pool.add_host(host)
        assert pool.stats()["hosts_total"] == 1 and pool.counters()["joined"] == 0
    with pytest.raises(InferenceError, match="pool is closed"):
        pool.add_host(SpecHost("y"))


def test_a_leaving_host_finishes_what_it_holds_and_is_not_a_failure(caplog):
    a, b = FakeHost("a", delay=0.05), FakeHost("b", delay=0.05)
    with make_pool([a, b]) as pool, caplog.at_level(logging.WARNING, "a3po_jax.inference.remote"):
        reqs = [request(i, n=3) for i in range(6)]
        for r in reqs:
            pool.submit(r)
        held = len(a.accepted)
        assert held > 0
        pool.remove_host("a")
        assert pool.stats()["hosts"]["a"]["state"] == "leaving"
        more = [request(10 + i) for i in range(4)]
        for r in more:  # nothing new goes to a leaving host
            pool.submit(r)
        assert len(a.accepted) == held
        results = collect(pool, 18 + 8)
        assert_each_sample_once(results, reqs + more)
        wait_until(lambda: pool.counters()["left"] == 1, "a left")
        c = pool.counters()
        assert c["host_failures"] == {"a": 0, "b": 0} and c["reissued_on_leave"] == 0
        assert c["served"]["a"] == 3 * held  # it finished all it held
        assert pool.stats()["hosts_total"] == 1 and pool.stats()["hosts"]["a"]["state"] == "left"
        assert "inference host a has left (its requests finished)" in caplog.text
        with pytest.raises(ValueError, match="b is the run's last host"):
            pool.remove_host("b")
        with pytest.raises(ValueError, match="no inference host a in the pool"):
            pool.remove_host("a")
        pool.check_invariant()


def test_a_leaving_host_past_its_grace_or_dead_hands_its_requests_to_the_others_once():
    a, b = FakeHost("a", delay=0.05), FakeHost("b", delay=0.05)
    with make_pool([a, b], hang_timeout_s=30) as pool:
        pool.update_weights(PARAMS, 2)
        reqs = [request(i, n=3) for i in range(4)]
        for r in reqs:
            pool.submit(r)
        time.sleep(0.07)  # a has delivered part of what it holds
        a.stall = True  # ...and generates nothing more
        pool.remove_host("a", grace_s=0.3)
        results = collect(pool, 12)
        assert_each_sample_once(results, reqs)
        c = pool.counters()
        assert c["left"] == 1 and c["reissued_on_leave"] >= 1 and c["host_failures"]["a"] == 0
        assert c["samples_lost"] == 0
        # A new process under the old name joins (counts carried on), serves, then dies
        # while leaving.
        a2 = FakeHost("a", delay=0.05)
        pool.add_host(a2)
        wait_until(lambda: pool.counters()["joined"] == 1, "a joined again")
        assert a2.weight_pushes == [2]
        served = pool.counters()["served"]["a"]
        more = [request(10 + i, n=4) for i in range(4)]
        for r in more:
            pool.submit(r)
        wait_until(lambda: pool.counters()["served"]["a"] > served, "the new a served")
        pool.remove_host("a")
        a2.kill()
        results = collect(pool, 16)
        assert_each_sample_once(results, more)
        c = pool.counters()
        assert c["left"] == 2 and c["host_failures"] == {"a": 0, "b": 0}
        pool.check_invariant()


def test_the_membership_file_adds_and_removes_hosts(tmp_path, caplog):
    fakes = {f"h:{i}": FakeHost(f"h:{i}") for i in (1, 2, 3)}
    fakes["h:3"].policy = "drain"
    path = tmp_path / "hosts"
    path.write_text("h:1\n")

    def rewrite(text):
        path.write_text(text)
        os.utime(path, ns=(time.time_ns(), time.time_ns()))

    with (
        make_pool(
            [fakes["h:1"]], names=["h:1"], hosts_file=path, connect=fakes.__getitem__
        ) as pool,
        caplog.at_level(logging.WARNING, "a3po_jax.inference.remote"),
    ):
        time.sleep(0.3)
        assert pool.stats()["hosts_total"] == 1  # the file as it was: nothing changes
        rewrite("h:1\n# a comment\nh:2\n")
        wait_until(lambda: pool.counters()["joined"] == 1, "h:2 joined")
        rewrite("h:2\nh:3\n")  # h:1 leaves; h:3 is refused by name (update policy)
        wait_until(lambda: pool.counters()["left"] == 1, "h:1 left")
        wait_until(lambda: "host h:3 cannot join the run" in caplog.text, "h:3 refused")
        rewrite("h:2\nnot an address\n")
        wait_until(lambda: "line 2: 'not an address' is not host:port" in caplog.text, "bad line")
        rewrite("")  # the last host stays
        wait_until(lambda: "h:2 is the run's last host" in caplog.text, "last host kept")
        assert pool.stats()["hosts_total"] == 1 and pool.stats()["hosts"]["h:2"]["healthy"]
        reqs = [request(i) for i in range(3)]
        for r in reqs:
            pool.submit(r)
        assert_each_sample_once(collect(pool, 6), reqs)
        assert pool.counters()["host_failures"] == {"h:1": 0, "h:2": 0}
    assert has_ended(path)  # the pool closed: a host asked to join now is refused
    with pytest.raises(ValueError, match="hosts_file needs connect"):
        HostPool([FakeHost("a")], hosts_file=path)
