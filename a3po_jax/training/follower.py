"""The training loop of every process but 0 in a multi-process run (training layer, host side).

Process 0 (the leader) runs the rollout workers, talks to the inference hosts, logs and
writes checkpoint metadata; every step it broadcasts the batch. The other processes only
take part in the collectives, in the same order as the leader's loop
(:meth:`a3po_jax.training.trainer.Trainer.run`): receive the batch and run the jitted step,
gather the weights for the push unless the step was skipped, agree on stopping, checkpoint.
If process 0 dies, the JAX coordination service (which it hosts) ends this process too.
"""

from __future__ import annotations

from collections.abc import Callable


def follow_leader(
    steps: range,
    *,
    train_step: Callable[[], bool],
    push_weights: Callable[[], None],
    stop_requested: Callable[[], bool],
    checkpoint: Callable[..., None],
) -> None:
    """Runs the follower's side of ``steps`` (the step indices still to train).

    Args:
      steps: e.g. ``range(start, cfg.steps)``.
      train_step: receives the broadcast batch and runs the jitted step; returns whether
        the step was skipped (non-finite), in which case no weights are pushed.
      push_weights: the weight gather (a collective, whoever hosts the weights).
      stop_requested: the collective stop vote (SIGTERM on any process).
      checkpoint: ``checkpoint(step, force=...)``, every process writes its shards.
    """
    for step in steps:
        if not train_step():
            push_weights()
        if stop_requested():
            checkpoint(step + 1, force=True)
            return
        checkpoint(step + 1, force=step + 1 == steps.stop)
