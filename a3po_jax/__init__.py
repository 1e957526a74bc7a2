"""a3po_jax: asynchronous reinforcement learning of LLMs in JAX.

The pure core (losses, model, train step) is importable without TensorFlow or JetStream;
the host-side shell (inference host, rollout queue, trainer loop, CLI) lives in its own
modules. Public loss functions are re-exported here.
"""

from a3po_jax.core.losses import (
    AGGREGATIONS,
    a3po_alpha,
    a3po_prox_logp,
    aggregate,
    decoupled_ppo_loss,
    entropy,
    grpo_advantages,
    kl_penalty,
    online_dpo_loss,
    ppo_clip_loss,
    rloo_advantages,
    sequence_logprobs,
    token_logprobs,
)

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS",
    "a3po_alpha",
    "a3po_prox_logp",
    "aggregate",
    "decoupled_ppo_loss",
    "entropy",
    "grpo_advantages",
    "kl_penalty",
    "online_dpo_loss",
    "ppo_clip_loss",
    "rloo_advantages",
    "sequence_logprobs",
    "token_logprobs",
]
