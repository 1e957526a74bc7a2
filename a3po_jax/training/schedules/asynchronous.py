"""``system.mode=async``: the producer runs up to η versions ahead of the trainer, and the
host may swap weights in the middle of a request (``system.update_policy``).

Training layer (host-side shell). Design §4. (The module is not named ``async``, a Python
keyword; the mode is.)
"""

from __future__ import annotations

from a3po_jax.training.schedules.base import Schedule, register


@register("async")
class Async(Schedule):
    """η is ``system.max_staleness`` as configured, at least k - 1 with k minibatches (no
    admission rule can keep the last minibatch fresher than that)."""

    in_flight_updates = True

    @classmethod
    def staleness_bound(
        cls, max_staleness: int, num_minibatches: int, *, error: type[Exception] = ValueError
    ) -> int:
        k = num_minibatches
        if max_staleness < k - 1:
            raise error(
                f"system.max_staleness={max_staleness} with algo.num_minibatches={k}: staleness "
                f"is counted in optimizer versions, and the last of the {k} minibatches of every "
                f"batch trains {k - 1} versions after the first, so system.max_staleness must "
                f"be >= {k - 1} (or use fewer minibatches)"
            )
        return max_staleness
