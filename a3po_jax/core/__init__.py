"""The pure core: functions of arrays, jitted, with no threads, sockets, files or config objects.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

* :mod:`a3po_jax.core.losses`: policy losses, log-probs, advantages, Online DPO, aggregation.
* :mod:`a3po_jax.core.train_step`: the jitted optimizer step over a batch.
* :mod:`a3po_jax.core.batching`: rollout groups -> padded, target-aligned arrays.
* :mod:`a3po_jax.core.packing`: shared-prompt packing (one row per group).

Nothing here imports the host-side shell (rollout, inference, training, cli).
"""
