"""A side channel on the rollout host: requests of the trainer's own beside the groups
(the held-out evaluation), with no second host and no second copy of the weights.

Rollout layer (host-side shell; plain Python, nothing here enters jit). The channel shares
the :class:`a3po_jax.rollout.workers.RolloutWorkers`' host and collector thread: the
collector hands this channel's results over by request id.
"""

from __future__ import annotations

import queue
from typing import Any

from a3po_jax.inference.types import GenerateRequest, SampleResult


class SideChannel:
    """``submit``/``poll``/``stats`` of the rollout host for requests that are not groups
    (:func:`a3po_jax.analysis.evaluation.host_generate_fn` reads it like a host).

    A request goes to the host as it is; since the collector polls every result the host
    returns, it hands this channel's results over (by request id) instead of dropping them
    as unknown. Closing the channel forgets its request ids. The ids must not look like a
    group's (``g<id>``); the evaluation's are ``eval-<seed>-<i>``. ``workers`` is the
    :class:`a3po_jax.rollout.workers.RolloutWorkers` (typed ``Any``: that module imports
    this one).
    """

    def __init__(self, workers: Any):
        self._workers = workers
        self._ids: list[str] = []
        self.results: queue.Queue[SampleResult] = queue.Queue()

    def submit(self, request: GenerateRequest) -> None:
        workers = self._workers
        with workers._inflight_lock:
            if (
                request.request_id in workers._group_of
                or request.request_id in workers._side_routes
            ):
                raise ValueError(f"request id {request.request_id!r} is already routed")
            workers._side_routes[request.request_id] = self
        self._ids.append(request.request_id)
        workers.host.submit(request)

    def poll(self, timeout: float | None = None) -> list[SampleResult]:
        """This channel's finished samples: waits up to ``timeout`` seconds for the first,
        then takes what else is there. Raises if the rollout threads stopped (nothing would
        hand results over)."""
        workers = self._workers
        workers.raise_if_failed()
        if workers.lockstep and workers._started:
            # No collector: drive the host until one of this channel's samples is back.
            while self.results.empty() and workers.drive():
                pass
            timeout = 0
        elif workers._stop.is_set() or not workers._threads:
            raise RuntimeError("the rollout threads are not running: no results to hand over")
        try:
            out = [self.results.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> dict[str, Any]:
        return self._workers.host.stats()

    def close(self) -> None:
        with self._workers._inflight_lock:
            for request_id in self._ids:
                self._workers._side_routes.pop(request_id, None)
        self._ids.clear()

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
