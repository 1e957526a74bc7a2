"""Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM2) as pure functions of a params dict.

Model layer (pure core). Everything jitted elsewhere (losses, the train step, the inference
engine) sees the model as

    apply(params, tokens, positions, *, config, ...) -> (logits, kv_cache)
    hidden_states(params, tokens, positions, *, config, ...) -> (hidden, kv_cache)

over a plain nested-dict params pytree. The architecture is exactly Hugging Face's
`LlamaForCausalLM` (RMSNorm, rotary embeddings with the checkpoint's θ, grouped-query
attention, SwiGLU MLP, tied or untied embeddings) with Qwen2's q/k/v bias and Qwen3's q/k
RMSNorm as switches.

The layer maths is written once, in `decoder_layer`. `apply` runs it as one `jax.lax.scan`
over stacked parameters (leading axis L), so compile time does not grow with depth. Decode
steps use `apply_decode` instead: the same `decoder_layer` unrolled over per-layer weights
(`decode_params`, split once per weight update), because XLA:CPU copies each scanned
layer's weight slice before the matmuls read it, so a memory-bound decode step moved the
layer weights three times (read, write, read) instead of once. `hidden_states` also runs
over that split (a loop over its layers), so an inference engine prefills from the copy it
decodes from and holds no other. Flax only draws the initial weights (`init_params`).
The model names logical axes only (`logical_axes`); `parallel/sharding.py` maps them to
mesh axes.

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

from a3po_jax.model import attention

Params = dict[str, Any]

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "llama3")


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
# The layer: the only place its maths is written.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale over the last axis ([..., D] -> [..., D] in x's dtype), statistics
    in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    # transformers casts back to the input dtype before scaling; doing the same keeps
    # bfloat16 runs close to it.
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def _linear(equation: str, x: jax.Array, w: Params, dtype: Any) -> jax.Array:
    """An HF `nn.Linear` on {"kernel", optional "bias"}: einsum "input,kernel->output" in
    `dtype`, plus the bias.

    `equation` names the layout, e.g. "btd,dhk->bthk": x's trailing letters are the
    kernel's leading ones (contracted), the output is x's other letters then the kernel's.
    It is computed as one 2-D matmul, tokens [B·T, I] times kernel [I, O] (reshapes of
    row-major arrays, no copies), not as a 3-D einsum: for the einsum's gradient XLA:CPU
    materialised the cotangent transposed ([F, B, T]) before the weight-gradient dot, a
    slow strided copy of each activation. At SmolLM2 shapes (tokens 8x128, D=576,
    F=1536) the grad of a gate/down MLP pair took 122 ms as einsums and 41 ms as 2-D
    matmuls (one process, min of 7).
    """
    lhs, rest = equation.split(",")
    rhs, out = rest.split("->")
    n_in = len(set(lhs) & set(rhs))
    if lhs[len(lhs) - n_in :] != rhs[:n_in] or out != lhs[: len(lhs) - n_in] + rhs[n_in:]:
        raise ValueError(f"_linear needs 'x..., i..., -> x... o...' einsums, got {equation!r}")
    lead, contracted = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :]
    n_inputs = int(np.prod(contracted))
    x2 = x.reshape(-1, n_inputs).astype(dtype)
    if "kernel_t" in w:  # `decode_params` layout: [O, I], one output axis
        if len(out) != len(lhs) - n_in + 1:
            raise ValueError(f"an out-major kernel has one output axis, got {equation!r}")
        kernel_t = w["kernel_t"].astype(dtype)
        if x2.shape[0] > OUT_MAJOR_GEMM_MAX_ROWS:  # a prefill's many rows: x @ kernel_tᵀ
            y = jax.lax.dot_general(x2, kernel_t, (((1,), (1,)), ((), ())))
        else:
            y = out_major_dot(x2, kernel_t)
        y = y.reshape(*lead, kernel_t.shape[0])
    else:
        kernel = w["kernel"]
        y = jnp.dot(x2, kernel.reshape(n_inputs, -1).astype(dtype)).reshape(
            *lead, *kernel.shape[n_in:]
        )
    if "bias" in w:
        y = y + w["bias"].astype(dtype)
    return y


# Rows above which `_linear` multiplies an out-major kernel as x [M, I] x kernel_tᵀ (one GEMM
# with a transposed right operand) instead of `out_major_dot`. 30 SmolLM2 layers' matrices
# alone on the 2-core AMD EPYC (min of 21, 2026-11-26), out_major_dot vs x @ kernel_tᵀ: 32
# rows 43 vs 69 ms, 128 rows 170 vs 198, 256 rows 337 vs 339, 1024 rows 1308 vs 1252-1257
# (the in-major x @ kernel 1224-1264). In whole layers the transpose back costs more: the
# cache recompute of 8 slots x 64 tokens (512 rows) over the split took 730 ms this way and
# 656 ms as x @ kernel_tᵀ, against 642-647 ms over the stacked in-major weights.
OUT_MAJOR_GEMM_MAX_ROWS = 256


def out_major_dot(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """x [M, I] times the transpose of an out-major kernel [O, I]: [M, O].

    Computed as kernel_t [O, I] x xᵀ [I, M] (the weight is the GEMM's left operand), then
    transposed back. With few rows (decode steps: M = batch) XLA:CPU's GEMM reads a weight
    streamed from memory faster as the left operand: on the 2-core AMD EPYC, 30 layers of
    [32, 576] x [576, 3072] took 20.6 ms this way and 28.5 ms as x @ W (min of 10; 165 vs
    119 GFLOP/s), and the tied lm_head's [32, 576] x [576, 49152] 16.5 vs 17.5 ms. The
    barrier keeps XLA's algebraic simplifier from folding the transpose back into the
    product (it rewrites transpose(dot(A, B)) as dot(Bᵀ, Aᵀ), the slow form); the transpose
    itself copies only the [O, M] result. Values are the same products, summed in another
    order: equal to x @ kernel_t.T up to float rounding.
    """
    return out_major_product(x, kernel_t).T


def out_major_product(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """`out_major_dot` without the transpose back: kernel_t [O, I] x xᵀ [I, M] -> [O, M],
    behind an optimization barrier (see `out_major_dot`)."""
    return jax.lax.optimization_barrier(jnp.dot(kernel_t, x.T))


def _embed(table: jax.Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """[B, T] ids -> [B, T, D] rows of the [V, D] table, in `dtype` (nn.Embed's lookup)."""
    return jnp.take(table, tokens.astype(jnp.int32), axis=0).astype(dtype)


def _project_qkv(
    attn: Params, x: jax.Array, config: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B,T,D] -> q [B,T,H,K], k and v [B,T,N,K], from either weight layout."""
    cdt = jnp.dtype(config.compute_dtype)
    if "qkv" not in attn:  # `init_params` layout: three matmuls
        return (
            _linear("btd,dhk->bthk", x, attn["q_proj"], cdt),
            _linear("btd,dnk->btnk", x, attn["k_proj"], cdt),
            _linear("btd,dnk->btnk", x, attn["v_proj"], cdt),
        )
    # `decode_params` layout: the three kernels side by side, one longer matmul.
    b, t, _ = x.shape
    h, n, k = config.n_heads, config.n_kv_heads, config.head_dim
    qkv = _linear("btd,de->bte", x, attn["qkv"], cdt)  # [B, T, (H + 2N)·K]
    return (
        qkv[..., : h * k].reshape(b, t, h, k),
        qkv[..., h * k : (h + n) * k].reshape(b, t, n, k),
        qkv[..., (h + n) * k :].reshape(b, t, n, k),
    )


def _project_gate_up(mlp: Params, x: jax.Array, config: ModelConfig) -> tuple[jax.Array, ...]:
    """x [B,T,D] -> gate, up [B,T,F], from either weight layout."""
    cdt = jnp.dtype(config.compute_dtype)
    if "gate_up" not in mlp:
        return (
            _linear("btd,df->btf", x, mlp["gate_proj"], cdt),
            _linear("btd,df->btf", x, mlp["up_proj"], cdt),
        )
    gate_up = _linear("btd,df->btf", x, mlp["gate_up"], cdt)  # [B, T, 2F]
    return gate_up[..., : config.ffn_dim], gate_up[..., config.ffn_dim :]


def _write_slots(
    cache: jax.Array, layer: jax.Array | int, new: jax.Array, write_pos: jax.Array
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
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One decoder block, x + attn(norm(x)) then x + mlp(norm(x)).

    The only copy of the layer maths: `apply` scans it over the stacked layers and
    `apply_decode` loops it over per-layer weights. q/k norm (Qwen3) follows the config;
    the weight layout (separate or fused q/k/v and gate/up kernels) is read from `w`'s keys
    at trace time.

    Args:
      w: one layer's weights: params["layers"] with the leading L axis indexed away, or an
        entry of `DecodeParams.layers`.
      x: [B, T, D] residual stream in the compute dtype.
      positions: [B, T] int32 RoPE positions.
      mask: [B, T, S] bool, query t may attend key s. Without a cache S = T (the new keys);
        with one, the first S cache slots (a window of the capacity C).
      config: the architecture.
      cache: None, or the cache to write this layer's new keys/values into before
        attending.
    Returns:
      (x [B, T, D], the written (cache_k, cache_v) or None).
    """
    c = config
    chex.assert_shape(x, (None, None, c.d_model))
    chex.assert_shape(positions, x.shape[:2])
    chex.assert_shape(mask, (*x.shape[:2], None))
    cdt = jnp.dtype(c.compute_dtype)
    attn = w["attn"]
    q, key, value = _project_qkv(attn, rms_norm(x, w["input_norm"]["scale"], c.rms_eps), c)
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
    x = x + _linear("bthk,hkd->btd", out, attn["o_proj"], cdt)
    gate, up = _project_gate_up(w["mlp"], rms_norm(x, w["post_attn_norm"]["scale"], c.rms_eps), c)
    x = x + _linear("btf,fd->btd", jax.nn.silu(gate) * up, w["mlp"]["down_proj"], cdt)
    return x, written


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
            mask = _causal_segment_mask(t, segment_ids, b)
        write_pos, kv = None, None
    else:
        write_pos, mask = _cache_write_pos_and_mask(kv_cache, c, b, t, attention_mask)
        kv = (kv_cache.k, kv_cache.v)
    positions = positions.astype(jnp.int32)

    x = _embed(embedding, tokens, jnp.dtype(c.compute_dtype))  # [B, T, D]
    if split:
        x, kv = _loop_split_layers(params.layers, x, kv, positions, mask, write_pos, c)
    else:
        x, kv = _scan_stacked_layers(params["layers"], x, kv, positions, mask, write_pos, c)

    # Final norm (and lm_head) in float32: log-probs feed importance ratios exp(a - b),
    # where bfloat16 rounding of logits would show up directly.
    hidden = rms_norm(x.astype(jnp.float32), final_scale, c.rms_eps)
    new_cache = None if kv_cache is None else _advanced_cache(kv_cache, *kv, segment_ids, b, t)
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
    write_pos, mask = _cache_write_pos_and_mask(kv_cache, c, b, t, None)
    capacity = kv_cache.k.shape[2]
    if window is not None:
        if not 0 < window <= capacity:
            raise ValueError(f"window must be in (0, capacity={capacity}], got {window}")
        mask = mask[:, :, :window]
    positions = positions.astype(jnp.int32)

    x = _embed(params.embed, tokens, jnp.dtype(c.compute_dtype))
    cache_k, cache_v = kv_cache.k, kv_cache.v
    for i, w in enumerate(params.layers):
        cache = LayerCache(cache_k, cache_v, i, write_pos)
        x, (cache_k, cache_v) = decoder_layer(w, x, positions, mask, config=c, cache=cache)

    # Final norm and lm_head in float32, as in `apply`.
    hidden = rms_norm(x.astype(jnp.float32), params.final_norm, c.rms_eps).reshape(b * t, -1)
    logits_t = _decode_logits_t(params, hidden)  # [V, B·T]
    logits = logits_t if vocab_major else logits_t.T.reshape(b, t, -1)
    return logits, _advanced_cache(kv_cache, cache_k, cache_v, segment_ids, b, t)


def _decode_logits_t(params: DecodeParams, hidden: jax.Array) -> jax.Array:
    """[M, D] float32 hidden -> [V, M] float32 logits: a tied head multiplies with the [V, D]
    table as the left operand (`out_major_product`), an untied one as `apply` does."""
    if params.lm_head is None:  # tied: the [V, D] table is already out-major
        return out_major_product(hidden, params.embed.astype(jnp.float32))
    return jnp.dot(hidden, params.lm_head.astype(jnp.float32)).T


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


def _path_names(path) -> list[str]:
    """The key of each entry of a jax tree path (dict key, attribute or index) as a str."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return names


def tree_path_str(path) -> str:
    """'a/b/c' for a jax tree path of dict keys, attributes or indices."""
    return "/".join(_path_names(path))


def flatten_params(params: Any) -> dict[str, Any]:
    """`{"layers/attn/q_proj/kernel": leaf, ...}`: every leaf under its "/"-joined path, in
    tree order. The one weight naming of the package (logical axes, weight pushes).

    Raises ValueError if a key itself contains "/" or two leaves get the same name.
    """
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _path_names(path)
        bad = next((n for n in names if "/" in n), None)
        if bad is not None:
            raise ValueError(f"parameter key {bad!r} contains '/'; cannot flatten it")
        name = "/".join(names)
        if name in out:
            raise ValueError(f"two parameters flatten to the same name {name!r}")
        out[name] = leaf
    return out


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
