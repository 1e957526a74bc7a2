"""The push of new weights to the inference host after a step (:class:`WeightPush`).

Training layer (host-side shell).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from a3po_jax.parallel import distributed
from a3po_jax.training import heap

# How long a weight push waits for an in-process host to start serving the new weights (a
# decode step, or a prefill, under the in-flight policies) before it trims the heap.
SWAP_WAIT_S = 1.0


class WeightPush:
    """Serves new weights on the inference host (process 0's). With several processes they
    are gathered to process 0 first: a collective, called by every process.

    Args:
      host: the run's host (None in a replay: nothing to serve).
      leader: whether this is process 0.
      multi_process: whether the run has several processes.
      releases_replaced_weights: the schedule's flag (``Schedule.releases_replaced_weights``).
      trims: whether the heap trimmer is on (read at each push: off once the run closed).
    """

    def __init__(
        self,
        host: Any,
        *,
        leader: bool,
        multi_process: bool,
        releases_replaced_weights: bool,
        trims: Callable[[], bool],
    ):
        self.host, self.leader, self.multi_process = host, leader, multi_process
        self.releases_replaced_weights = releases_replaced_weights
        self.trims = trims

    def __call__(self, params: Any, version: int) -> None:
        if self.multi_process:
            params = distributed.gather_params(params)
        if self.leader and self.host is not None:
            # A pool of remote hosts copies the weights and returns; they travel meanwhile.
            self.host.update_weights(params, version)
            self._release_replaced_weights(version)

    def _release_replaced_weights(self, version: int) -> None:
        """Hands an in-process host's previous copy of the weights back to the OS before the
        next train step allocates its temporaries.

        The host frees that copy when the new weights start serving (its next decode step
        under the in-flight policies), but glibc keeps the freed pages until the heap trimmer
        comes by, up to `system.run.trim_heap_every_s` later: by then the next step's temporaries
        are resident too, and the run's peak holds both (docs/performance.md). So wait for
        the swap, briefly, and trim. Under "drain" the swap waits for older requests to
        finish: nothing to wait for here.
        """
        if (
            not self.trims()
            or not self.host.in_process
            or self.host.update_policy == "drain"
            or not self.releases_replaced_weights
        ):
            return
        if self.host.wait_serving(version, timeout=SWAP_WAIT_S):
            heap.trim()
