"""GGUF files (llama.cpp) into the `model.py` params pytree.

Model layer (pure core): imports only the core, model and parallel layers.

Read through PyPI `gguf`, without torch: the config from the file's metadata, every tensor
dequantised to float and renamed to its Hugging Face name, Q/K rows un-permuted back to the
Hugging Face layout where llama.cpp permuted them; the params are then assembled by
`a3po_jax.model.checkpoint_io.hf_tensors_to_params`, as from a safetensors checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from a3po_jax.model import ModelConfig, Params
from a3po_jax.model.checkpoint_io import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    hf_tensors_to_params,
)

# GGUF general.architecture -> (HF architecture, whether llama.cpp permuted the Q/K rows).
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}


def _gguf_field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # gguf < 0.11
    return value.tobytes().decode() if value.dtype == np.uint8 else value.item()


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves rotary halves into pairs)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of `_unpermute_qk`), for tests and export."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_hf_name(name: str) -> str:
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if match and match.group(2) in _GGUF_LAYER_TO_HF:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_TO_HF[match.group(2)]}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Hugging Face equivalent")


def gguf_config(
    reader, *, param_dtype: str = "float32", compute_dtype: str | None = None, **overrides
) -> ModelConfig:
    """A `ModelConfig` from GGUF metadata (`{arch}.block_count`, ...)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"unknown GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError("GGUF rope_freqs (scaled rotary embeddings) is not supported")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    d_model = int(_gguf_field(reader, f"{arch}.embedding_length"))
    n_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or int(embed.shape[-1])
    fields = dict(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_gguf_field(reader, f"{arch}.attention.key_length", d_model // n_heads)),
        ffn_dim=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        # GGUF stores eps as float32; its shortest float32 repr recovers the 1e-5 of the
        # original config.json instead of 9.999999747e-06.
        rms_eps=float(
            str(np.float32(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")))
        ),
        tie_embeddings="output.weight" not in names,
        max_seq_len=int(_gguf_field(reader, f"{arch}.context_length", 2048)),
        param_dtype=param_dtype,
        compute_dtype=compute_dtype or param_dtype,
        **SUPPORTED_ARCHITECTURES[GGUF_ARCHITECTURES[arch][0]],
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def load_gguf(
    path: str | os.PathLike,
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    shardings: Params | Callable[[ModelConfig], Params] | None = None,
    **overrides,
) -> tuple[ModelConfig, Params]:
    """Load a GGUF file: config from its metadata, tensors dequantised to float.

    llama.cpp stores matrices as [out, in] like Hugging Face, but permutes the rows of Q and K
    for Llama so rotary pairs are adjacent; they are un-permuted here. Returns (config, params).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    permuted = GGUF_ARCHITECTURES[_gguf_field(reader, "general.architecture")][1]
    tensors = {_gguf_hf_name(t.name): t for t in reader.tensors}

    def get_tensor(name: str) -> np.ndarray:
        t = tensors[name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_qk(w, config.n_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_qk(w, config.n_kv_heads)
        return w

    if callable(shardings):
        shardings = shardings(config)
    params = hf_tensors_to_params(get_tensor, tensors.keys(), config, shardings=shardings)
    return config, params
