"""Shared pieces of the benchmark scripts: model shapes and synthetic rollouts.

Speed does not depend on weight values, so benchmarks use randomly initialised models with
the real architectures' shapes and random token rollouts.
"""

from __future__ import annotations

import numpy as np

from a3po_jax import model
from a3po_jax.core.types import Rollout, RolloutGroup
from a3po_jax.model.assets import smollm2_config

CONFIGS = {
    "tiny": model.ModelConfig.tiny(max_seq_len=4096),
    "small": model.ModelConfig(
        vocab_size=8192,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=768,
        max_seq_len=4096,
    ),
    "smollm2": smollm2_config(),
}


def synthetic_groups(
    n_groups: int,
    group_size: int,
    prompt_len: int,
    response_len: int,
    vocab: int,
    *,
    max_version: int = 0,
    seed: int = 0,
) -> list[RolloutGroup]:
    """Groups of random prompts/completions; each group's tokens carry one version drawn
    from [0, max_version] so staleness-dependent code paths are exercised."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=prompt_len)
        version = int(rng.integers(0, max_version + 1))
        rollouts = [
            Rollout(
                prompt_id=f"p{g}",
                group_id=g,
                sample_index=i,
                prompt_tokens=prompt,
                completion_tokens=rng.integers(3, vocab, size=response_len),
                behav_logprobs=-rng.uniform(0.5, 3.0, size=response_len),
                versions=np.full(response_len, version, np.int32),
                finish_reason="stop",
                reward=float(rng.integers(0, 2)),
            )
            for i in range(group_size)
        ]
        groups.append(RolloutGroup(f"p{g}", g, rollouts, admitted_at_version=0))
    return groups
