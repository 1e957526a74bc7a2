"""The architecture and numerics of a Llama-family decoder: `ModelConfig`.

Model layer (pure core). The lowest level of the model: the other modules (`layers`,
`decoder`) read a config; nothing here touches arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# A model's weights: one nested dict, named after Hugging Face's modules (`decoder.init_params`).
Params = dict[str, Any]

DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of a Llama-family decoder."""

    vocab_size: int  # V: rows of the embedding table.
    d_model: int  # D: residual stream width.
    n_layers: int  # L: decoder blocks.
    n_heads: int  # H: query heads.
    n_kv_heads: int  # N: key/value heads (GQA); must divide n_heads.
    head_dim: int  # K: width of one head (even, for rotary embeddings).
    ffn_dim: int  # F: SwiGLU hidden width.
    rope_theta: float = 10000.0  # Rotary base θ from the checkpoint.
    rms_eps: float = 1e-5  # RMSNorm epsilon.
    tie_embeddings: bool = True  # lm_head reuses the embedding table.
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections.
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE.
    param_dtype: str = "float32"  # Storage dtype of parameters.
    compute_dtype: str = "float32"  # Matmul dtype; norms, softmax and logits stay float32.
    remat: bool = False  # Backward keeps only layer inputs (else also the weight matmuls).
    max_seq_len: int = 2048  # Longest position the caller intends to use.
    rope_type: str = "default"  # "default" or "llama3" (Llama 3.1 frequency scaling).
    rope_factor: float = 1.0  # llama3 scaling: factor.
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low_freq_factor.
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high_freq_factor.
    rope_original_max_len: int = 8192  # llama3 scaling: original_max_position_embeddings.

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "max_seq_len",
            "rope_original_max_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide "
                f"ModelConfig.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} must be even (rotary embeddings rotate "
                "pairs)"
            )
        for name in ("rope_theta", "rms_eps", "rope_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}"
                )
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"ModelConfig.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}"
            )
        if (
            self.rope_type == "llama3"
            and not self.rope_high_freq_factor > self.rope_low_freq_factor
        ):
            raise ValueError(
                "ModelConfig.rope_high_freq_factor must exceed rope_low_freq_factor, got "
                f"{self.rope_high_freq_factor} <= {self.rope_low_freq_factor}"
            )

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """A small random-init model for tests: V=128, D=64, 2 layers, 4 heads, 2 kv heads."""
        fields = dict(
            vocab_size=128,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            ffn_dim=128,
            max_seq_len=256,
        )
        fields.update(overrides)
        return cls(**fields)

    @property
    def n_params(self) -> int:
        """Number of parameters (what `init_params` creates)."""
        d, k, h, n = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads
        attn = d * h * k * 2 + d * n * k * 2
        if self.qkv_bias:
            attn += (h + 2 * n) * k
        if self.qk_norm:
            attn += 2 * k
        layer = attn + 3 * d * self.ffn_dim + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * layer + d + head
