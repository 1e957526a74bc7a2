"""a3po_jax: asynchronous reinforcement learning of LLMs in JAX.

The pure core (losses, model, train step) is importable without TensorFlow or JetStream;
the host-side shell (inference host, rollout queue, trainer loop, CLI) lives in its own
modules. Public loss functions are re-exported here.
"""

import importlib

__version__ = "0.1.0"

# Loaded on first use (PEP 562): `import a3po_jax.cli.results` and every command's --help
# start without importing JAX.
_LOSSES = "a3po_jax.core.losses"

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


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(_LOSSES), name)
    raise AttributeError(f"module 'a3po_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
