"""The host's weight-update policies: when staged weights start serving, and what running
samples do at the swap. One small object per policy, chosen once when the host is made.

Inference layer (host-side shell).

Weight updates are validated in the caller's thread, then staged; the serving thread
(`host.py`) swaps them in at a decode-step boundary:

* ``"in_flight"`` (AReaL, the default): at the next boundary. Every running sample's KV
  cache is first recomputed under the new weights (one batched prefill of prompt + tokens so
  far, `EngineCore.recompute_cache`), as AReaL's interruptible rollout does, then decoding
  continues. Each token's behaviour log-prob is therefore its probability under the version
  stamped on it, given the whole sequence before it: tokens stamped v equal a cache-free
  recomputation under v, tokens stamped v+1 one under v+1. A sample's version array steps up
  at the swap. The cost (seconds and tokens recomputed per swap) is in the host's `stats()`.
* ``"in_flight_keep_cache"``: the cheaper variant without the recompute. Running samples
  decode on from the cache the old weights computed, so their tokens after the swap come
  from *neither* policy: stamped with the new version, their log-probs are the true sampling
  probabilities but differ from the new weights' probabilities of the same sequence (by
  nats on a random model). Staleness, A-3PO's alpha = 1/d and AReaL's d = 0 rule read the
  stamp as the token's policy, which it then is not; use it only where that is acceptable.
* ``"drain"`` (Periodic Asynchrony): the samples of requests submitted before the update are
  finished with the old weights (those still waiting for a slot are started with them too);
  samples of later requests wait. The swap happens once none of the earlier ones is left, so
  no sample spans two versions and a request's samples share one version. This is what makes
  ``one_step_off`` exactly one step stale: a group submitted while batch t trains is generated
  by version t, even if it only reaches a slot after version t+1 was pushed (the trainer
  pushes t+1 once t serves and every such group was submitted: `OneStepOff.before_push`).

A decode step always runs with one params object, so versions never mix inside a step.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class UpdatePolicy:
    """What one policy does; the host reads these flags, never the policy's name."""

    name: str
    # Requests submitted before the update finish on the old weights first, and later ones
    # wait for the swap (so a request's samples share one version).
    drains: bool
    # At the swap, every running sample's KV cache is rewritten under the new weights.
    recomputes_cache: bool


_POLICIES = {
    p.name: p
    for p in (
        UpdatePolicy("in_flight", drains=False, recomputes_cache=True),
        UpdatePolicy("in_flight_keep_cache", drains=False, recomputes_cache=False),
        UpdatePolicy("drain", drains=True, recomputes_cache=False),
    )
}
UPDATE_POLICIES = tuple(_POLICIES)


def update_policy(name: str) -> UpdatePolicy:
    """The policy called `name`; ValueError naming the choices for any other."""
    if name not in UPDATE_POLICIES:
        raise ValueError(f"update_policy must be one of {UPDATE_POLICIES}, got {name!r}")
    return _POLICIES[name]
