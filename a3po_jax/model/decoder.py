"""Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM2) as pure functions of a params dict.

Model layer (pure core). Everything jitted elsewhere (losses, the train step, the inference
engine) sees the model as

    apply(params, tokens, positions, *, config, ...) -> (logits, kv_cache)
    hidden_states(params, tokens, positions, *, config, ...) -> (hidden, kv_cache)

over a plain nested-dict params pytree. The architecture is exactly Hugging Face's
`LlamaForCausalLM` (RMSNorm, rotary embeddings with the checkpoint's θ, grouped-query
attention, SwiGLU MLP, tied or untied embeddings) with Qwen2's q/k/v bias and Qwen3's q/k
RMSNorm as switches.

The layer maths is written once, in `layers.decoder_layer`. `apply` runs it as one
`jax.lax.scan` over stacked parameters (leading axis L), so compile time does not grow with
depth. `hidden_states_with` is the decoder around any way of running its layers (embedding,
masks, final norm, cache lengths): `hidden_states` runs the scan through it, and a caller
that keeps its own copy of the weights in another layout runs its own loop through it.
Flax only draws the initial weights (`init_params`). The model names logical axes only
(`naming.logical_axes`); `parallel/sharding.py` maps them to mesh axes.

Shapes: B batch, T new tokens, S key slots (T without a cache, the cache capacity with one),
L layers, V vocab, D d_model, F ffn_dim, H query heads, N kv heads, G = H / N query heads per
kv head, K head_dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from a3po_jax.model.config import ModelConfig, Params
from a3po_jax.model.layers import (
    KVCache,
    LayerCache,
    advance_cache,
    cache_write_pos_and_mask,
    causal_segment_mask,
    decoder_layer,
    embed_tokens,
    rms_norm,
)

# ---------------------------------------------------------------------------------------------
# Parameters: one nested dict, named after Hugging Face's modules.

_init = nn.initializers.normal(stddev=0.02)  # HF `initializer_range` default.


def _linear_spec(kernel_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None) -> tuple:
    """An HF `nn.Linear`: its kernel (heads kept as separate axes) and optional bias."""
    spec = (("kernel", (_init, kernel_shape)),)
    if bias_shape is not None:
        spec += (("bias", (nn.initializers.zeros, bias_shape)),)
    return spec


def _norm_spec(width: int) -> tuple:
    return (("scale", (nn.initializers.ones, (width,))),)


def _layer_spec(c: ModelConfig) -> tuple:
    """One decoder block's parameters: (name, (initializer, shape)) leaves, (name, spec)
    subtrees, in the order `init_params` creates them."""
    d, h, n, k, f = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
    attn = (
        ("q_proj", _linear_spec((d, h, k), (h, k) if c.qkv_bias else None)),
        ("k_proj", _linear_spec((d, n, k), (n, k) if c.qkv_bias else None)),
        ("v_proj", _linear_spec((d, n, k), (n, k) if c.qkv_bias else None)),
    )
    if c.qk_norm:
        attn += (("q_norm", _norm_spec(k)), ("k_norm", _norm_spec(k)))
    attn += (("o_proj", _linear_spec((h, k, d), None)),)
    mlp = (
        ("gate_proj", _linear_spec((d, f), None)),
        ("up_proj", _linear_spec((d, f), None)),
        ("down_proj", _linear_spec((f, d), None)),
    )
    return (
        ("input_norm", _norm_spec(d)),
        ("attn", attn),
        ("post_attn_norm", _norm_spec(d)),
        ("mlp", mlp),
    )


class _Declare(nn.Module):
    """Creates the parameters of `spec` under this module's name; no maths.

    The decoder itself is plain functions of the params dict (`decoder_layer`, `apply`).
    Flax only draws the initial values, for its per-name random streams: a seed gives the
    same weights it always gave.
    """

    spec: tuple
    param_dtype: Any

    @nn.compact
    def __call__(self, carry=None):
        for name, entry in self.spec:
            if callable(entry[0]):
                self.param(name, entry[0], entry[1], self.param_dtype)
            else:
                _Declare(entry, self.param_dtype, name=name)()
        return carry, None


class _DeclareDecoder(nn.Module):
    """embed, L stacked layers (leading axis L, one random stream per layer), final_norm,
    and lm_head when untied."""

    config: ModelConfig

    @nn.compact
    def __call__(self):
        c = self.config
        pdt = jnp.dtype(c.param_dtype)
        _Declare((("embedding", (_init, (c.vocab_size, c.d_model))),), pdt, name="embed")()
        nn.scan(
            _Declare,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=c.n_layers,
        )(_layer_spec(c), pdt, name="layers")(None)
        _Declare(_norm_spec(c.d_model), pdt, name="final_norm")()
        if not c.tie_embeddings:
            _Declare(_linear_spec((c.d_model, c.vocab_size), None), pdt, name="lm_head")()


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (normal(0.02) weights, unit norms, zero biases) as a nested dict."""
    return _init_fn(config)(key)


