"""The model layer (pure core): a Llama-family decoder as functions of arrays, its weight I/O.

``from a3po_jax import model`` gives the decoder's public API (``model.apply``,
``model.ModelConfig``, ...). Submodules:

* :mod:`a3po_jax.model.decoder`: the decoder, its KV cache, the decode path and logical axes.
* :mod:`a3po_jax.model.checkpoint_io`: Hugging Face safetensors and GGUF reading/writing.
* :mod:`a3po_jax.model.assets`: the offline SmolLM2-135M-Instruct cache.
* :mod:`a3po_jax.model.char_tokenizer`: the character tokenizer of the toy tasks.

Nothing here imports the host-side shell (rollout, inference, training, cli).
"""

from a3po_jax.model.decoder import (
    KV_CACHE_LOGICAL_AXES,
    MLP,
    PARAM_LOGICAL_AXES,
    TOKENS_LOGICAL_AXES,
    Attention,
    DecodeParams,
    Decoder,
    DecoderLayer,
    KVCache,
    LMHead,
    ModelConfig,
    Params,
    Projection,
    RMSNorm,
    abstract_params,
    apply,
    apply_decode,
    apply_rope,
    decode_params,
    greedy_generate,
    init_kv_cache,
    init_params,
    lm_head_kernel,
    logical_axes,
    rms_norm,
    rope_inverse_frequencies,
    tree_path_str,
)

__all__ = [
    "KV_CACHE_LOGICAL_AXES",
    "MLP",
    "PARAM_LOGICAL_AXES",
    "TOKENS_LOGICAL_AXES",
    "Attention",
    "DecodeParams",
    "Decoder",
    "DecoderLayer",
    "KVCache",
    "LMHead",
    "ModelConfig",
    "Params",
    "Projection",
    "RMSNorm",
    "abstract_params",
    "apply",
    "apply_decode",
    "apply_rope",
    "decode_params",
    "greedy_generate",
    "init_kv_cache",
    "init_params",
    "lm_head_kernel",
    "logical_axes",
    "rms_norm",
    "rope_inverse_frequencies",
    "tree_path_str",
]
