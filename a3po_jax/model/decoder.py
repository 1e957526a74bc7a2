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
depth. Decode steps use `apply_decode` instead: the same `decoder_layer` unrolled over
per-layer weights (`decode_params`, split once per weight update), because XLA:CPU copies
each scanned layer's weight slice before the matmuls read it, so a memory-bound decode step
moved the layer weights three times (read, write, read) instead of once. `hidden_states`
also runs over that split (a loop over its layers), so an inference engine prefills from
the copy it decodes from and holds no other. Flax only draws the initial weights
(`init_params`). The model names logical axes only (`naming.logical_axes`);
`parallel/sharding.py` maps them to mesh axes.

Shapes: B batch, T new tokens, S key slots (T without a cache, the cache capacity with one),
L layers, V vocab, D d_model, F ffn_dim, H query heads, N kv heads, G = H / N query heads per
kv head, K head_dim.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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
    out_major_product,
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


def hidden_states(
    params: Params | DecodeParams,
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

    `params` may also be a `DecodeParams` split (what an inference engine holds, so that it
    keeps one copy of the weights): its layers then run in `_loop_split_layers`, for inference
    only (no checkpoint policy), with the same values up to float rounding.

    Arguments as in `apply`.
    Returns:
      (hidden [B, T, D] float32, new KVCache or None), the cache as `apply` returns it.
    """
    c = config
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    b, t = tokens.shape
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (b, t))
    split = isinstance(params, DecodeParams)
    if split:
        if len(params.layers) != c.n_layers:
            raise ValueError(f"DecodeParams has {len(params.layers)} layers, config {c.n_layers}")
        embedding, final_scale = params.embed, params.final_norm
    else:
        embedding, final_scale = params["embed"]["embedding"], params["final_norm"]["scale"]
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
    if split:
        x, kv = _loop_split_layers(params.layers, x, kv, positions, mask, write_pos, c)
    else:
        x, kv = _scan_stacked_layers(params["layers"], x, kv, positions, mask, write_pos, c)

    # Final norm (and lm_head) in float32: log-probs feed importance ratios exp(a - b),
    # where bfloat16 rounding of logits would show up directly.
    hidden = rms_norm(x.astype(jnp.float32), final_scale, c.rms_eps)
    new_cache = None if kv_cache is None else advance_cache(kv_cache, *kv, segment_ids, b, t)
    return hidden, new_cache


def _scan_stacked_layers(
    layers: Params,
    x: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    positions: jax.Array,
    mask: jax.Array,
    write_pos: jax.Array | None,
    config: ModelConfig,
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
    # the outputs of the 2-D weight matmuls (`_linear`): norms, RoPE, SiLU and attention
    # (batched dots) are recomputed from them. Saving everything cost more than recomputing
    # it on a CPU: every saved activation is a fresh [L, ...] buffer, zero-filled and
    # page-faulted on each call. SmolLM2 shapes, tokens 8x128, float32, 2 shared cores, one
    # process, min of 3-4 round-robin runs, two runs: layer-stack grad 5.48 / 6.12 s saving
    # everything, 4.15 / 4.37 s with this policy, 4.70 s saving nothing (forward 1.13-1.21 s
    # under the same load); XLA temporaries 2447 -> 661 MiB (149 MiB saving nothing).
    # `remat=True` saves only each layer's input (least memory, one more forward).
    policy = (
        jax.checkpoint_policies.nothing_saveable
        if config.remat
        else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    one_layer = jax.checkpoint(one_layer, prevent_cse=False, policy=policy)
    (x, kv, _), _ = jax.lax.scan(one_layer, (x, kv, jnp.zeros((), jnp.int32)), layers)
    return x, kv


def _loop_split_layers(
    layers: tuple[Params, ...],
    x: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    positions: jax.Array,
    mask: jax.Array,
    write_pos: jax.Array | None,
    config: ModelConfig,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`decoder_layer` over per-layer weight trees (`DecodeParams.layers`), as a loop.

    A `fori_loop` whose body picks layer i's tree with `lax.switch`, so the layer is traced
    and compiled once (unrolling a prefill over 30 layers compiled 6x slower). The switch
    copies the chosen layer's weights, as the stacked path's scan copies its slice, so a
    prefill costs what it costs over stacked weights (30 SmolLM2 layers' matmuls at 64 /
    256 / 1024 rows: 106-110 / 339-369 / 1131-1176 ms against 105-108 / 317-390 / 1129-1166
    scanned, 2-core AMD EPYC) while the engine holds only the split.
    """
    branches = [functools.partial(lambda i, ls: ls[i], i) for i in range(len(layers))]

    def body(i, carry):
        x, kv = carry
        w = jax.lax.switch(i, branches, layers)
        cache = None if kv is None else LayerCache(*kv, i, write_pos)
        return decoder_layer(w, x, positions, mask, config=config, cache=cache)

    return jax.lax.fori_loop(0, len(layers), body, (x, kv))


def lm_head_logits(params: Params | DecodeParams, hidden: jax.Array, config: ModelConfig):
    """[M, D] float32 final hidden states -> [M, V] float32 logits, from either layout (a
    `DecodeParams`' tied head multiplies with the [V, D] table as `apply_decode` does)."""
    if isinstance(params, DecodeParams):
        return _decode_logits_t(params, hidden).T
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
    # "btd,dv->btv" as one 2-D [B·T, D] x [D, V] matmul (see `_linear`): as a 3-D einsum its
    # gradient transposed the [B, T, V] cotangent first. SmolLM2's head, tokens 8x128, grad
    # of the log-softmax target sum: 0.95 s as the einsum, 0.66 s as the 2-D matmul.
    b, t, d = hidden.shape
    logits = lm_head_logits(params, hidden.reshape(b * t, d), config).reshape(b, t, -1)
    return logits, new_cache


# ---------------------------------------------------------------------------------------------
# Decode path: the same layer, looped over per-layer weights laid out for it.


class DecodeParams(NamedTuple):
    """`apply`'s params laid out for decode steps: one weight tree per layer.

    Inside `apply`'s scan each layer's weights are a dynamic slice of the stacked [L, ...]
    arrays, and XLA's CPU backend materialises that slice before the matmuls read it: a
    decode step wrote a copy of every layer's weights and read them twice. Made once per
    weight update (`decode_params`), each layer's matmuls read their own arrays in place,
    and q/k/v and gate/up are one matrix each (fewer, longer reads). Every weight matrix is
    stored out-major, `kernel_t` [O, I] (the transpose of `apply`'s `kernel`), so that the
    decode step's matmuls run as `out_major_dot`: the weight as the GEMM's left operand,
    faster at a decode step's few rows.

    (`decode_params(..., out_major=False)` keeps `kernel` [I, O] instead, for one-row steps.)

    Each entry of `layers` is a `decoder_layer` weight tree: params["layers"]'s names, except
    that attn's q/k/v projections become `attn/qkv` (`kernel_t` [(H + 2N)·K, D], heads
    flattened, q, k, v one after the other; `bias` [(H + 2N)·K] for Qwen2), mlp's gate/up
    projections `mlp/gate_up` (`kernel_t` [2F, D]), and o_proj and down_proj hold
    `kernel_t` [D, H·K] and [D, F]; in the parameter dtype.
    """

    embed: jax.Array  # [V, D] embedding table; also the tied lm_head (shared, not copied).
    layers: tuple[Params, ...]  # L per-layer trees (see above).
    final_norm: jax.Array  # [D] final RMSNorm scale.
    lm_head: jax.Array | None  # [D, V] untied output kernel; None when tied.


@functools.partial(jax.jit, static_argnames=("out_major",))
def _decode_layers(stacked: Params, out_major: bool = True) -> tuple[Params, ...]:
    """params["layers"] ([L, ...] leaves) -> L trees of `DecodeParams.layers`."""
    n_layers = stacked["input_norm"]["scale"].shape[0]

    def matrix(kernels: list[jax.Array]) -> Params:  # [I, O_j] side by side, in the layout
        if out_major:
            return {"kernel_t": jnp.concatenate([k.T for k in kernels], axis=0)}
        return {"kernel": jnp.concatenate(kernels, axis=-1)}

    def layer(i: int) -> Params:
        w = jax.tree.map(lambda x: x[i], stacked)
        attn, mlp = w["attn"], w["mlp"]
        d = attn["q_proj"]["kernel"].shape[0]
        qkv = matrix([attn[f"{x}_proj"]["kernel"].reshape(d, -1) for x in "qkv"])
        if "bias" in attn["q_proj"]:
            qkv["bias"] = jnp.concatenate([attn[f"{x}_proj"]["bias"].ravel() for x in "qkv"])
        o_proj = matrix([attn["o_proj"]["kernel"].reshape(-1, d)]) if out_major else attn["o_proj"]
        fused_attn = {"qkv": qkv, "o_proj": o_proj}
        fused_attn.update({name: attn[name] for name in ("q_norm", "k_norm") if name in attn})
        return {
            "input_norm": w["input_norm"],
            "attn": fused_attn,
            "post_attn_norm": w["post_attn_norm"],
            "mlp": {
                "gate_up": matrix([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]]),
                "down_proj": matrix([mlp["down_proj"]["kernel"]])
                if out_major
                else mlp["down_proj"],
            },
        }

    return tuple(layer(i) for i in range(n_layers))


