"""The model layer (pure core): a Llama-family decoder as functions of arrays, its weight I/O.

``from a3po_jax import model`` gives the decoder's public API (``model.apply``,
``model.ModelConfig``, ...). Submodules:

* :mod:`a3po_jax.model.config`: `ModelConfig`, the architecture and numerics.
* :mod:`a3po_jax.model.layers`: RMSNorm, rotary embeddings, the projections and how a
  layer reads its weights (`WeightReader`), the one decoder layer function, attention masks
  and the KV cache.
* :mod:`a3po_jax.model.decoder`: the whole decoder: parameters, `apply`, `hidden_states`
  (and `hidden_states_with`, the decoder around any loop over its layers), the lm_head.
* :mod:`a3po_jax.model.naming`: logical axes and the flat weight names.
* :mod:`a3po_jax.model.attention`: grouped-query attention with its own backward pass.
* :mod:`a3po_jax.model.loader`: `load_model`, the one way to build a model by name.
* :mod:`a3po_jax.model.checkpoint_io`: Hugging Face safetensors reading/writing, tokenizers.
* :mod:`a3po_jax.model.gguf_io`: GGUF (llama.cpp) reading.
* :mod:`a3po_jax.model.assets`: the offline SmolLM2-135M-Instruct cache.
* :mod:`a3po_jax.model.char_tokenizer`: the character tokenizer of the toy tasks and the
  ChatML template.

Nothing here imports the host-side shell (rollout, inference, training, cli). The model
knows one weight layout, the stacked one it trains; the inference engine's serving layout
lives beside the engine (:mod:`a3po_jax.inference.engine.decode_layout`).
"""

from a3po_jax.model.config import ModelConfig, Params
from a3po_jax.model.decoder import (
    abstract_params,
    apply,
    hidden_states,
    hidden_states_with,
    init_params,
    lm_head_for_logprobs,
    lm_head_kernel,
    lm_head_logits,
)
from a3po_jax.model.layers import (
    TRAINING_WEIGHTS,
    KVCache,
    LayerCache,
    WeightReader,
    apply_rope,
    decoder_layer,
    init_kv_cache,
    rms_norm,
    rope_inverse_frequencies,
)
from a3po_jax.model.naming import (
    KV_CACHE_LOGICAL_AXES,
    PARAM_LOGICAL_AXES,
    TOKENS_LOGICAL_AXES,
    flatten_params,
    logical_axes,
    tree_path_str,
)

__all__ = [
    "KV_CACHE_LOGICAL_AXES",
    "PARAM_LOGICAL_AXES",
    "TOKENS_LOGICAL_AXES",
    "TRAINING_WEIGHTS",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "Params",
    "WeightReader",
    "abstract_params",
    "apply",
    "apply_rope",
    "decoder_layer",
    "flatten_params",
    "hidden_states",
    "hidden_states_with",
    "init_kv_cache",
    "init_params",
    "lm_head_for_logprobs",
    "lm_head_kernel",
    "lm_head_logits",
    "logical_axes",
    "rms_norm",
    "rope_inverse_frequencies",
    "tree_path_str",
]
