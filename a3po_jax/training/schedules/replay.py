"""A replay (``a3po-train --replay RUN_DIR``): the mode's schedule over recorded groups,
with no inference host and no producer.

Training layer (host-side shell). A wrapper around the mode's schedule, not a mode.
"""

from __future__ import annotations

from a3po_jax.training.schedules.base import Schedule, Wrapped


class Replayed(Wrapped):
    """The mode's schedule reading the recorded batches (periodic still folds them): no
    producer to wait for before a push, and no groups in flight to hold at a checkpoint."""

    def __init__(self, inner: Schedule):
        super().__init__(inner)
        inner.producer_behind = self.producer_behind = False
        self.holds_groups = False
