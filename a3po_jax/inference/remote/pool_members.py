"""What `HostPool` keeps per host and per request, and what it does to every host alike:
the first contact, the settings a host joining later must share, the membership file's
lines, the weight push to each, the staging buffers for those pushes.

Inference layer (remote).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from a3po_jax.inference.protocol import Host
from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.types import GenerateRequest, InferenceError

log = logging.getLogger(__name__)

RETRY_SEP = "~retry"


@dataclasses.dataclass
class Member:
    """One host of the pool and what the pool knows about it."""

    name: str
    host: Host
    healthy: bool = True
    reason: str = ""  # why it is down
    outstanding: set[str] = dataclasses.field(default_factory=set)  # request ids on it
    progress: tuple = ()  # (tokens_generated, samples_done) from its last stats
    progress_at: float = 0.0  # when that last changed (or work was first assigned)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # last stats seen
    version: int | None = None  # weights version last pushed to it
    failures: int = 0
    returns: int = 0
    # Membership changes during a run (`HostPool.add_host`, `HostPool.remove_host`).
    joining: bool = False  # added, down until it has the newest weights; then `joins` += 1
    leaving: bool = False  # takes no new request; retired once its requests are done
    leave_by: float = 0.0  # monotonic time after which what it still holds is re-issued
    left: bool = False  # retired: its client closed, never probed again
    joins: int = 0
    leaves: int = 0
    served: int = 0  # samples delivered from it
    # Weight pushes to one host go one at a time, in order: a push stuck on a frozen host
    # must finish (or fail) before the newest weights are sent when it returns.
    push_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def state(self) -> str:
        """serving, down, joining (waiting for its first weights), leaving or left."""
        if self.left:
            return "left"
        if self.leaving:
            return "leaving"
        if self.joining:
            return "joining"
        return "serving" if self.healthy else "down"


@dataclasses.dataclass
class Tracked:
    """A request the pool has accepted and not yet fully delivered."""

    request: GenerateRequest
    member: int | None = None  # index of the host it is on; None while parked
    attempt: int = -1  # submissions so far - 1 (0 = the first)
    moves: int = 0  # re-issues because a host left (not charged to max_reissues)
    delivered: set[int] = dataclasses.field(default_factory=set)

    @property
    def wire_id(self) -> str:
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}{RETRY_SEP}{self.attempt}"


def first_contact(members: list[Member]) -> tuple[str, bool]:
    """Asks every host for its stats: a host that does not answer starts down. Returns the
    update policy they all serve with and whether every answering host is batch-invariant
    (InferenceError when none answers, ValueError when they disagree on the policy)."""
    policies = {}
    now = time.monotonic()
    for member in members:
        try:
            member.stats = dict(member.host.stats())
        except Exception as err:  # noqa: BLE001 -- any failure means "not reachable"
            member.healthy = False
            member.reason = f"unreachable at start: {err}"
            log.warning("inference host %s is down: %s", member.name, member.reason)
            continue
        member.progress = progress_of(member.stats)
        member.progress_at = now
        policies[member.name] = member.stats.get("update_policy")
    if not policies:
        raise InferenceError(
            "no inference host reachable: " + "; ".join(f"{m.name}: {m.reason}" for m in members)
        )
    if len(set(policies.values())) > 1:
        raise ValueError(f"inference hosts disagree on update_policy: {policies}")
    update_policy = next(iter(policies.values()))
    # Reproducible only if every host is (a sample may land on any of them).
    batch_invariant = all(
        bool(m.stats.get("batch_invariant", False)) for m in members if m.name in policies
    )
    return update_policy, batch_invariant


def staging_for(members: list[Member], params: Any) -> weight_sync.StagingBuffers:
    """Reusable host buffers in the hosts' dtypes (asked of the first host that says),
    or the params' own dtypes."""
    specs = None
    for member in members:
        if member.healthy and hasattr(member.host, "tensor_specs"):
            try:
                specs = member.host.tensor_specs()
                break
            except Exception as err:  # noqa: BLE001 -- ask the next host
                log.info("host %s did not give its tensor specs: %s", member.name, err)
    if specs is None:
        specs = weight_sync.tensor_specs(params)
    # One set per host that may hold a stalled push (a push per host at a time), so
    # staging never waits on a frozen host.
    return weight_sync.StagingBuffers(specs, sets=2, max_sets=2 + len(members))


def start_push(
    members: list[Member],
    index: int,
    staging: weight_sync.StagingBuffers,
    staged,
    tree: Any,
    version: int,
    errors: dict[int, BaseException],
) -> threading.Thread:
    """Pushes to one host in a thread (holding `staged` meanwhile); a failure goes to
    ``errors[index]``."""
    member = members[index]
    staging.hold(staged)

    def push() -> None:
        try:
            with member.push_lock:
                member.host.update_weights(tree, version)
                member.version = version
        except BaseException as err:  # noqa: BLE001 -- sorted out by the caller
            errors[index] = err
        finally:
            staging.release(staged)

    thread = threading.Thread(target=push, name=f"pool-push-{index}", daemon=True)
    thread.start()
    return thread


def join_pushes(members: list[Member], pushes: dict[int, threading.Thread]) -> None:
    """Waits for each push, or for its host to be marked down."""
    for i, thread in pushes.items():
        while thread.is_alive() and members[i].healthy:
            thread.join(timeout=0.05)


def progress_of(stats: dict[str, Any]) -> tuple:
    return (stats.get("tokens_generated"), stats.get("samples_done"))


def min_version(members: list[Member]) -> int:
    versions = [m.stats.get("version") for m in members if m.stats.get("version") is not None]
    return min(versions) if versions else -1


def settings_refusal(
    stats: dict[str, Any], pool_policy: str, pool_invariant: bool, specs, host_specs
) -> str | None:
    """Why a host that asks to join a running pool cannot (None if it can): its update
    policy, its batch invariance (needed where the pool is), its model (tensor names and
    shapes) or its serving dtypes differ from the pool's."""
    policy = stats.get("update_policy")
    if policy != pool_policy:
        return (
            f"it serves update policy {policy!r}, the run's hosts {pool_policy!r} "
            f"(start it with --update-policy {pool_policy})"
        )
    if pool_invariant and not stats.get("batch_invariant", False):
        return "it is not batch-invariant and the run's hosts are (start it with --batch-invariant)"
    if specs is None or host_specs is None:
        return None
    ours = {s.name: s for s in specs}
    theirs = {s.name: s for s in host_specs}
    if set(ours) != set(theirs):
        extra = sorted(set(theirs) - set(ours))[:3]
        missing = sorted(set(ours) - set(theirs))[:3]
        return (
            f"it serves another model: tensors {extra} are not the run's, "
            f"{missing} are missing (start it with the run's --model)"
        )
    for key, spec in ours.items():
        other = theirs[key]
        if tuple(other.shape) != tuple(spec.shape):
            return (
                f"it serves another model: tensor {key} has shape "
                f"{tuple(other.shape)}, the run's {tuple(spec.shape)} (start it with the "
                "run's --model)"
            )
        if str(other.dtype) != str(spec.dtype):
            return (
                f"it serves {key} in {other.dtype}, the run's hosts in {spec.dtype} "
                f"(start it with the run's --param-dtype)"
            )
    return None


def close_quietly(member: Member) -> None:
    """Closes a member's host, ignoring a failure (a dead host may not close cleanly)."""
    try:
        member.host.close()
    except Exception:  # noqa: BLE001 -- closing a dead host may fail; ignore
        log.debug("closing %s failed", member.name, exc_info=True)
