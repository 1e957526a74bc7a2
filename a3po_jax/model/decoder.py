"""Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM2) in Flax linen behind a pure `apply`.

Everything jitted elsewhere (losses, the train step, the inference engine) sees the model as

    apply(params, tokens, positions, *, config, ...) -> (logits, kv_cache)

over a plain nested-dict params pytree. The architecture is exactly Hugging Face's
`LlamaForCausalLM` (RMSNorm, rotary embeddings with the checkpoint's θ, grouped-query
attention, SwiGLU MLP, tied or untied embeddings) with Qwen2's q/k/v bias and Qwen3's q/k
RMSNorm as switches.

Layers are one `nn.scan` over stacked parameters (leading axis L), so compile time does not
grow with depth. Decode steps use `apply_decode` instead: the same layer math unrolled over
per-layer weights (`decode_params`, split once per weight update), because XLA:CPU copies
each scanned layer's weight slice before the matmuls read it, so a memory-bound decode step
moved the layer weights three times (read, write, read) instead of once.
The model names logical axes only (`logical_axes`); `sharding.py` maps them to mesh axes.

Shapes: B batch, T new tokens, S key slots (T without a cache, the cache capacity with one),
L layers, V vocab, D d_model, F ffn_dim, H query heads, N kv heads, G = H / N query heads per
kv head, K head_dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "llama3")
# A finite "minus infinity": a fully masked row (a padding query) then softmaxes to a
# uniform distribution instead of NaN.
_MASK_VALUE = float(np.finfo(np.float32).min)


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
    remat: bool = False  # Rematerialise each layer in the backward pass.
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
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"ModelConfig.rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}"
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


class KVCache(NamedTuple):
    """Per-layer keys/values of every row, and how many slots of each row are valid."""

    k: jax.Array  # [L, B, S, N, K]
    v: jax.Array  # [L, B, S, N, K]
    lengths: jax.Array  # [B] int32: valid cached tokens per row (next write slot).


def init_kv_cache(config: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache with `capacity` slots per row (dtype defaults to the compute dtype)."""
    if batch_size <= 0 or capacity <= 0:
        raise ValueError(
            f"init_kv_cache needs batch_size > 0 and capacity > 0, got {batch_size}, {capacity}"
        )
    dtype = jnp.dtype(dtype or config.compute_dtype)
    shape = (config.n_layers, batch_size, capacity, config.n_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


# ---------------------------------------------------------------------------------------------
# Rotary embeddings


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[K/2] float32 inverse frequencies θ^(-2i/K), with Llama 3.1 scaling if configured.

    Computed in float32 as transformers does, so positions times frequencies round alike.
    """
    k = config.head_dim
    exponent = np.arange(0, k, 2, dtype=np.int64).astype(np.float32) / np.float32(k)
    inv_freq = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(
        np.float32
    )
    if config.rope_type == "llama3":
        # Llama 3.1 (transformers `_compute_llama3_parameters`): long wavelengths are slowed
        # by `factor`, short ones kept, the band between interpolated smoothly.
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_len
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate halves of each head (HF `rotate_half` layout, not interleaved pairs).

    Args:
      x: [B, T, H, K] queries or keys.
      positions: [B, T] int32 positions.
      inv_freq: [K/2] float32 inverse frequencies.
    Returns:
      [B, T, H, K] in x's dtype; the rotation itself is computed in float32.
    """
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, K/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, K/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Modules

_init = nn.initializers.normal(stddev=0.02)  # HF `initializer_range` default.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last axis ([..., D] -> [..., D] in x's dtype), statistics
    in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    # transformers casts back to the input dtype before scaling; doing the same keeps
    # bfloat16 runs close to it.
    return scale.astype(x.dtype) * normed.astype(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with its scale as a parameter."""

    eps: float
    param_dtype: Any

    @nn.compact
    def __call__(self, x):  # [..., D] -> [..., D] in x's dtype
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps)


class Projection(nn.Module):
    """One weight matrix (an HF `nn.Linear`) with its heads kept as a separate axis."""

    kernel_shape: tuple[int, ...]
    equation: str  # einsum "input,kernel->output"
    bias_shape: tuple[int, ...] | None
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", _init, self.kernel_shape, self.param_dtype)
        y = jnp.einsum(self.equation, x.astype(self.dtype), kernel.astype(self.dtype))
        if self.bias_shape is not None:
            bias = self.param("bias", nn.initializers.zeros, self.bias_shape, self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


def _write_slots(
    cache: jax.Array, layer: jax.Array, new: jax.Array, write_pos: jax.Array
) -> jax.Array:
    """cache[layer, b, write_pos[b, t]] = new[b, t]; slots past the capacity are dropped.

    cache [L, B, S, N, K], layer a scalar, new [B, T, N, K], write_pos [B, T]. The whole
    cache is carried from layer to layer (the scan carry, or `apply_decode`'s loop), so this
    scatter updates it in place: only the T new tokens are written per step, never a copy of
    the cache. A scatter rather than `dynamic_update_slice`, which would clamp an
    overflowing start and shift the write.
    """
    rows = jnp.arange(cache.shape[1])[:, None]  # [B, 1]
    return cache.at[layer, rows, write_pos].set(new.astype(cache.dtype), mode="drop")


def _attend(
    q: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array, config: ModelConfig
) -> jax.Array:
    """Grouped-query attention: q [B,T,H,K], key/value [B,S,N,K], mask [B,T,S] bool ->
    [B,T,H,K] in the compute dtype."""
    b, t, h, k = q.shape
    n = key.shape[2]
    g = h // n
    q = q.reshape(b, t, n, g, k)  # query head h = n * G + g, as HF's repeat_kv implies
    # Scores and softmax in float32 whatever the compute dtype.
    scores = jnp.einsum("btngk,bsnk->bngts", q, key, preferred_element_type=jnp.float32)
    scores = scores * (k**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.dtype(config.compute_dtype))  # [B,N,G,T,S]
    return jnp.einsum("bngts,bsnk->btngk", probs, value).reshape(b, t, h, k)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, write_pos, cache):
        """x [B,T,D], positions [B,T], mask [B,T,S] bool, write_pos [B,T] or None, cache None
        or (k [L,B,S,N,K], v [L,B,S,N,K], this layer's index). Returns ([B,T,D], cache)."""
        c = self.config
        cdt, pdt = jnp.dtype(c.compute_dtype), jnp.dtype(c.param_dtype)
        d, h, n, k = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
        bias = c.qkv_bias
        proj = functools.partial(Projection, dtype=cdt, param_dtype=pdt)
        q = proj((d, h, k), "btd,dhk->bthk", (h, k) if bias else None, name="q_proj")(x)
        key = proj((d, n, k), "btd,dnk->btnk", (n, k) if bias else None, name="k_proj")(x)
        value = proj((d, n, k), "btd,dnk->btnk", (n, k) if bias else None, name="v_proj")(x)
        if c.qk_norm:
            q = RMSNorm(c.rms_eps, pdt, name="q_norm")(q)
            key = RMSNorm(c.rms_eps, pdt, name="k_norm")(key)
        inv_freq = rope_inverse_frequencies(c)
        q = apply_rope(q, positions, inv_freq)
        key = apply_rope(key, positions, inv_freq)

        if cache is not None:
            cache_k, cache_v, layer = cache
            cache_k = _write_slots(cache_k, layer, key, write_pos)
            cache_v = _write_slots(cache_v, layer, value, write_pos)
            key, value = cache_k[layer].astype(cdt), cache_v[layer].astype(cdt)  # [B, S, N, K]
            cache = (cache_k, cache_v, layer)

        out = _attend(q, key, value, mask, c)  # [B, T, H, K]
        out = proj((h, k, d), "bthk,hkd->btd", None, name="o_proj")(out)
        return out, cache


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        c = self.config
        proj = functools.partial(
            Projection, dtype=jnp.dtype(c.compute_dtype), param_dtype=jnp.dtype(c.param_dtype)
        )
        d, f = c.d_model, c.ffn_dim
        gate = proj((d, f), "btd,df->btf", None, name="gate_proj")(x)
        up = proj((d, f), "btd,df->btf", None, name="up_proj")(x)
        return proj((f, d), "btf,fd->btd", None, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, carry, positions, mask, write_pos):
        """carry = (x [B,T,D], cache None or (k, v, layer index)); scanned over layers."""
        x, cache = carry
        c = self.config
        pdt = jnp.dtype(c.param_dtype)
        h = RMSNorm(c.rms_eps, pdt, name="input_norm")(x)
        attn, cache = Attention(c, name="attn")(h, positions, mask, write_pos, cache)
        x = x + attn
        h = RMSNorm(c.rms_eps, pdt, name="post_attn_norm")(x)
        x = x + MLP(c, name="mlp")(h)
        if cache is not None:
            cache = (cache[0], cache[1], cache[2] + 1)
        return (x, cache), None


class Decoder(nn.Module):
    """Embedding, L scanned layers, final norm and lm_head (the last two in float32)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions, mask, write_pos, cache_k, cache_v, compute_logits):
        c = self.config
        cdt, pdt = jnp.dtype(c.compute_dtype), jnp.dtype(c.param_dtype)
        embed = nn.Embed(
            c.vocab_size, c.d_model, dtype=cdt, param_dtype=pdt, embedding_init=_init, name="embed"
        )
        x = embed(tokens)  # [B, T, D]

        layer = DecoderLayer
        if c.remat:
            layer = nn.remat(layer, prevent_cse=False)
        layers = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.n_layers,
        )(c, name="layers")
        # The cache rides in the carry (not as scanned input/output) so it is updated in
        # place; scanned outputs would rebuild the whole [L, B, S, N, K] cache every call.
        cache = None if cache_k is None else (cache_k, cache_v, jnp.zeros((), jnp.int32))
        (x, cache), _ = layers((x, cache), positions, mask, write_pos)
        if cache is not None:
            cache_k, cache_v, _ = cache

        # Final norm and lm_head in float32: log-probs feed importance ratios exp(a - b),
        # where bfloat16 rounding of logits would show up directly.
        hidden = RMSNorm(c.rms_eps, pdt, name="final_norm")(x.astype(jnp.float32))
        if c.tie_embeddings:
            head = embed.embedding.astype(jnp.float32).T  # [D, V]
        else:
            head = LMHead(c.d_model, c.vocab_size, pdt, name="lm_head")()  # [D, V]
        logits = jnp.einsum("btd,dv->btv", hidden, head) if compute_logits else None
        return logits, hidden, cache_k, cache_v


class LMHead(nn.Module):
    """Untied output projection, stored as `lm_head/kernel` [D, V]."""

    d_model: int
    vocab_size: int
    param_dtype: Any

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", _init, (self.d_model, self.vocab_size), self.param_dtype)
        return kernel.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Pure boundary


def _causal_segment_mask(t: int, segment_ids: jax.Array | None, batch: int) -> jax.Array:
    """[B, T, T] bool: query t attends key s <= t of the same non-zero segment."""
    idx = jnp.arange(t)
    causal = idx[:, None] >= idx[None, :]  # [T, T]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, t, t))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    key_valid = (segment_ids != 0)[:, None, :]
    return causal[None] & same & key_valid


def _cache_write_pos_and_mask(
    kv_cache: KVCache,
    config: ModelConfig,
    b: int,
    t: int,
    attention_mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Cache slots the T new tokens are written to, write_pos [B, T] = lengths + t, and the
    [B, T, S] attention mask: `attention_mask` if given, else slots s <= write_pos."""
    capacity = kv_cache.k.shape[2]
    chex.assert_shape(
        [kv_cache.k, kv_cache.v],
        (config.n_layers, b, capacity, config.n_kv_heads, config.head_dim),
    )
    chex.assert_shape(kv_cache.lengths, (b,))
    write_pos = kv_cache.lengths[:, None].astype(jnp.int32) + jnp.arange(t)[None, :]  # [B, T]
    if attention_mask is not None:
        chex.assert_shape(attention_mask, (b, t, capacity))
        return write_pos, attention_mask.astype(bool)
    return write_pos, jnp.arange(capacity)[None, None, :] <= write_pos[:, :, None]  # [B, T, S]


def _advanced_cache(
    kv_cache: KVCache,
    cache_k: jax.Array,
    cache_v: jax.Array,
    segment_ids: jax.Array | None,
    b: int,
    t: int,
) -> KVCache:
    """The written cache with lengths + n_valid, n_valid[b] = tokens of row b with a non-zero
    segment id (all T without segment ids)."""
    if segment_ids is None:
        n_valid = jnp.full((b,), t, jnp.int32)
    else:
        n_valid = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)
    return KVCache(k=cache_k, v=cache_v, lengths=kv_cache.lengths + n_valid)


def apply(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    kv_cache: KVCache | None = None,
    return_hidden: bool = False,
    compute_logits: bool = True,
):
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
      return_hidden: also return the float32 final-norm hidden states [B, T, D] (the
        lm_head input), for a chunked-vocab log-prob.
      compute_logits: False skips the lm_head (logits returned as None); for callers that
        only want the hidden states.
    Returns:
      (logits [B, T, V] float32, new KVCache or None), plus hidden [B, T, D] float32 if
      `return_hidden`. The new cache has `lengths + n_valid`, n_valid[b] = number of tokens
      of row b with segment_ids != 0 (all T without segment_ids).
    """
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    b, t = tokens.shape
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (b, t))

    if kv_cache is None:
        if attention_mask is not None:
            chex.assert_shape(attention_mask, (b, t, t))
            mask = attention_mask.astype(bool)
        else:
            mask = _causal_segment_mask(t, segment_ids, b)
        write_pos, cache_k, cache_v = None, None, None
    else:
        write_pos, mask = _cache_write_pos_and_mask(kv_cache, config, b, t, attention_mask)
        cache_k, cache_v = kv_cache.k, kv_cache.v

    logits, hidden, cache_k, cache_v = Decoder(config).apply(
        {"params": params},
        tokens.astype(jnp.int32),
        positions.astype(jnp.int32),
        mask,
        write_pos,
        cache_k,
        cache_v,
        compute_logits,
    )

    new_cache = None
    if kv_cache is not None:
        new_cache = _advanced_cache(kv_cache, cache_k, cache_v, segment_ids, b, t)
    if return_hidden:
        return logits, new_cache, hidden
    return logits, new_cache


def lm_head_kernel(params: Params, config: ModelConfig) -> jax.Array:
    """[D, V] float32 output projection (the embedding table's transpose when tied), what
    `apply` multiplies the `return_hidden` states with; for chunked-vocab log-probs."""
    if config.tie_embeddings:
        return params["embed"]["embedding"].astype(jnp.float32).T
    return params["lm_head"]["kernel"].astype(jnp.float32)


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (normal(0.02) weights, unit norms, zero biases) as a nested dict."""
    return _init_fn(config)(key)


@functools.cache
def _init_fn(config: ModelConfig):
    def init(key):
        tokens = jnp.zeros((1, 1), jnp.int32)
        mask = jnp.ones((1, 1, 1), bool)
        variables = Decoder(config).init(key, tokens, tokens, mask, None, None, None, True)
        return variables["params"]

    return jax.jit(init)


def abstract_params(config: ModelConfig) -> Params:
    """Shapes and dtypes of `init_params` (jax.ShapeDtypeStruct leaves), without allocating."""
    return jax.eval_shape(_init_fn(config), jax.random.key(0))


# ---------------------------------------------------------------------------------------------
# Decode path: the same layer math, unrolled over per-layer weights laid out for it.


class DecodeParams(NamedTuple):
    """`apply`'s params laid out for decode steps: one weight tree per layer.

    Inside `apply`'s `nn.scan` each layer's weights are a dynamic slice of the stacked
    [L, ...] arrays, and XLA's CPU backend materialises that slice before the matmuls read
    it: a decode step wrote a copy of every layer's weights and read them twice. Made once
    per weight update (`decode_params`), each layer's matmuls read their own arrays in place,
    and q/k/v and gate/up are one matrix each (fewer, longer reads).

    Each entry of `layers` holds: `input_norm` [D], `qkv` [D, (H + 2N)·K] (q, k, v kernels
    side by side, heads flattened), `qkv_bias` [(H + 2N)·K] (Qwen2 only), `q_norm` and
    `k_norm` [K] (Qwen3 only), `o` [H, K, D], `post_attn_norm` [D], `gate_up` [D, 2F] and
    `down` [F, D], in the parameter dtype.
    """

    embed: jax.Array  # [V, D] embedding table; also the tied lm_head (shared, not copied).
    layers: tuple[dict[str, jax.Array], ...]  # L per-layer trees (see above).
    final_norm: jax.Array  # [D] final RMSNorm scale.
    lm_head: jax.Array | None  # [D, V] untied output kernel; None when tied.


@jax.jit
def _decode_layers(stacked: Params) -> tuple[dict[str, jax.Array], ...]:
    """params["layers"] ([L, ...] leaves) -> L trees of `DecodeParams.layers`."""
    n_layers = stacked["input_norm"]["scale"].shape[0]

    def layer(i: int) -> dict[str, jax.Array]:
        w = jax.tree.map(lambda x: x[i], stacked)
        attn, mlp = w["attn"], w["mlp"]
        d = attn["q_proj"]["kernel"].shape[0]
        qkv = [attn[f"{x}_proj"]["kernel"].reshape(d, -1) for x in "qkv"]  # [D, heads·K]
        out = {
            "input_norm": w["input_norm"]["scale"],
            "qkv": jnp.concatenate(qkv, axis=-1),
            "o": attn["o_proj"]["kernel"],
            "post_attn_norm": w["post_attn_norm"]["scale"],
            "gate_up": jnp.concatenate([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]], -1),
            "down": mlp["down_proj"]["kernel"],
        }
        if "bias" in attn["q_proj"]:
            out["qkv_bias"] = jnp.concatenate([attn[f"{x}_proj"]["bias"].ravel() for x in "qkv"])
        if "q_norm" in attn:
            out["q_norm"], out["k_norm"] = attn["q_norm"]["scale"], attn["k_norm"]["scale"]
        return out

    return tuple(layer(i) for i in range(n_layers))


def decode_params(params: Params, config: ModelConfig) -> DecodeParams:
    """`params` as `apply_decode` takes them: the layer weights copied once into L per-layer
    trees (one more copy of the layers in memory); embedding, final norm and lm_head are
    shared with `params`. Run it once per weight update, not per step."""
    chex.assert_shape(params["embed"]["embedding"], (config.vocab_size, config.d_model))
    return DecodeParams(
        embed=params["embed"]["embedding"],
        layers=_decode_layers(params["layers"]),
        final_norm=params["final_norm"]["scale"],
        lm_head=None if config.tie_embeddings else params["lm_head"]["kernel"],
    )


def _decode_layer(
    w: dict[str, jax.Array],
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    write_pos: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    layer: int,
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`DecoderLayer` with a cache, on one `DecodeParams.layers` tree: x [B,T,D] ->
    (x, cache_k, cache_v), the caches [L,B,S,N,K] written at `layer`."""
    c = config
    cdt = jnp.dtype(c.compute_dtype)
    b, t, _ = x.shape
    h, n, k, f = c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
    mm = lambda eq, a, kernel: jnp.einsum(eq, a.astype(cdt), kernel.astype(cdt))  # Projection

    qkv = mm("btd,de->bte", rms_norm(x, w["input_norm"], c.rms_eps), w["qkv"])
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"].astype(cdt)
    q = qkv[..., : h * k].reshape(b, t, h, k)
    key = qkv[..., h * k : (h + n) * k].reshape(b, t, n, k)
    value = qkv[..., (h + n) * k :].reshape(b, t, n, k)
    if "q_norm" in w:
        q = rms_norm(q, w["q_norm"], c.rms_eps)
        key = rms_norm(key, w["k_norm"], c.rms_eps)
    inv_freq = rope_inverse_frequencies(c)
    q = apply_rope(q, positions, inv_freq)
    key = apply_rope(key, positions, inv_freq)
    cache_k = _write_slots(cache_k, layer, key, write_pos)
    cache_v = _write_slots(cache_v, layer, value, write_pos)
    w_len = mask.shape[-1]  # the attention window: the first W cache slots
    out = _attend(
        q,
        cache_k[layer, :, :w_len].astype(cdt),
        cache_v[layer, :, :w_len].astype(cdt),
        mask,
        c,
    )
    x = x + mm("bthk,hkd->btd", out, w["o"])

    gate_up = mm("btd,df->btf", rms_norm(x, w["post_attn_norm"], c.rms_eps), w["gate_up"])
    gate, up = gate_up[..., :f], gate_up[..., f:]
    x = x + mm("btf,fd->btd", nn.silu(gate) * up, w["down"])
    return x, cache_k, cache_v


def apply_decode(
    params: DecodeParams,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    kv_cache: KVCache,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """`apply` with a KV cache, its layers unrolled over `decode_params` weights.

    The same math as `apply` (shared norm, rotary, cache-write and attention functions, and
    matmuls in the compute dtype, final norm and lm_head in float32); only the layout
    differs: per-layer weights read in place, q/k/v and gate/up fused into one matmul each,
    and the tied lm_head contracting the [V, D] table over D instead of multiplying by its
    transpose. Logits agree with `apply`'s up to float rounding. The cache is written in
    place at `lengths[b] + t`, as in `apply`. Unrolling makes compile time grow with depth;
    the decode step compiles once per engine.

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
    Returns:
      (logits [B, T, V] float32, new KVCache).
    """
    c = config
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    b, t = tokens.shape
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (b, t))
    if len(params.layers) != c.n_layers:
        raise ValueError(f"DecodeParams has {len(params.layers)} layers, config {c.n_layers}")
    write_pos, mask = _cache_write_pos_and_mask(kv_cache, c, b, t, None)
    capacity = kv_cache.k.shape[2]
    if window is not None:
        if not 0 < window <= capacity:
            raise ValueError(f"window must be in (0, capacity={capacity}], got {window}")
        mask = mask[:, :, :window]
    positions = positions.astype(jnp.int32)

    # nn.Embed's lookup (rows by token id, in the compute dtype); rows cast after the take.
    x = jnp.take(params.embed, tokens.astype(jnp.int32), axis=0).astype(c.compute_dtype)
    cache_k, cache_v = kv_cache.k, kv_cache.v
    for i, w in enumerate(params.layers):
        x, cache_k, cache_v = _decode_layer(
            w, x, positions, mask, write_pos, cache_k, cache_v, i, c
        )

    # Final norm and lm_head in float32, as in `apply`.
    hidden = rms_norm(x.astype(jnp.float32), params.final_norm, c.rms_eps)
    if params.lm_head is None:  # tied: contract the [V, D] table over D, no transpose
        logits = jnp.einsum("btd,vd->btv", hidden, params.embed.astype(jnp.float32))
    else:
        logits = jnp.einsum("btd,dv->btv", hidden, params.lm_head.astype(jnp.float32))
    return logits, _advanced_cache(kv_cache, cache_k, cache_v, segment_ids, b, t)


# ---------------------------------------------------------------------------------------------
# Logical axes: the only sharding knowledge the model has.

# Parameter path -> logical axis of each dimension. `sharding.py` maps names to mesh axes.
PARAM_LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed/embedding": ("vocab", "embed"),
    "layers/input_norm/scale": ("layers", "norm"),
    "layers/attn/q_proj/kernel": ("layers", "embed", "heads", "head_dim"),
    "layers/attn/q_proj/bias": ("layers", "heads", "head_dim"),
    "layers/attn/k_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/k_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/v_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/v_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/o_proj/kernel": ("layers", "heads", "head_dim", "embed"),
    "layers/attn/q_norm/scale": ("layers", "head_dim"),
    "layers/attn/k_norm/scale": ("layers", "head_dim"),
    "layers/post_attn_norm/scale": ("layers", "norm"),
    "layers/mlp/gate_proj/kernel": ("layers", "embed", "mlp"),
    "layers/mlp/up_proj/kernel": ("layers", "embed", "mlp"),
    "layers/mlp/down_proj/kernel": ("layers", "mlp", "embed"),
    "final_norm/scale": ("norm",),
    "lm_head/kernel": ("embed", "vocab"),
}

# KV cache and activations: [L, B, S, N, K] and [B, T].
KV_CACHE_LOGICAL_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
TOKENS_LOGICAL_AXES = ("batch", "length")


def tree_path_str(path) -> str:
    """'a/b/c' for a jax tree path of dict keys, attributes or indices."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


def logical_axes(params: Params) -> Params:
    """The logical axis names of every leaf of `params` (or of its shapes).

    A path that ends with a known parameter path (so the same tree nested inside an optimizer
    state also resolves) gets that entry; anything else is an error naming the path.
    """

    def axes_of(path, leaf):
        name = tree_path_str(path)
        match = next(
            (
                axes
                for known, axes in PARAM_LOGICAL_AXES.items()
                if name == known or name.endswith("/" + known)
            ),
            None,
        )
        if match is None:
            raise ValueError(f"parameter {name!r} has no logical axes in model.PARAM_LOGICAL_AXES")
        if len(match) != len(np.shape(leaf)):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(np.shape(leaf))} but logical axes {match}"
            )
        return match

    return jax.tree_util.tree_map_with_path(axes_of, params)


# ---------------------------------------------------------------------------------------------
# Reference greedy decoding (what the inference engine must reproduce).


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "capacity"))
def greedy_generate(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    max_new_tokens: int,
    capacity: int | None = None,
) -> jax.Array:
    """Greedy continuation of right-padded prompts with the KV cache.

    Prefill writes the whole padded prompt bucket; padding slots are overwritten by the
    first generated tokens because each row's cache length counts valid tokens only.

    Args:
      params: model parameters.
      config: the architecture.
      prompt_tokens: [B, P] int32, right-padded.
      prompt_lengths: [B] int32 valid prompt tokens per row (>= 1).
      max_new_tokens: tokens to generate per row (no early stop at EOS).
      capacity: cache slots per row; default P + max_new_tokens.
    Returns:
      [B, max_new_tokens] int32 generated tokens.
    """
    b, p = prompt_tokens.shape
    chex.assert_shape(prompt_lengths, (b,))
    capacity = capacity or p + max_new_tokens
    cache = init_kv_cache(config, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    segment_ids = (positions < prompt_lengths[:, None]).astype(jnp.int32)
    logits, cache = apply(
        params, prompt_tokens, positions, config=config, segment_ids=segment_ids, kv_cache=cache
    )
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)  # [B]

    def step(carry, _):
        token, cache = carry
        pos = cache.lengths[:, None]  # [B, 1]: the new token sits right after the valid ones
        logits, cache = apply(params, token[:, None], pos, config=config, kv_cache=cache)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (nxt, cache), token

    _, tokens = jax.lax.scan(step, (first, cache), None, length=max_new_tokens)
    return tokens.T  # [B, max_new_tokens]