@functools.cache
def _init_fn(config: ModelConfig):
    return jax.jit(lambda key: _DeclareDecoder(config).init(key)["params"])


def abstract_params(config: ModelConfig) -> Params:
    """Shapes and dtypes of `init_params` (jax.ShapeDtypeStruct leaves), without allocating."""
    return jax.eval_shape(_init_fn(config), jax.random.key(0))


def lm_head_kernel(params: Params, config: ModelConfig) -> jax.Array:
    """[D, V] float32 output projection (the embedding table's transpose when tied): what
    `apply` multiplies `hidden_states` with."""
    head, is_table = lm_head_for_logprobs(params, config)
    return head.T if is_table else head


def lm_head_for_logprobs(params: Params, config: ModelConfig) -> tuple[jax.Array, bool]:
    """(head, head_is_table) for `core.logprobs.chunked_token_logprobs`, float32: a tied
    model's [V, D] embedding table as it is stored (True), an untied model's [D, V] kernel
    (False). The table read as stored spares the train step a transposed [D, V] copy of it
    and a transpose of its gradient."""
    if config.tie_embeddings:
        return params["embed"]["embedding"].astype(jnp.float32), True
    return params["lm_head"]["kernel"].astype(jnp.float32), False


# ---------------------------------------------------------------------------------------------
# The whole decoder

# What runs the L layers over weights it holds: (x [B, T, D], kv = (cache_k, cache_v) or None,
# positions [B, T], mask [B, T, S], write_pos [B, T] or None) -> (x, kv).
LayerRunner = Callable[..., tuple[jax.Array, Any]]


