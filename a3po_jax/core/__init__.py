"""The pure core: functions of arrays, jitted, with no threads, sockets, files or config objects.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

* :mod:`a3po_jax.core.losses`: the public losses and their pieces, in one namespace.
* :mod:`a3po_jax.core.objectives`: one module per objective (``ppo``, ``dpo``): its maths,
  its public loss, the step's term, its metrics; and the registry ``algo.loss`` names.
* :mod:`a3po_jax.core.algorithm`: the step's algorithm, assembled once from the config.
* :mod:`a3po_jax.core.batch_plan`: the batch geometry, computed once; ``make_batch``.
* :mod:`a3po_jax.core.train_step`: the jitted step, its micro-batches and the periodic fold.
* :mod:`a3po_jax.core.optim`: AdamW and the update; :mod:`a3po_jax.core.placement`: the
  mesh and the jit boundary; :mod:`a3po_jax.core.stats`: metrics that add, reduced once.
* :mod:`a3po_jax.core.batching`: rollout groups -> padded, target-aligned arrays.
* :mod:`a3po_jax.core.packing`: shared-prompt packing (one row per group).

The run configuration is read once, when the algorithm and the plan are built (before
anything is traced); nothing inside a jitted function sees it. Nothing here imports the
host-side shell (rollout, inference, training, cli).
"""
