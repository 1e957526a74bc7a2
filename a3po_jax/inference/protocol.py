"""Inference layer (shell): the interface every inference host implements.

`InferenceHost` (in-process), `GrpcInferenceClient` (a host in another process) and
`HostPool` (several hosts with failover) all satisfy `Host`, so the rollout workers and the
trainer are typed against it and written once for all three.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from a3po_jax.inference.types import GenerateRequest, SampleResult


@runtime_checkable
class Host(Protocol):
    """What the trainer's rollout workers need from an inference host."""

    def submit(self, request: GenerateRequest) -> None:
        """Queues `request`; ValueError if it is invalid for this host (nothing queued)."""

    def poll(
        self, timeout: float | None = None, max_results: int | None = None
    ) -> list[SampleResult]:
        """Finished samples of any request as they finish: waits up to `timeout` seconds
        (None: forever) for the first, then takes what else is ready (up to `max_results`).
        A failed sample comes back with ``finish_reason == "error"`` and an `ErrorKind`."""

    def update_weights(self, params: Any, version: int) -> None:
        """Stages new weights stamped `version`; ValueError on a name/shape/dtype mismatch
        (the old weights keep serving). When they serve depends on the update policy."""

    # Whether the host runs in this process: it serves the params it was built with, and a
    # push's replaced weights are this process's memory.
    in_process: bool

    def wait_serving(self, version: int, timeout: float) -> bool:
        """Waits up to `timeout` seconds until weights stamped `version` or newer serve;
        returns whether they do (a host in another process answers True at once)."""

    def stats(self) -> dict[str, Any]:
        """Serving state and metrics: at least ``update_policy``, ``version``, ``live`` and
        ``tokens_per_s``; a host that recomputes caches at in-flight swaps also reports
        ``kv_recomputes``, ``kv_recompute_tokens`` and ``kv_recompute_s``."""

    def counters(self) -> dict[str, Any]:
        """Sample accounting: ``samples_requested = samples_delivered + samples_lost +
        samples_outstanding``, and ``lost_reasons`` (samples lost, by reason)."""

    def close(self) -> None:
        """Stops serving this caller; unfinished samples come back as errors or are dropped."""


class InAnotherProcess:
    """What a host in another process (a gRPC client, a pool of them) says of itself on the
    `Host` protocol: it starts with weights of its own, so the trainer pushes its first, and
    the weights a push replaces are not this process's memory."""

    in_process = False

    def wait_serving(self, version: int, timeout: float) -> bool:
        """A remote swap is not observed from here: True at once (the host's own update
        policy orders its requests around the swap)."""
        return True
