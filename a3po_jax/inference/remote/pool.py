"""Several inference hosts behind the one-host interface, with failure detection and failover.

Inference layer (remote).

    pool = HostPool([GrpcInferenceClient(a, token) for a in addresses])
    pool.submit(request); pool.poll(timeout=0.2); pool.update_weights(params, version)

The trainer talks to a `HostPool` exactly as to one `InferenceHost` (``submit``, ``poll``,
``update_weights``, ``stats``, ``close``). Behind it:

* **Placement.** A request goes to the healthy host with the fewest samples outstanding
  (ties in turn), so work spreads round-robin over equal hosts.
* **Failure detection.** A monitor thread asks every host for its stats each
  ``health_interval_s``. A host is marked *down* when that call fails or times out (dead,
  unreachable, or frozen), when its serving loop reports not live, when it has work
  outstanding and its generated-token count has not moved for ``hang_timeout_s`` (hung), or
  when a call to it fails at the transport level (submit, poll, weight push, a broken stream).
* **Failover.** The requests outstanding on a host that goes down are re-issued, whole, to
  another healthy host under a new wire id (``<id>~retry<k>``). Samples already delivered are
  not delivered again: a re-issued request's copies of them are discarded, as is anything
  the old host sends later (a host that was only frozen may wake up and finish its old work).
  Each sample reaches ``poll`` at most once; a sample whose request was re-issued
  ``max_reissues`` times without finishing comes back as an error result of kind
  ``ErrorKind.LOST`` (the trainer drops the group). Nothing is trained on twice or half-used.
* **No host left.** Requests are parked (with one warning) until a host returns; the
  trainer's ``rollout_timeout_s`` bounds the wait.
* **Return.** A down host is probed every ``health_interval_s``; once it answers it is sent
  the newest weights (and version) first, and only then given work again.
* **Joining and leaving.** `add_host` adds a host to a running pool: its settings are
  checked first (update policy, batch invariance, the model's tensors and their dtypes; a
  host that differs is refused by name), then it starts down, and the monitor treats it as
  a returning host: the newest weights first, work after. `remove_host` stops placing
  requests on a host, lets those it holds finish for ``leave_grace_s``, re-issues the rest
  (whole, as after a failure, but not charged to ``max_reissues``), then closes it; a host
  that dies while leaving has simply left. Neither counts as a failure (``joined``,
  ``left`` in `counters`). The last host cannot leave. With ``hosts_file`` the monitor
  watches a file of ``host:port`` lines: a line added joins that host (through
  ``connect``), a line removed makes it leave.
* **Weight pushes.** The weights are copied once into host buffers that are reused push
  after push (in the hosts' dtypes: cast on the caller's device first), then sent to every
  healthy host at once. With ``background_push`` the call returns as soon as that copy is
  made: the hosts keep generating with the old weights while the new ones travel, and
  ``submit`` waits until every host has installed them (so a request submitted after a push
  never runs on weights older than it). The newest copy stays held for hosts that return.

Counters (``counters()``) account for every sample requested::

    samples_requested = samples_delivered + samples_lost + samples_outstanding

Hosts are anything that implements `protocol.Host` (as the pool itself does); in practice
`GrpcInferenceClient`s (one per remote host). A result of kind ``ErrorKind.TRANSPORT`` from
a host marks that host down. Their calls should time out (the client's ``timeout``), or a host
that hangs a call hangs the thread that made it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from a3po_jax.inference.protocol import Host, InAnotherProcess
from a3po_jax.inference.remote import membership_file
from a3po_jax.inference.remote.pool_health import Health
from a3po_jax.inference.remote.pool_members import (
    RETRY_SEP,
    Member,
    Tracked,
    first_contact,
    join_pushes,
    min_version,
    staging_for,
    start_push,
)
from a3po_jax.inference.remote.pool_membership import Membership
from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    InferenceError,
    SampleResult,
    error_result,
    take_results,
)

log = logging.getLogger(__name__)


class HostPool(Membership, Health, InAnotherProcess):
    """Inference hosts behind one host interface: placement, health checks and failover.

    Args:
      hosts: the hosts (at least one), e.g. `GrpcInferenceClient`s.
      names: a name per host for messages and counters (default: ``address`` or ``host<i>``).
      health_interval_s: seconds between health checks (and probes of down hosts).
      hang_timeout_s: a host with work outstanding whose generated-token count has not moved
        for this long is marked down as hung.
      max_reissues: how many times one request may be re-issued after host failures before
        its missing samples are reported lost.
      close_hosts: `close()` also closes the hosts (the pool owns them).
      background_push: `update_weights` returns once the weights are copied, and pushes
        them in the background (see the module docstring); `wait_pushed` waits for it.
      leave_grace_s: seconds a leaving host may keep working on the requests it holds
        before they are re-issued to the others.
      hosts_file: a membership file of ``host:port`` lines, re-read by the monitor when it
        changes: hosts added join (made by ``connect(address)``), hosts removed leave.
      connect: makes a host from an address (needed with ``hosts_file``).
    """

    def __init__(
        self,
        hosts: list[Host],
        *,
        names: list[str] | None = None,
        health_interval_s: float = 2.0,
        hang_timeout_s: float = 60.0,
        max_reissues: int = 2,
        close_hosts: bool = True,
        background_push: bool = False,
        leave_grace_s: float = 60.0,
        hosts_file: str | os.PathLike | None = None,
        connect: Callable[[str], Host] | None = None,
    ):
        if not hosts:
            raise ValueError("HostPool needs at least one host")
        if names is None:
            names = [getattr(h, "address", None) or f"host{i}" for i, h in enumerate(hosts)]
        if len(names) != len(hosts) or len(set(names)) != len(names):
            raise ValueError(f"names must be unique, one per host; got {names}")
        for field, value in (
            ("health_interval_s", health_interval_s),
            ("hang_timeout_s", hang_timeout_s),
            ("leave_grace_s", leave_grace_s),
        ):
            if not value > 0:
                raise ValueError(f"{field} must be > 0, got {value}")
        if not isinstance(max_reissues, int) or max_reissues < 0:
            raise ValueError(f"max_reissues must be an int >= 0, got {max_reissues!r}")
        self.health_interval_s = float(health_interval_s)
        self.hang_timeout_s = float(hang_timeout_s)
        self.max_reissues = max_reissues
        self.leave_grace_s = float(leave_grace_s)
        if hosts_file is not None and connect is None:
            raise ValueError("hosts_file needs connect (how to reach a host from its address)")
        self.hosts_file = None if hosts_file is None else str(hosts_file)
        self._connect = connect
        self._file_key: tuple | None = None  # (mtime_ns, size) of the file when last read
        self._joins_pending: set[str] = set()  # addresses being connected to
        self._close_hosts = close_hosts
        self._members = [Member(name, host) for name, host in zip(names, hosts, strict=True)]
        self._lock = threading.RLock()
        self._tracked: dict[str, Tracked] = {}
        self._parked: collections.deque[str] = collections.deque()
        self._results: queue.Queue[SampleResult] = queue.Queue()
        # The newest weights (staged host copy, held; their tree) and version.
        self._latest: tuple[weight_sync.Staged, Any, int] | None = None
        self._staging: weight_sync.StagingBuffers | None = None
        self.background_push = bool(background_push)
        self._pushed = threading.Event()  # no push in flight
        self._pushed.set()
        self._push_error: BaseException | None = None
        # The last push: seconds from the call until every host installed it, and bytes.
        self._push = {"pushes": 0, "push_s": 0.0, "push_bytes": 0, "push_staging_s": 0.0}
        self._turn = itertools.count()
        self._closed = threading.Event()
        self._warned_no_host = False
        self._counters = collections.Counter()
        self._lost_reasons: collections.Counter = collections.Counter()

        # All hosts must agree on the update policy; unreachable ones start down.
        self.update_policy, self.batch_invariant = first_contact(self._members)

        self._threads = [
            threading.Thread(target=self._read, args=(i, m), name=f"pool-read-{i}", daemon=True)
            for i, m in enumerate(self._members)
        ]
        self._threads.append(
            threading.Thread(target=self._monitor, name="pool-monitor", daemon=True)
        )
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ host interface

    def submit(self, request: GenerateRequest) -> None:
        """Places a request on a healthy host (or parks it until one returns).

        Raises ValueError if the request is invalid (a host rejected it, or its id is in flight).
        """
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if RETRY_SEP in request.request_id:
            raise ValueError(f"request_id must not contain {RETRY_SEP!r}: {request.request_id!r}")
        # After a background push, no request starts on weights older than it.
        while not self._pushed.wait(0.1):
            if self._closed.is_set():
                raise InferenceError("host pool is closed")
        with self._lock:
            if self._closed.is_set():
                raise InferenceError("host pool is closed")
            if request.request_id in self._tracked:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._tracked[request.request_id] = Tracked(request)
            self._counters["requests"] += 1
            self._counters["samples_requested"] += request.num_samples
        self._dispatch(request.request_id, first=True)

    def poll(self, timeout: float | None = None, max_results: int | None = None):
        """Finished samples from any host, each sample at most once (as `InferenceHost.poll`)."""
        return take_results(self._results, timeout, max_results)

    def update_weights(self, params: Any, version: int) -> None:
        """Sends the weights to every healthy host at once. Returns when each has installed
        them or has been marked down meanwhile (a frozen host does not block the caller
        longer than the health check takes to notice), or with ``background_push`` as soon
        as they are copied. Hosts that are down get the newest weights when they return.

        ValueError (wrong names/shapes/dtypes) propagates: every host would refuse them.
        """
        version = int(version)
        self.wait_pushed()  # one push in flight at a time, in order
        t0 = time.perf_counter()
        staging = self._staging_for(params)
        # A copy of our own (the caller donates its buffers), also kept for returning hosts.
        staged = staging.stage(params)
        tree = weight_sync.unflatten_params(staged.arrays, params)
        staged_s = time.perf_counter() - t0
        with self._lock:
            previous, self._latest = self._latest, (staged, tree, version)
            targets = [i for i, m in enumerate(self._members) if m.healthy]
        if previous is not None:
            staging.release(previous[0])
        self._pushed.clear()
        errors: dict[int, BaseException] = {}
        pushes = {
            i: start_push(self._members, i, staging, staged, tree, version, errors) for i in targets
        }

        def finish() -> None:
            try:
                join_pushes(self._members, pushes)
                self._push.update(
                    pushes=self._push["pushes"] + 1,
                    push_s=time.perf_counter() - t0,
                    push_bytes=staged.nbytes,
                    push_staging_s=staged_s,
                )
                for i, err in errors.items():
                    if isinstance(err, ValueError):
                        raise err
                    self._mark_down(i, f"weight push failed: {err}")
            except BaseException as err:  # noqa: BLE001 -- raised to the caller (see below)
                self._push_error = err
            finally:
                self._pushed.set()

        if self.background_push:
            threading.Thread(target=finish, name="pool-push", daemon=True).start()
        else:
            finish()
            self._raise_push_error()

    def wait_pushed(self, timeout: float | None = None) -> bool:
        """Waits until no weight push is in flight; re-raises the error (ValueError) of a
        background push that failed. Returns False on timeout."""
        done = self._pushed.wait(timeout)
        self._raise_push_error()
        return done

    def _raise_push_error(self) -> None:
        err, self._push_error = self._push_error, None
        if err is not None:
            raise err

    def _staging_for(self, params: Any) -> weight_sync.StagingBuffers:
        """The pool's staging buffers, made at its first push (`staging_for`)."""
        if self._staging is None:
            self._staging = staging_for(self._members, params)
        return self._staging

    def stats(self) -> dict[str, Any]:
        """Totals over the healthy hosts, from the monitor's last look (never blocks on a host)."""
        with self._lock:
            healthy = [m for m in self._members if m.healthy]
            parked = sum(self._tracked[r].request.num_samples for r in self._parked)
            out: dict[str, Any] = {
                "update_policy": self.update_policy,
                "batch_invariant": self.batch_invariant,
                "version": self._latest[2] if self._latest else min_version(healthy),
                "hosts_healthy": len(healthy),
                "hosts_total": sum(not m.left for m in self._members),
                "live": bool(healthy),
                "queue_depth": parked,
            }
            summed = ("slots_busy", "num_slots", "tokens_per_s", "tokens_generated")
            summed += ("kv_recomputes", "kv_recompute_tokens", "kv_recompute_s", "busy_s")
            summed += ("decode_steps",)
            for key in summed:
                out[key] = sum(m.stats.get(key, 0) for m in healthy)
            # The serving loops' seconds by part, summed as busy_s is.
            loop_s: collections.Counter[str] = collections.Counter()
            for m in healthy:
                loop_s.update(m.stats.get("loop_s", {}))
            out["loop_s"] = dict(loop_s)
            out["queue_depth"] += sum(m.stats.get("queue_depth", 0) for m in healthy)
            # The last completed weight push (staging copy and until every host installed it).
            out.update(self._push)
            out["hosts"] = {
                m.name: {
                    "healthy": m.healthy,
                    "reason": m.reason,
                    "version": m.version,
                    "state": m.state,
                }
                for m in self._members
            }
        return out

    def counters(self) -> dict[str, Any]:
        """Sample and host accounting (see the module docstring for the invariant)."""
        with self._lock:
            outstanding = sum(
                t.request.num_samples - len(t.delivered) for t in self._tracked.values()
            )
            return {
                "requests": self._counters["requests"],
                "samples_requested": self._counters["samples_requested"],
                "samples_delivered": self._counters["samples_delivered"],
                "samples_lost": self._counters["samples_lost"],
                "samples_outstanding": outstanding,
                "reissued_requests": self._counters["reissued_requests"],
                "discarded_stale": self._counters["discarded_stale"],
                "discarded_duplicate": self._counters["discarded_duplicate"],
                "host_failures": {m.name: m.failures for m in self._members},
                "host_returns": {m.name: m.returns for m in self._members},
                # Membership changes (never failures), and the samples each host served.
                "joined": sum(m.joins for m in self._members),
                "left": sum(m.leaves for m in self._members),
                "reissued_on_leave": self._counters["reissued_on_leave"],
                "served": {m.name: m.served for m in self._members},
                "lost_reasons": dict(self._lost_reasons),
                "hosts_healthy": sum(m.healthy for m in self._members),
                "hosts_total": sum(not m.left for m in self._members),
            }

    def check_invariant(self) -> None:
        """Raises AssertionError if the sample counts do not add up."""
        c = self.counters()
        accounted = c["samples_delivered"] + c["samples_lost"] + c["samples_outstanding"]
        if c["samples_requested"] != accounted:
            raise AssertionError(f"samples_requested != delivered + lost + outstanding: {c}")

    def close(self) -> None:
        self._pushed.wait(timeout=30)  # a push in flight: let it land or fail
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=10)
        if self.hosts_file is not None:  # no one watches it now: a later join is refused
            try:
                membership_file.end_run(self.hosts_file)
            except OSError as err:
                log.warning("could not mark membership file %s ended: %s", self.hosts_file, err)
        if self._close_hosts:
            for member in self._members:
                if member.left:
                    continue  # closed when it left
                try:
                    member.host.close()
                except Exception:  # noqa: BLE001 -- closing a dead host may fail; ignore
                    log.debug("closing %s failed", member.name, exc_info=True)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pick(self) -> int | None:
        """The healthy host with the fewest samples outstanding (ties in turn). Lock held."""
        healthy = [i for i, m in enumerate(self._members) if m.healthy and not m.leaving]
        if not healthy:
            return None
        load = {
            i: sum(
                self._tracked[r].request.num_samples - len(self._tracked[r].delivered)
                for r in self._members[i].outstanding
            )
            for i in healthy
        }
        start = next(self._turn) % len(self._members)
        order = sorted(healthy, key=lambda i: (load[i], (i - start) % len(self._members)))
        return order[0]

    def _dispatch(self, request_id: str, *, first: bool = False) -> None:
        """Submit a tracked request to a healthy host, trying others on transport failures."""
        while True:
            with self._lock:
                tracked = self._tracked.get(request_id)
                if tracked is None or self._closed.is_set():
                    return
                index = self._pick()
                if index is None:
                    self._parked.append(request_id)
                    if not self._warned_no_host:
                        self._warned_no_host = True
                        log.warning(
                            "all %d inference hosts are down (%s); requests wait for one to return",
                            len(self._members),
                            "; ".join(f"{m.name}: {m.reason}" for m in self._members),
                        )
                    return
                member = self._members[index]
                tracked.attempt += 1
                tracked.member = index
                if not member.outstanding:
                    member.progress_at = time.monotonic()  # the hang clock starts with work
                member.outstanding.add(request_id)
                wire = dataclasses.replace(tracked.request, request_id=tracked.wire_id)
            try:
                member.host.submit(wire)
                return
            except ValueError:
                if first and tracked.attempt == 0:
                    with self._lock:  # the request itself is bad: forget it, tell the caller
                        member.outstanding.discard(request_id)
                        self._tracked.pop(request_id, None)
                        self._counters["requests"] -= 1
                        self._counters["samples_requested"] -= tracked.request.num_samples
                    raise
                # A re-issue refused (e.g. the new host is smaller): nothing else can serve it.
                self._lose(request_id, f"re-issue refused by {member.name}", "reissue_refused")
                return
            except Exception as err:  # noqa: BLE001 -- transport failure: host is down
                self._mark_down(index, f"submit failed: {err}")
                # _mark_down re-issued this request (it was outstanding there); done.
                return

    # ------------------------------------------------------------------ failures

    def _mark_down(self, index: int, reason: str) -> None:
        with self._lock:
            member = self._members[index]
            if member.leaving:
                leaving = True
            elif not member.healthy:
                return
            else:
                leaving = False
        if leaving:  # it was going anyway: what it holds moves, and it is not a failure
            self._retire(index, f"went down while leaving ({reason})")
            return
        with self._lock:
            if not member.healthy or member.leaving:
                return
            member.healthy = False
            member.reason = reason
            member.failures += 1
            moved = sorted(member.outstanding)
            member.outstanding.clear()
            for request_id in moved:
                self._tracked[request_id].member = None
            remaining = sum(m.healthy for m in self._members)
        log.warning(
            "inference host %s is down (%s): %d request(s) in flight re-issued; %d host(s) left",
            member.name,
            reason,
            len(moved),
            remaining,
        )
        for request_id in moved:
            self._reissue(request_id, f"host {member.name} down: {reason}")

    def _reissue(self, request_id: str, reason: str) -> None:
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                return
            if tracked.attempt - tracked.moves >= self.max_reissues:
                give_up = True
            else:
                give_up = False
                self._counters["reissued_requests"] += 1
        if give_up:
            self._lose(request_id, f"{reason} (after {self.max_reissues} re-issue(s))", "host_down")
        else:
            self._dispatch(request_id)

    def _lose(self, request_id: str, reason: str, kind: str) -> None:
        """Report a request's undelivered samples as lost (error results), counted by kind."""
        with self._lock:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                return
            if tracked.member is not None:
                self._members[tracked.member].outstanding.discard(request_id)
            missing = [i for i in range(tracked.request.num_samples) if i not in tracked.delivered]
            self._counters["samples_lost"] += len(missing)
            self._lost_reasons[kind] += len(missing)
        for i in missing:
            self._results.put(error_result(tracked.request, i, ErrorKind.LOST, reason))

    # ------------------------------------------------------------------ threads

    def _read(self, index: int, member: Member) -> None:
        while not self._closed.is_set() and not member.left:
            if not member.healthy:
                self._closed.wait(0.1)
                continue
            try:
                results = member.host.poll(timeout=0.2)
            except Exception as err:  # noqa: BLE001 -- the host died under us
                self._mark_down(index, f"poll failed: {err}")
                continue
            for result in results:
                self._on_result(index, result, member)

    def _on_result(self, index: int, result: SampleResult, member: Member | None = None) -> None:
        request_id, _, attempt = result.request_id.partition(RETRY_SEP)
        attempt = int(attempt) if attempt else 0
        transport_failure = False
        with self._lock:
            tracked = self._tracked.get(request_id)
            if member is not None and self._members[index] is not member:
                tracked = None  # from a host that left this slot since
            if tracked is None or tracked.attempt != attempt or tracked.member != index:
                self._counters["discarded_stale"] += 1  # from a host the request left
                return
            if result.sample_index in tracked.delivered:
                self._counters["discarded_duplicate"] += 1
                return
            if result.error_kind is ErrorKind.TRANSPORT:
                transport_failure = True
            else:
                tracked.delivered.add(result.sample_index)
                self._counters["samples_delivered"] += 1
                self._members[index].served += 1
                self._members[index].progress_at = time.monotonic()
                if len(tracked.delivered) == tracked.request.num_samples:
                    del self._tracked[request_id]
                    self._members[index].outstanding.discard(request_id)
                result.request_id = request_id  # the caller's id, not the wire's
                self._results.put(result)
        if transport_failure:
            self._mark_down(index, result.error)
