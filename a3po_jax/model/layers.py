"""The decoder's building blocks: RMSNorm, rotary embeddings, the projections, one decoder
layer, attention masks and the KV cache.

Model layer (pure core). Functions of arrays and a `ModelConfig`; `decoder.py` assembles them
into the whole model.

Shapes: B batch, T new tokens, S key slots (T without a cache, the cache capacity with one),
L layers, V vocab, D d_model, F ffn_dim, H query heads, N kv heads, G = H / N query heads per
kv head, K head_dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.model import attention
from a3po_jax.model.config import ModelConfig, Params

# ---------------------------------------------------------------------------------------------
# The KV cache


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
# The layer: the only place its maths is written.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last axis ([..., D] -> [..., D] in x's dtype), statistics
    in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    # transformers casts back to the input dtype before scaling; doing the same keeps
    # bfloat16 runs close to it.
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def linear(equation: str, x: jax.Array, w: Params, dtype: Any) -> jax.Array:
    """An HF `nn.Linear` on {"kernel", optional "bias"}: einsum "input,kernel->output" in
    `dtype`, plus the bias.

    `equation` names the layout, e.g. "btd,dhk->bthk": x's trailing letters are the
    kernel's leading ones (contracted), the output is x's other letters then the kernel's.
    It is computed as one 2-D matmul, tokens [B·T, I] times kernel [I, O] (reshapes of
    row-major arrays, no copies), not as a 3-D einsum: for the einsum's gradient XLA:CPU
    materialises the cotangent transposed ([F, B, T]) before the weight-gradient dot, a slow
    strided copy of each activation (docs/performance.md).
    """
    lhs, rest = equation.split(",")
    rhs, out = rest.split("->")
    n_in = len(set(lhs) & set(rhs))
    if lhs[len(lhs) - n_in :] != rhs[:n_in] or out != lhs[: len(lhs) - n_in] + rhs[n_in:]:
        raise ValueError(f"linear needs 'x..., i..., -> x... o...' einsums, got {equation!r}")
    lead, contracted = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :]
    n_inputs = int(np.prod(contracted))
    x2 = x.reshape(-1, n_inputs).astype(dtype)
    kernel = w["kernel"]
    y = jnp.dot(x2, kernel.reshape(n_inputs, -1).astype(dtype)).reshape(*lead, *kernel.shape[n_in:])
    if "bias" in w:
        y = y + w["bias"].astype(dtype)
    return y


def embed_tokens(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """[B, T] ids -> [B, T, D] rows of the [V, D] table, in `dtype` (nn.Embed's lookup)."""
    return jnp.take(table, tokens.astype(jnp.int32), axis=0).astype(dtype)


class WeightReader(Protocol):
    """How `decoder_layer` multiplies by one layer's weight matrices.

    The layer's maths is fixed; the layout of its weights is this reader's business. Each
    method takes the layer's weight subtree (`w["attn"]` or `w["mlp"]`), activations in the
    compute dtype and the config. An implementation is a hashable value (a frozen
    dataclass), so a jitted caller can hold it as static. `TRAINING_WEIGHTS` reads the
    layout of `decoder.init_params` and the checkpoint loaders; an inference engine may lay
    its copy out otherwise and pass its own reader.
    """

    def qkv(
        self, attn: Params, x: jax.Array, config: ModelConfig
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, H, K], k and v [B, T, N, K]."""
        ...

    def o(self, attn: Params, out: jax.Array, config: ModelConfig) -> jax.Array:
        """Attention output [B, T, H, K] -> [B, T, D]."""
        ...

    def gate_up(
        self, mlp: Params, x: jax.Array, config: ModelConfig
    ) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> gate, up [B, T, F]."""
        ...

    def down(self, mlp: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
        """h [B, T, F] -> [B, T, D]."""
        ...


@dataclasses.dataclass(frozen=True)
class ModuleWeights:
    """The training layout: one HF `nn.Linear` per projection, {"kernel", optional "bias"}
    with heads kept as their own axes (q_proj [D, H, K], o_proj [H, K, D], gate_proj
    [D, F], ...), named as in `decoder.init_params`."""

    def qkv(self, attn, x, config):
        cdt = jnp.dtype(config.compute_dtype)
        return (
            linear("btd,dhk->bthk", x, attn["q_proj"], cdt),
            linear("btd,dnk->btnk", x, attn["k_proj"], cdt),
            linear("btd,dnk->btnk", x, attn["v_proj"], cdt),
        )

    def o(self, attn, out, config):
        return linear("bthk,hkd->btd", out, attn["o_proj"], jnp.dtype(config.compute_dtype))

    def gate_up(self, mlp, x, config):
        cdt = jnp.dtype(config.compute_dtype)
        return (
            linear("btd,df->btf", x, mlp["gate_proj"], cdt),
            linear("btd,df->btf", x, mlp["up_proj"], cdt),
        )

    def down(self, mlp, h, config):
        return linear("btf,fd->btd", h, mlp["down_proj"], jnp.dtype(config.compute_dtype))


TRAINING_WEIGHTS = ModuleWeights()


def _write_slots(
    cache: jax.Array, layer: jax.Array | int, new: jax.Array, write_pos: jax.Array
) -> jax.Array:
    """cache[layer, b, write_pos[b, t]] = new[b, t]; slots past the capacity are dropped.

    cache [L, B, S, N, K], layer a scalar, new [B, T, N, K], write_pos [B, T]. The whole
    cache is carried from layer to layer (the scan carry, or a loop over the layers), so this
    scatter updates it in place: only the T new tokens are written per step, never a copy of
    the cache. A scatter rather than `dynamic_update_slice`, which would clamp an
    overflowing start and shift the write.
    """
    rows = jnp.arange(cache.shape[1])[:, None]  # [B, 1]
    return cache.at[layer, rows, write_pos].set(new.astype(cache.dtype), mode="drop")


class LayerCache(NamedTuple):
    """What one layer needs of the KV cache: the whole cache, its layer and the write slots."""

    k: jax.Array  # [L, B, C, N, K] (C the capacity)
    v: jax.Array  # [L, B, C, N, K]
    layer: jax.Array | int  # which of the L layers this is
    write_pos: jax.Array  # [B, T] int32 slots the T new keys/values go to


def decoder_layer(
    w: Params,
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    *,
    config: ModelConfig,
    cache: LayerCache | None = None,
    weights: WeightReader = TRAINING_WEIGHTS,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One decoder block, x + attn(norm(x)) then x + mlp(norm(x)).

    The only copy of the layer maths: `decoder.apply` scans it over the stacked layers, and
    an inference engine runs it over its own copy of the weights. q/k norm (Qwen3) follows
    the config; the weight matrices are read by `weights`.

    Args:
      w: one layer's weights: params["layers"] with the leading L axis indexed away, or one
        layer of another layout that `weights` reads.
      x: [B, T, D] residual stream in the compute dtype.
      positions: [B, T] int32 RoPE positions.
      mask: [B, T, S] bool, query t may attend key s. Without a cache S = T (the new keys);
        with one, the first S cache slots (a window of the capacity C).
      config: the architecture.
      cache: None, or the cache to write this layer's new keys/values into before
        attending.
      weights: how the projections read `w` (static; default the training layout).
    Returns:
      (x [B, T, D], the written (cache_k, cache_v) or None).
    """
    c = config
    chex.assert_shape(x, (None, None, c.d_model))
    chex.assert_shape(positions, x.shape[:2])
    chex.assert_shape(mask, (*x.shape[:2], None))
    cdt = jnp.dtype(c.compute_dtype)
    attn, mlp = w["attn"], w["mlp"]
    q, key, value = weights.qkv(attn, rms_norm(x, w["input_norm"]["scale"], c.rms_eps), c)
    if c.qk_norm:
        q = rms_norm(q, attn["q_norm"]["scale"], c.rms_eps)
        key = rms_norm(key, attn["k_norm"]["scale"], c.rms_eps)
    inv_freq = rope_inverse_frequencies(c)
    q = apply_rope(q, positions, inv_freq)
    key = apply_rope(key, positions, inv_freq)

    written = None
    if cache is not None:
        cache_k = _write_slots(cache.k, cache.layer, key, cache.write_pos)
        cache_v = _write_slots(cache.v, cache.layer, value, cache.write_pos)
        window = mask.shape[-1]  # attention reads the first S slots only
        key = cache_k[cache.layer, :, :window].astype(cdt)  # [B, S, N, K]
        value = cache_v[cache.layer, :, :window].astype(cdt)
        written = (cache_k, cache_v)

    out = attention.attend(q, key, value, mask)  # [B, T, H, K]
    x = x + weights.o(attn, out, c)
    gate, up = weights.gate_up(mlp, rms_norm(x, w["post_attn_norm"]["scale"], c.rms_eps), c)
    x = x + weights.down(mlp, jax.nn.silu(gate) * up, c)
    return x, written


# ---------------------------------------------------------------------------------------------
# Attention masks and cache bookkeeping


def causal_segment_mask(t: int, segment_ids: jax.Array | None, batch: int) -> jax.Array:
    """[B, T, T] bool: query t attends key s <= t of the same non-zero segment."""
    idx = jnp.arange(t)
    causal = idx[:, None] >= idx[None, :]  # [T, T]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, t, t))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    key_valid = (segment_ids != 0)[:, None, :]
    return causal[None] & same & key_valid


def cache_write_pos_and_mask(
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


def advance_cache(
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
