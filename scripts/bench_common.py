"""Shared pieces of the benchmark scripts: model shapes and synthetic rollouts.

Speed does not depend on weight values, so benchmarks use randomly initialised models with
the real architectures' shapes and random token rollouts (`synthetic_groups`, from
`tests/factories.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The synthetic-group factory is shared with the tests (tests/factories.py); benchmarks, like
# tests, run from a checkout of the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from factories import synthetic_groups  # noqa: E402

from a3po_jax import model  # noqa: E402
from a3po_jax.model.assets import smollm2_config  # noqa: E402

__all__ = ["CONFIGS", "synthetic_groups"]

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