def hidden_states_with(
    run_layers: LayerRunner,
    embedding: jax.Array,
    final_scale: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    kv_cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`hidden_states` with the L layers run by `run_layers`: the decoder around its layers.

    Looks the tokens up in `embedding` [V, D], builds the attention mask and the cache write
    slots, hands them to `run_layers`, and applies the final norm (scale `final_scale` [D])
    in float32 and the new cache lengths. `hidden_states` passes one scan over the stacked
    weights; a caller holding the weights in another layout passes its own loop over them
    (each layer still `layers.decoder_layer`, with a `layers.WeightReader` for its layout).

    Other arguments and the result as in `hidden_states`.
    """
    c = config
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    b, t = tokens.shape
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (b, t))
    chex.assert_shape(embedding, (c.vocab_size, c.d_model))

    if kv_cache is None:
        if attention_mask is not None:
            chex.assert_shape(attention_mask, (b, t, t))
            mask = attention_mask.astype(bool)
        else:
            mask = causal_segment_mask(t, segment_ids, b)
        write_pos, kv = None, None
    else:
        write_pos, mask = cache_write_pos_and_mask(kv_cache, c, b, t, attention_mask)
        kv = (kv_cache.k, kv_cache.v)
    positions = positions.astype(jnp.int32)

    x = embed_tokens(embedding, tokens, jnp.dtype(c.compute_dtype))  # [B, T, D]
    x, kv = run_layers(x, kv, positions, mask, write_pos)

    # Final norm (and lm_head) in float32: log-probs feed importance ratios exp(a - b),
    # where bfloat16 rounding of logits would show up directly.
    hidden = rms_norm(x.astype(jnp.float32), final_scale, c.rms_eps)
    new_cache = None if kv_cache is None else advance_cache(kv_cache, *kv, segment_ids, b, t)
    return hidden, new_cache


def hidden_states(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    kv_cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`apply` without the lm_head: the float32 final-norm hidden states, for callers that
    multiply them with the head themselves (chunked-vocab log-probs, or only the
    positions they need) instead of materialising [B, T, V] logits.

    Arguments as in `apply`.
    Returns:
      (hidden [B, T, D] float32, new KVCache or None), the cache as `apply` returns it.
    """
    return hidden_states_with(
        functools.partial(_scan_stacked_layers, params["layers"], config),
        params["embed"]["embedding"],
        params["final_norm"]["scale"],
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        attention_mask=attention_mask,
        kv_cache=kv_cache,
    )


def _scan_stacked_layers(
    layers: Params,
    config: ModelConfig,
    x: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    positions: jax.Array,
    mask: jax.Array,
    write_pos: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`decoder_layer` as one scan over the stacked [L, ...] weights, so compile time does not
    grow with depth. The cache rides in the carry (not as scanned input/output) so it is
    updated in place; scanned outputs would rebuild the whole [L, B, S, N, K] cache every
    call."""

    def one_layer(carry, w):
        x, kv, layer = carry
        cache = None if kv is None else LayerCache(*kv, layer, write_pos)
        x, kv = decoder_layer(w, x, positions, mask, config=config, cache=cache)
        return (x, kv, layer + 1), None

    # What the backward pass keeps of each layer (no effect without a gradient). By default
    # the outputs of the 2-D weight matmuls (`layers.linear`): norms, RoPE, SiLU and
    # attention (batched dots) are recomputed from them, which on a CPU costs less than
    # saving everything (each saved activation is a fresh [L, ...] buffer; docs/performance.md).
    # `remat=True` saves only each layer's input (least memory, one more forward).
    policy = (
        jax.checkpoint_policies.nothing_saveable
        if config.remat
        else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    one_layer = jax.checkpoint(one_layer, prevent_cse=False, policy=policy)
    (x, kv, _), _ = jax.lax.scan(one_layer, (x, kv, jnp.zeros((), jnp.int32)), layers)
    return x, kv


def lm_head_logits(params: Params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
    """[M, D] float32 final hidden states -> [M, V] float32 logits."""
    return jnp.dot(hidden, lm_head_kernel(params, config))


def apply(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    kv_cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder on T new tokens per row.

    Without a cache, query t attends keys s <= t with the same non-zero segment id
    (segment 0 is padding and is never attended to), or exactly where `attention_mask` is
    True if it is given. With a cache, the new tokens of row b are written at slots
    `lengths[b] + t` and query t attends slots s <= lengths[b] + t (or `attention_mask`
    [B, T, S] if given); prompts must be right-padded so valid tokens come first.

    Args:
      params: pytree from `init_params` or a checkpoint loader.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions (explicit: packing may restart them).
      config: the architecture.
      segment_ids: [B, T] int32, 0 = padding; with a cache it only counts valid tokens.
      attention_mask: [B, T, T] bool (no cache) or [B, T, S] bool (cache): "query t may
        attend key s", used instead of the causal + segment rule.
      kv_cache: a `KVCache`, or None for a full forward pass.
    Returns:
      (logits [B, T, V] float32, new KVCache or None). The new cache has
      `lengths + n_valid`, n_valid[b] = number of tokens of row b with segment_ids != 0
      (all T without segment_ids). `hidden_states` gives the lm_head's input instead.
    """
    hidden, new_cache = hidden_states(
        params,
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        attention_mask=attention_mask,
        kv_cache=kv_cache,
    )
    # "btd,dv->btv" as one 2-D [B·T, D] x [D, V] matmul (see `layers.linear`): as a 3-D
    # einsum its gradient transposed the [B, T, V] cotangent first (docs/performance.md).
    b, t, d = hidden.shape
    logits = lm_head_logits(params, hidden.reshape(b * t, d), config).reshape(b, t, -1)
    return logits, new_cache
