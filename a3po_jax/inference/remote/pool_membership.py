"""Hosts that join and leave a running `HostPool` (:class:`Membership`, a part of the pool).

Inference layer (remote). What the pool's docstring says under "Joining and leaving":
`add_host` checks a new host's settings and lets the monitor bring it in as a returning
host (the newest weights first, work after); `remove_host` stops placing requests on a host,
lets those it holds finish for ``leave_grace_s`` and re-issues the rest; with
``hosts_file`` the monitor turns the file's added and removed lines into joins and leaves.
The methods run on the pool's own state, under its lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from a3po_jax.inference.protocol import Host
from a3po_jax.inference.remote.membership_file import read_hosts_file
from a3po_jax.inference.remote.pool_members import Member, close_quietly, settings_refusal
from a3po_jax.inference.types import InferenceError

log = logging.getLogger(__name__)


class Membership:
    """The pool's joins and leaves (mixed into :class:`a3po_jax.inference.remote.pool.HostPool`)."""

    def add_host(self, host: Host, name: str | None = None) -> str:
        """Adds a host to the running pool; returns its name. Its settings are checked now
        (ValueError naming the host and the setting that differs, or a refused token;
        InferenceError if it does not answer); it gets work once the monitor has pushed it
        the newest weights. A name that left before may join again."""
        name = name or getattr(host, "address", None) or f"host{len(self._members)}"
        with self._lock:
            if self._closed.is_set():
                raise InferenceError(f"host {name} cannot join: the host pool is closed")
            if any(m.name == name and not m.left for m in self._members):
                raise ValueError(f"host {name} is already in the pool")
        try:
            stats = dict(host.stats())
        except PermissionError as err:  # HostAuthenticationError: the token
            raise ValueError(f"host {name} cannot join: it refused the token ({err})") from None
        except Exception as err:  # noqa: BLE001 -- anything else: not reachable
            raise InferenceError(f"host {name} cannot join: it does not answer ({err})") from None
        why = settings_refusal(
            stats,
            self.update_policy,
            self.batch_invariant,
            self._reference_specs(),
            _specs_of(host),
        )
        if why:
            raise ValueError(f"host {name} cannot join the run: {why}")
        member = Member(name, host, healthy=False, joining=True)
        member.reason = "joining: waiting for the newest weights"
        with self._lock:
            if self._closed.is_set():
                raise InferenceError(f"host {name} cannot join: the host pool is closed")
            slot = next((i for i, m in enumerate(self._members) if m.name == name and m.left), None)
            if slot is None:
                slot = len(self._members)
                self._members.append(member)
            else:  # it left before: its counts carry on
                old = self._members[slot]
                for field in ("failures", "returns", "joins", "leaves", "served"):
                    setattr(member, field, getattr(old, field))
                self._members[slot] = member
            if self._staging is not None:
                self._staging.max_sets += 1  # one more host that may hold a stalled push
            thread = threading.Thread(
                target=self._read, args=(slot, member), name=f"pool-read-{slot}", daemon=True
            )
            self._threads.append(thread)
        thread.start()
        log.warning("inference host %s joins: it gets the newest weights, then work", name)
        return name

    def remove_host(self, name: str, *, grace_s: float | None = None) -> None:
        """Makes a host leave: no new request goes to it, the ones it holds may finish for
        ``grace_s`` (default ``leave_grace_s``), then the rest are re-issued to the others
        and its client is closed. Returns at once (`hosts_total` drops when it has left).
        ValueError if no such host is in the pool, or it is the last one."""
        grace_s = self.leave_grace_s if grace_s is None else float(grace_s)
        with self._lock:
            index = next(
                (i for i, m in enumerate(self._members) if m.name == name and not m.left), None
            )
            if index is None:
                raise ValueError(f"no inference host {name} in the pool")
            member = self._members[index]
            if member.leaving:
                return
            staying = [m for m in self._members if not m.left and not m.leaving]
            if staying == [member]:
                raise ValueError(
                    f"inference host {name} is the run's last host: it cannot leave until "
                    "another has joined"
                )
            member.leaving = True
            member.leave_by = time.monotonic() + grace_s
            serving = member.healthy
            held = len(member.outstanding)
        if not serving:  # down or still joining: nothing to finish
            self._retire(index, "asked to leave while not serving")
            return
        log.warning(
            "inference host %s leaves: no new requests; %d in flight may finish for %.0f s",
            name,
            held,
            grace_s,
        )

    def _advance_leave(self, index: int) -> None:
        """A leaving host goes once it holds nothing, or its grace is over."""
        with self._lock:
            member = self._members[index]
            if not member.leaving:
                return
            done = not member.outstanding
            late = time.monotonic() > member.leave_by
        if done:
            self._retire(index, "its requests finished")
        elif late:
            self._retire(index, "grace period over")

    def _retire(self, index: int, why: str) -> None:
        """The host has left: what it still holds is re-issued (not charged to
        ``max_reissues``), its client is closed, it is probed no more."""
        with self._lock:
            member = self._members[index]
            if member.left:
                return
            member.left, member.leaving, member.joining = True, False, False
            member.healthy = False
            member.reason = f"left: {why}"
            member.leaves += 1
            moved = sorted(member.outstanding)
            member.outstanding.clear()
            for request_id in moved:
                self._tracked[request_id].member = None
                self._tracked[request_id].moves += 1
                self._counters["reissued_on_leave"] += 1
        log.warning(
            "inference host %s has left (%s): %d request(s) it held re-issued",
            member.name,
            why,
            len(moved),
        )
        for request_id in moved:
            self._dispatch(request_id)
        if self._close_hosts:
            threading.Thread(
                target=close_quietly, args=(member,), name="pool-close", daemon=True
            ).start()

    def _reference_specs(self):
        """The tensors the run's hosts serve (names, shapes, dtypes), or None if unknown."""
        if self._staging is not None:
            return self._staging.specs
        with self._lock:
            serving = [m for m in self._members if m.healthy]
        for member in serving:
            specs = _specs_of(member.host)
            if specs is not None:
                return specs
        return None

    def _sync_hosts_file(self) -> None:
        """Applies the membership file when it changed: hosts it lists that are not in the
        pool join (connected in a thread of their own), hosts in the pool it does not list
        leave. A refusal is logged, and retried when the file changes again."""
        try:
            st = os.stat(self.hosts_file)
            key = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        if key == self._file_key:
            return
        self._file_key = key
        if key is None:
            log.warning("membership file %s is gone: the hosts stay as they are", self.hosts_file)
            return
        try:
            wanted = read_hosts_file(self.hosts_file)
        except ValueError as err:
            log.warning("membership file ignored until it changes again: %s", err)
            return
        with self._lock:
            present = [m.name for m in self._members if not m.left]
            joins = [a for a in wanted if a not in present and a not in self._joins_pending]
            self._joins_pending.update(joins)
        for name in present:
            if name not in wanted:
                try:
                    self.remove_host(name)
                except ValueError as err:
                    log.warning("membership file %s: %s", self.hosts_file, err)
        for address in joins:
            threading.Thread(
                target=self._join_address, args=(address,), name="pool-join", daemon=True
            ).start()

    def _join_address(self, address: str) -> None:
        host = None
        try:
            host = self._connect(address)
            self.add_host(host, address)
        except Exception as err:  # noqa: BLE001 -- refused or unreachable: say so, keep going
            log.warning("membership file %s: %s", self.hosts_file, err)
            if host is not None:
                close_quietly(Member(address, host))
        finally:
            with self._lock:
                self._joins_pending.discard(address)

    # ------------------------------------------------------------------ placement


def _specs_of(host: Host):
    """The host's serving tensors, or None where it does not say."""
    if not hasattr(host, "tensor_specs"):
        return None
    try:
        return host.tensor_specs()
    except Exception as err:  # noqa: BLE001 -- unknown; the weight push will tell
        log.info("host %s did not give its tensor specs: %s", getattr(host, "address", host), err)
        return None
