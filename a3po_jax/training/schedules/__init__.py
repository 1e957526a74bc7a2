"""Training modes as schedules: one class per mode, chosen once by ``system.mode``.

Training layer (host-side shell).

A schedule says what differs between the modes of design §4, and nothing else: how far
behind the trained data may be (η, in optimizer versions), whether the inference host may
swap weights in the middle of a request, how a step takes and trains its batch (periodic
folds groups as they finish), what happens before a weight push (one-step-off waits for its
batch to reach the host), and whether a checkpoint holds the groups in flight. The trainer
(:mod:`a3po_jax.training.trainer`) runs the same loop for all of them.

A new mode is one module: subclass :class:`Schedule`, decorate it with :func:`register`,
and select it with ``system.mode=<name>``; a name that is not registered yet is imported as
``a3po_jax.training.schedules.<name>`` or ``<name>`` on the Python path first (docs/design.md,
"Adding a mode"). Lockstep (``system.lockstep_decode_steps``) and replay are wrappers around
the mode's schedule, not modes.
"""

from a3po_jax.training.schedules import asynchronous, one_step_off, periodic, sync  # noqa: F401
from a3po_jax.training.schedules.base import (
    Run,
    Schedule,
    Trained,
    Wrapped,
    get,
    names,
    register,
)

__all__ = ["Run", "Schedule", "Trained", "Wrapped", "get", "names", "register"]