def decode_params(params: Params, config: ModelConfig, *, out_major: bool = True) -> DecodeParams:
    """`params` as `apply_decode` takes them: the layer weights copied once into L per-layer
    trees (one more copy of the layers in memory while `params` live); embedding, final norm
    and lm_head are shared with `params`. Run it once per weight update, not per step.
    `hidden_states` (so prefill and the cache recompute) takes the split too.

    `out_major=False` keeps the layer matrices in `apply`'s [I, O] layout (`kernel`), for
    one-row decode steps: a [1, I] x [I, O] product streams the weight about 12 % faster
    than the out-major one (30 layers of 576 x 3072: 7.6 vs 8.6 ms on the 2-core AMD EPYC),
    while from two rows up the out-major layout is 20-25 % faster (`out_major_dot`).
    `EngineCore` picks it by its slot count.
    """
    chex.assert_shape(params["embed"]["embedding"], (config.vocab_size, config.d_model))
    return DecodeParams(
        embed=params["embed"]["embedding"],
        layers=_decode_layers(params["layers"], out_major=out_major),
        final_norm=params["final_norm"]["scale"],
        lm_head=None if config.tie_embeddings else params["lm_head"]["kernel"],
    )


def apply_decode(
    params: DecodeParams,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    kv_cache: KVCache,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    vocab_major: bool = False,
) -> tuple[jax.Array, KVCache]:
    """`apply` with a KV cache, `decoder_layer` unrolled over `decode_params` weights.

    The same maths as `apply` (the same layer function; final norm and lm_head in float32);
    only the layout differs: per-layer weights read in place (no scan over stacked weights,
    which would copy each layer's slice), q/k/v and gate/up fused into one matmul each, and
    in the out-major layout (`decode_params`' default) every layer matmul and the tied
    lm_head's [V, D] table run with the weight as the left operand (`out_major_dot`); the
    in-major layout and an untied lm_head multiply as `apply` does. Logits agree with
    `apply`'s up to float rounding.
    The cache is written in place at `lengths[b] + t`, as in `apply`. Unrolling makes
    compile time grow with depth; the decode step compiles once per engine.

    Args:
      params: from `decode_params`.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions.
      config: the architecture.
      kv_cache: the cache to attend to and write into (as in `apply`).
      segment_ids: [B, T] int32, 0 = padding (not counted in the new lengths).
      window: attend to the first `window` cache slots only (static; None = the whole
        capacity). Attention reads the cache of every slot it covers at every step, so a
        short window is what keeps a step with a large capacity as cheap as a small one. The
        caller guarantees every row's new tokens land inside it (lengths + T <= window);
        the cache is still written at `lengths + t`, and slots past the window are masked
        anyway (they are empty or beyond every row's length), so the logits do not change.
      vocab_major: return the logits as [V, B·T] (column b·T + t for row b, token t): the
        tied out-major lm_head's own output, which the decode step samples from
        (`sampling.sample_tokens_vocab_major`) without transposing it. An untied head's
        are transposed (XLA then multiplies by the [D, V] matrix transposed, a copy of it:
        the engine asks for them only with a tied head).
    Returns:
      (logits [B, T, V] float32, or [V, B·T] with `vocab_major`; new KVCache).
    """
    c = config
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    b, t = tokens.shape
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (b, t))
    if len(params.layers) != c.n_layers:
        raise ValueError(f"DecodeParams has {len(params.layers)} layers, config {c.n_layers}")
    write_pos, mask = cache_write_pos_and_mask(kv_cache, c, b, t, None)
    capacity = kv_cache.k.shape[2]
    if window is not None:
        if not 0 < window <= capacity:
            raise ValueError(f"window must be in (0, capacity={capacity}], got {window}")
        mask = mask[:, :, :window]
    positions = positions.astype(jnp.int32)

    x = embed_tokens(params.embed, tokens, jnp.dtype(c.compute_dtype))
    cache_k, cache_v = kv_cache.k, kv_cache.v
    for i, w in enumerate(params.layers):
        cache = LayerCache(cache_k, cache_v, i, write_pos)
        x, (cache_k, cache_v) = decoder_layer(w, x, positions, mask, config=c, cache=cache)

    # Final norm and lm_head in float32, as in `apply`.
    hidden = rms_norm(x.astype(jnp.float32), params.final_norm, c.rms_eps).reshape(b * t, -1)
    logits_t = _decode_logits_t(params, hidden)  # [V, B·T]
    logits = logits_t if vocab_major else logits_t.T.reshape(b, t, -1)
    return logits, advance_cache(kv_cache, cache_k, cache_v, segment_ids, b, t)


def _decode_logits_t(params: DecodeParams, hidden: jax.Array) -> jax.Array:
    """[M, D] float32 hidden -> [V, M] float32 logits: a tied head multiplies with the [V, D]
    table as the left operand (`out_major_product`), an untied one as `apply` does."""
    if params.lm_head is None:  # tied: the [V, D] table is already out-major
        return out_major_product(hidden, params.embed.astype(jnp.float32))
    return jnp.dot(hidden, params.lm_head.astype(jnp.float32)).T
