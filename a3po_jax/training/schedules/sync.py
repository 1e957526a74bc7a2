"""``system.mode=sync``: generate a batch with the current weights, then train on it.

Training layer (host-side shell). Design §4.
"""

from __future__ import annotations

from a3po_jax.training.schedules.base import Schedule, register


@register("sync")
class Sync(Schedule):
    """The batch comes from the weights the step starts from: with k minibatches its last
    minibatch trains k - 1 versions later."""

    @classmethod
    def staleness_bound(
        cls, max_staleness: int, num_minibatches: int, *, error: type[Exception] = ValueError
    ) -> int:
        return num_minibatches - 1
