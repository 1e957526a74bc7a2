"""The health of a `HostPool`'s hosts (:class:`Health`, a part of the pool).

Inference layer (remote). What the pool's docstring says under "Failure detection" and
"Return": a monitor thread asks every host for its stats each ``health_interval_s`` and
marks a dead, frozen, not-live or hung host down (its requests re-issued); a down host is
probed at the same interval and, once it answers, sent the newest weights before any
work; a joining host comes in by the same road, and the membership file is re-read here.
The methods run on the pool's own state, under its lock.
"""

from __future__ import annotations

import logging
import time

from a3po_jax.inference.remote.pool_members import progress_of

log = logging.getLogger(__name__)


class Health:
    """The pool's monitor (mixed into :class:`a3po_jax.inference.remote.pool.HostPool`)."""

    def _monitor(self) -> None:
        while not self._closed.wait(self.health_interval_s):
            if self.hosts_file is not None:
                try:
                    self._sync_hosts_file()
                except Exception:  # noqa: BLE001 -- never let the monitor die of the file
                    log.exception("reading the membership file %s failed", self.hosts_file)
            for index in range(len(self._members)):
                if self._closed.is_set():
                    return
                member = self._members[index]
                if member.left:
                    continue
                if member.healthy:
                    self._check(index)
                else:
                    self._probe(index)
                if member.leaving:
                    self._advance_leave(index)

    def _check(self, index: int) -> None:
        member = self._members[index]
        try:
            stats = dict(member.host.stats())
        except Exception as err:  # noqa: BLE001 -- failed or timed out: down
            self._mark_down(index, f"health check failed: {err}")
            return
        now = time.monotonic()
        reason = None
        with self._lock:
            member.stats = stats
            progress = progress_of(stats)
            if progress != member.progress or not member.outstanding:
                member.progress, member.progress_at = progress, now
            elif now - member.progress_at > self.hang_timeout_s:
                reason = (
                    f"hung: no token generated for {now - member.progress_at:.0f} s with "
                    f"{len(member.outstanding)} request(s) outstanding"
                )
            if stats.get("live") is False:
                reason = "serving loop not live"
        if reason:
            self._mark_down(index, reason)

    def _probe(self, index: int) -> None:
        """A down host that answers again, and is not stuck (it generated something since it
        went down, or has nothing running), gets the newest weights, then work. So does a
        host that joined."""
        member = self._members[index]
        if member.leaving or member.left:
            return
        try:
            stats = dict(member.host.stats())
        except Exception:  # noqa: BLE001 -- still down
            return
        if stats.get("live") is False or stats.get("update_policy") != self.update_policy:
            return
        idle = not stats.get("slots_busy") and not stats.get("queue_depth")
        if progress_of(stats) == member.progress and not idle:
            return  # answers, but its old work has not moved: still hung
        while True:
            with self._lock:
                latest = self._latest
                if latest is not None:
                    self._staging.hold(latest[0])  # not re-staged while we send it
            if latest is not None:
                staged, tree, version = latest
                try:
                    if not member.push_lock.acquire(timeout=1.0):
                        return  # an older push is still running: try again at the next probe
                    try:
                        member.host.update_weights(tree, version)
                    except Exception as err:  # noqa: BLE001 -- not usable yet
                        log.info("host %s answers but refused the weights: %s", member.name, err)
                        return
                    finally:
                        member.push_lock.release()
                finally:
                    self._staging.release(staged)
            with self._lock:
                if self._latest is not latest:
                    continue  # newer weights arrived meanwhile: send those first
                if member.left or member.leaving:
                    return
                joined = member.joining
                member.healthy = True
                member.reason = ""
                member.joining = False
                if joined:
                    member.joins += 1
                else:
                    member.returns += 1
                member.stats = stats
                member.progress = progress_of(stats)
                member.progress_at = time.monotonic()
                member.version = None if latest is None else latest[2]
                parked = list(self._parked)
                self._parked.clear()
                self._warned_no_host = False
            break
        log.warning(
            "inference host %s %s (serving version %s); %d parked request(s) placed",
            member.name,
            "joined" if joined else "is back",
            member.version,
            len(parked),
        )
        for request_id in parked:
            self._dispatch(request_id)
