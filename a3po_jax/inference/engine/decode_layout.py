"""The inference engine's copy of the weights: one tree per layer, fused and out-major.

Inference layer (engine; the functions are pure JAX). The model (`a3po_jax.model`)
knows one weight layout, the stacked one it trains; this module lays the same weights out for
serving and runs the model's own pieces over them:

    decode_params(params, config, *, out_major=True, shards=1) -> DecodeParams
    apply_decode(dparams, tokens, positions, *, config, kv_cache, ...) -> (logits, kv_cache)
    hidden_states(dparams, tokens, positions, *, config, ...) -> (hidden, kv_cache)
    lm_head_logits(dparams, hidden) -> logits
    decode_shardings(dparams, mesh, rules=INFERENCE_RULES) -> DecodeParams of NamedShardings

Why another layout: inside `model.apply`'s scan each layer's weights are a dynamic slice of
the stacked [L, ...] arrays, and XLA:CPU materialises that slice before the matmuls read it,
so a memory-bound decode step moved the layer weights three times (read, write, read)
instead of once. Split once per weight update, each layer's matmuls read their own arrays in
place; q/k/v and gate/up are one matrix each (fewer, longer reads), and the matrices are
stored out-major so a decode step's few rows multiply with the weight as the left operand
(`out_major_dot`). Prefill and the in-flight cache recompute run over the same split
(`hidden_states`), so an engine holds one copy of the weights. Every layer is still
`model.decoder_layer`; `FusedWeights` is the `model.layers.WeightReader` that reads this
layout.

`shards` orders the fused matrices for tensor parallelism: split along their output
dimension into `shards` equal pieces, each piece holds whole heads and whole MLP columns, so
each device of a `tensor` mesh axis of that size computes its own heads and the reshape back
to q/k/v and gate/up needs no communication (`decode_shardings` places them).

Shapes: B batch, T new tokens, L layers, V vocab, D d_model, F ffn_dim, H query heads, N kv
heads, K head_dim, S shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from a3po_jax import model as model_lib
from a3po_jax.model import KVCache, LayerCache, ModelConfig, Params
from a3po_jax.model.layers import linear
from a3po_jax.parallel import sharding

# ---------------------------------------------------------------------------------------------
# The layout


@struct.dataclass
class DecodeParams:
    """`model.apply`'s params laid out for inference: one weight tree per layer.

    Each entry of `layers` is a `model.decoder_layer` weight tree with params["layers"]'s
    names, except:

    * `attn/qkv`: q, k and v in one matrix. Out-major, `kernel_t` [(H + 2N)·K, D] (the
      transpose of `apply`'s kernels); `bias` [(H + 2N)·K] for Qwen2. Rows in shard order:
      for s = 0..S-1, the q heads of shard s, then its k heads, then its v heads (shard s
      holds q heads s·H/S .. (s+1)·H/S - 1 and kv heads s·N/S .. (s+1)·N/S - 1, each head's K
      rows together). With S = 1: all q, all k, all v.
    * `mlp/gate_up`: gate and up in one matrix, `kernel_t` [2F, D]: for each shard s, its
      F/S gate columns then its F/S up columns.
    * `attn/o_proj` and `mlp/down_proj`: `kernel_t` [D, H·K] and [D, F], in the natural head
      and column order (shard s's inputs are its own slice of dimension 1).

    With `out_major=False` the fused matrices are `kernel` [D, (H + 2N)·K] and [D, 2F] (the
    same columns, not transposed) and o_proj / down_proj stay as `apply` has them. All in
    the parameter dtype. `shards` and `out_major` are static (part of the tree structure,
    not leaves): a jitted function compiles once per layout.
    """

    embed: jax.Array  # [V, D] embedding table; also the tied lm_head (shared, not copied).
    layers: tuple[Params, ...]  # L per-layer trees (see above).
    final_norm: jax.Array  # [D] final RMSNorm scale.
    lm_head: jax.Array | None  # [D, V] untied output kernel; None when tied.
    shards: int = struct.field(pytree_node=False, default=1)  # S: tensor-parallel pieces.
    out_major: bool = struct.field(pytree_node=False, default=True)  # `kernel_t` [O, I].

    @property
    def reader(self) -> FusedWeights:
        """The `model.layers.WeightReader` of this layout."""
        return FusedWeights(shards=self.shards, out_major=self.out_major)


def _check_shards(config: ModelConfig, shards: int) -> None:
    """ValueError unless every shard gets whole q heads, kv heads and MLP columns."""
    if not isinstance(shards, int | np.integer) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        value = getattr(config, name)
        if value % shards:
            raise ValueError(
                f"shards={shards} does not divide ModelConfig.{name}={value}: every shard "
                "must hold whole heads and whole MLP columns"
            )


def _shard_major(parts: list[jax.Array], shards: int) -> jax.Array:
    """[..., O_j] side by side along the last axis, shard by shard: for s = 0..S-1, the s-th
    of S equal pieces of each part in turn (with S = 1, a plain concatenation)."""
    lead = parts[0].shape[:-1]
    pieces = [p.reshape(*lead, shards, -1) for p in parts]  # [..., S, O_j / S]
    return jnp.concatenate(pieces, axis=-1).reshape(*lead, -1)


# The model's projections this layout fuses or transposes (`FusedWeights` reads them).
_ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@functools.partial(jax.jit, static_argnames=("out_major", "shards"))
def _decode_layers(stacked: Params, out_major: bool = True, shards: int = 1) -> tuple[Params, ...]:
    """params["layers"] ([L, ...] leaves) -> L trees of `DecodeParams.layers`."""
    n_layers = stacked["input_norm"]["scale"].shape[0]

    def matrix(kernels: list[jax.Array]) -> Params:  # [I, O_j] fused, in the layout
        if not out_major:
            return {"kernel": _shard_major(kernels, shards)}
        # Each piece transposed, then stacked by rows: the same order as transposing the
        # fused matrix, as one copy per piece instead of a concatenation and then a transpose.
        pieces = [k.reshape(k.shape[0], shards, -1) for k in kernels]  # [I, S, O_j / S]
        return {"kernel_t": jnp.concatenate([p[:, s].T for s in range(shards) for p in pieces])}

    def layer(i: int) -> Params:
        # The projections are laid out anew; every other weight (norms, an architecture's
        # extras) is kept as the model has it, under its own name.
        w = jax.tree.map(lambda x: x[i], stacked)
        attn, mlp = w["attn"], w["mlp"]
        d = attn["q_proj"]["kernel"].shape[0]
        qkv = matrix([attn[f"{x}_proj"]["kernel"].reshape(d, -1) for x in "qkv"])
        if "bias" in attn["q_proj"]:
            qkv["bias"] = _shard_major([attn[f"{x}_proj"]["bias"].ravel() for x in "qkv"], shards)
        fused_attn = {k: v for k, v in attn.items() if k not in _ATTN_PROJECTIONS}
        fused_attn["qkv"] = qkv
        fused_attn["o_proj"] = (
            {"kernel_t": attn["o_proj"]["kernel"].reshape(-1, d).T} if out_major else attn["o_proj"]
        )
        fused_mlp = {k: v for k, v in mlp.items() if k not in _MLP_PROJECTIONS}
        fused_mlp["gate_up"] = matrix([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]])
        fused_mlp["down_proj"] = (
            {"kernel_t": mlp["down_proj"]["kernel"].T} if out_major else mlp["down_proj"]
        )
        return {**w, "attn": fused_attn, "mlp": fused_mlp}

    return tuple(layer(i) for i in range(n_layers))


def decode_params(
    params: Params, config: ModelConfig, *, out_major: bool = True, shards: int = 1
) -> DecodeParams:
    """`params` laid out for `apply_decode` and `hidden_states`: the layer weights copied once
    into L per-layer trees (one more copy of the layers while `params` live); embedding,
    final norm and lm_head are shared with `params`. Run it once per weight update.

    Args:
      params: `model.init_params`' tree (or a checkpoint's).
      config: the architecture.
      out_major: store the layer matrices out-major (`kernel_t` [O, I]), faster from two
        decode rows up; False keeps `apply`'s [I, O] (`kernel`), faster for one-row steps
        (docs/performance.md). `EngineCore` picks it by its slot count.
      shards: S, the tensor-parallel pieces the fused matrices are ordered for (see
        `DecodeParams`); 1 = no sharding. Must divide n_heads, n_kv_heads and ffn_dim.
    """
    _check_shards(config, shards)
    chex.assert_shape(params["embed"]["embedding"], (config.vocab_size, config.d_model))
    return DecodeParams(
        embed=params["embed"]["embedding"],
        layers=_decode_layers(params["layers"], out_major=out_major, shards=int(shards)),
        final_norm=params["final_norm"]["scale"],
        lm_head=None if config.tie_embeddings else params["lm_head"]["kernel"],
        shards=int(shards),
        out_major=out_major,
    )


def layer_layout(layer: Params, *, out_major: bool = True, shards: int = 1) -> Params:
    """One layer of `DecodeParams.layers` from that layer's weights as a stack of one
    (params["layers"] leaves sliced ``[i:i + 1]``): what `decode_params` makes of layer i,
    for laying a model out one layer at a time (`EngineCore.place_and_split`)."""
    return _decode_layers(layer, out_major=out_major, shards=int(shards))[0]


# ---------------------------------------------------------------------------------------------
# Reading the layout: out-major products and the layer's weight reader

# Rows above which an out-major kernel multiplies as x [M, I] x kernel_tᵀ (one GEMM with a
# transposed right operand) instead of `out_major_dot`: a prefill's many rows, where the
# transpose back costs more than the left-operand GEMM saves (docs/performance.md).
OUT_MAJOR_GEMM_MAX_ROWS = 256


def out_major_dot(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """x [M, I] times the transpose of an out-major kernel [O, I]: [M, O].

    Computed as kernel_t [O, I] x xᵀ [I, M] (the weight is the GEMM's left operand), then
    transposed back: with few rows (decode steps: M = batch) XLA:CPU's GEMM streams a weight
    from memory faster as the left operand (docs/performance.md). The barrier keeps XLA's
    algebraic simplifier from folding the transpose back into the product (it rewrites
    transpose(dot(A, B)) as dot(Bᵀ, Aᵀ), the slow form); the transpose itself copies only
    the [O, M] result. Values are the same products, summed in another order: equal to
    x @ kernel_t.T up to float rounding.
    """
    return out_major_product(x, kernel_t).T


def out_major_product(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """`out_major_dot` without the transpose back: kernel_t [O, I] x xᵀ [I, M] -> [O, M],
    behind an optimization barrier (see `out_major_dot`)."""
    return jax.lax.optimization_barrier(jnp.dot(kernel_t, x.T))


def _out_major_linear(x: jax.Array, w: Params, dtype) -> jax.Array:
    """x [..., I] times {"kernel_t" [O, I], optional "bias" [O]} -> [..., O] in `dtype`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
    kernel_t = w["kernel_t"].astype(dtype)
    if x2.shape[0] > OUT_MAJOR_GEMM_MAX_ROWS:  # a prefill's many rows: x @ kernel_tᵀ
        y = jax.lax.dot_general(x2, kernel_t, (((1,), (1,)), ((), ())))
    else:
        y = out_major_dot(x2, kernel_t)
    y = y.reshape(*lead, kernel_t.shape[0])
    if "bias" in w:
        y = y + w["bias"].astype(dtype)
    return y


@dataclasses.dataclass(frozen=True)
class FusedWeights:
    """The `model.layers.WeightReader` of `DecodeParams.layers`: one matmul for q/k/v and
    one for gate/up, split back shard by shard (a reshape per shard, no data crosses
    shards)."""

    shards: int = 1
    out_major: bool = True

    def _fused(self, x: jax.Array, w: Params, config: ModelConfig) -> jax.Array:
        """x [B, T, D] times a fused matrix -> [B, T, S, O / S], the output split by shard."""
        cdt = jnp.dtype(config.compute_dtype)
        if self.out_major:
            y = _out_major_linear(x, w, cdt)
        else:
            y = linear("btd,de->bte", x, w, cdt)
        return y.reshape(*x.shape[:2], self.shards, -1)

    def qkv(self, attn, x, config):
        b, t, _ = x.shape
        h, n, k = config.n_heads, config.n_kv_heads, config.head_dim
        q_rows, kv_rows = h // self.shards * k, n // self.shards * k  # per shard
        y = self._fused(x, attn["qkv"], config)  # [B, T, S, (H + 2N)·K / S]
        return (
            y[..., :q_rows].reshape(b, t, h, k),
            y[..., q_rows : q_rows + kv_rows].reshape(b, t, n, k),
            y[..., q_rows + kv_rows :].reshape(b, t, n, k),
        )

    def o(self, attn, out, config):
        cdt = jnp.dtype(config.compute_dtype)
        if self.out_major:
            return _out_major_linear(out.reshape(*out.shape[:2], -1), attn["o_proj"], cdt)
        return linear("bthk,hkd->btd", out, attn["o_proj"], cdt)

    def gate_up(self, mlp, x, config):
        b, t, _ = x.shape
        cols = config.ffn_dim // self.shards  # per shard
        y = self._fused(x, mlp["gate_up"], config)  # [B, T, S, 2F / S]
        return y[..., :cols].reshape(b, t, -1), y[..., cols:].reshape(b, t, -1)

    def down(self, mlp, h, config):
        cdt = jnp.dtype(config.compute_dtype)
        if self.out_major:
            return _out_major_linear(h, mlp["down_proj"], cdt)
        return linear("btf,fd->btd", h, mlp["down_proj"], cdt)


# ---------------------------------------------------------------------------------------------
# Running the model over the layout


def _check_depth(params: DecodeParams, config: ModelConfig) -> None:
    if len(params.layers) != config.n_layers:
        raise ValueError(f"DecodeParams has {len(params.layers)} layers, config {config.n_layers}")


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
    """`model.apply` with a KV cache, `model.decoder_layer` unrolled over `decode_params`.

    The same maths as `apply` (the same layer function; final norm and lm_head in float32);
    only the layout differs: per-layer weights read in place, q/k/v and gate/up fused into
    one matmul each, and in the out-major layout every layer matmul and the tied lm_head's
    [V, D] table run with the weight as the left operand (`out_major_dot`); the in-major
    layout and an untied lm_head multiply as `apply` does. Logits agree with `apply`'s up to
    float rounding. The cache is written in place at `lengths[b] + t`, as in `apply`.
    Unrolling makes compile time grow with depth; the decode step compiles once per engine.

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
    _check_depth(params, config)
    capacity = kv_cache.k.shape[2]
    if window is not None and not 0 < window <= capacity:
        raise ValueError(f"window must be in (0, capacity={capacity}], got {window}")
    weights = params.reader

    def unrolled(x, kv, positions, mask, write_pos):
        if window is not None:
            mask = mask[:, :, :window]
        for i, w in enumerate(params.layers):
            cache = LayerCache(*kv, i, write_pos)
            x, kv = model_lib.decoder_layer(
                w, x, positions, mask, config=config, cache=cache, weights=weights
            )
        return x, kv

    hidden, new_cache = model_lib.hidden_states_with(
        unrolled,
        params.embed,
        params.final_norm,
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        kv_cache=kv_cache,
    )
    b, t = tokens.shape
    logits_t = _logits_t(params, hidden.reshape(b * t, -1))  # [V, B·T]
    logits = logits_t if vocab_major else logits_t.T.reshape(b, t, -1)
    return logits, new_cache


def hidden_states(
    params: DecodeParams,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    kv_cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """`model.hidden_states` over a `decode_params` split: what an engine's prefill and
    in-flight cache recompute run, so that it holds one copy of the weights. The same
    values as over the stacked params up to float rounding; for inference only (no
    checkpoint policy). Arguments and result as in `model.hidden_states`."""
    _check_depth(params, config)
    return model_lib.hidden_states_with(
        functools.partial(_loop_split_layers, params.layers, config, params.reader),
        params.embed,
        params.final_norm,
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        attention_mask=attention_mask,
        kv_cache=kv_cache,
    )


def _loop_split_layers(
    layers: tuple[Params, ...],
    config: ModelConfig,
    weights: FusedWeights,
    x: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    positions: jax.Array,
    mask: jax.Array,
    write_pos: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`decoder_layer` over per-layer weight trees, as a loop.

    A `fori_loop` whose body picks layer i's tree with `lax.switch`, so the layer is traced
    and compiled once (an unrolled prefill compiles several times slower). The switch
    copies the chosen layer's weights, as the stacked path's scan copies its slice, so a
    prefill costs about what it costs over stacked weights (docs/performance.md) while the
    engine holds only the split.
    """
    branches = [functools.partial(lambda i, ls: ls[i], i) for i in range(len(layers))]

    def body(i, carry):
        x, kv = carry
        w = jax.lax.switch(i, branches, layers)
        cache = None if kv is None else LayerCache(*kv, i, write_pos)
        return model_lib.decoder_layer(
            w, x, positions, mask, config=config, cache=cache, weights=weights
        )

    return jax.lax.fori_loop(0, len(layers), body, (x, kv))


def lm_head_logits(params: DecodeParams, hidden: jax.Array) -> jax.Array:
    """[M, D] float32 final hidden states -> [M, V] float32 logits (a tied head multiplies
    with the [V, D] table as `apply_decode` does)."""
    return _logits_t(params, hidden).T


def _logits_t(params: DecodeParams, hidden: jax.Array) -> jax.Array:
    """[M, D] float32 hidden -> [V, M] float32 logits: a tied head multiplies with the [V, D]
    table as the left operand (`out_major_product`), an untied one as `apply` does."""
    if params.lm_head is None:  # tied: the [V, D] table is already out-major
        return out_major_product(hidden, params.embed.astype(jnp.float32))
    return jnp.dot(hidden, params.lm_head.astype(jnp.float32)).T


# ---------------------------------------------------------------------------------------------
# Logical axes and shardings

# Logical axes of the layout's own leaves, by their path inside a layer; every other leaf
# has the model's axes (`model.PARAM_LOGICAL_AXES` without the leading "layers"). The fused
# rows of q/k/v are "heads" (whole heads, shard by shard), those of gate/up "mlp"; o_proj's
# and down_proj's inputs likewise, so one tensor-parallel rule shards all four consistently.
_LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn/qkv/kernel_t": ("heads", "embed"),
    "attn/qkv/kernel": ("embed", "heads"),
    "attn/qkv/bias": ("heads",),
    "attn/o_proj/kernel_t": ("embed", "heads"),
    "attn/o_proj/kernel": ("heads", "head_dim", "embed"),
    "mlp/gate_up/kernel_t": ("mlp", "embed"),
    "mlp/gate_up/kernel": ("embed", "mlp"),
    "mlp/down_proj/kernel_t": ("embed", "mlp"),
    "mlp/down_proj/kernel": ("mlp", "embed"),
}
_TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": model_lib.PARAM_LOGICAL_AXES["embed/embedding"],
    "final_norm": model_lib.PARAM_LOGICAL_AXES["final_norm/scale"],
    "lm_head": model_lib.PARAM_LOGICAL_AXES["lm_head/kernel"],
}


def _axes_of(path, leaf) -> tuple[str, ...]:
    name = model_lib.tree_path_str(path)
    parts = name.split("/")
    if parts[0] == "layers":  # layers/<i>/<path inside the layer>
        key = "/".join(parts[2:])
        model_axes = model_lib.PARAM_LOGICAL_AXES.get("layers/" + key)
        axes = _LAYER_AXES.get(key, None if model_axes is None else model_axes[1:])
    else:
        axes = _TOP_AXES.get(parts[0])
    if axes is None:
        raise ValueError(
            f"DecodeParams leaf {name!r} has no logical axes (decode_layout._LAYER_AXES, "
            "model.PARAM_LOGICAL_AXES)"
        )
    if len(axes) != len(np.shape(leaf)):
        raise ValueError(f"DecodeParams leaf {name!r} has shape {np.shape(leaf)} but axes {axes}")
    return axes


def decode_logical_axes(params: DecodeParams) -> DecodeParams:
    """The logical axis names of every leaf of a `DecodeParams` (or of its shapes), in the
    model's vocabulary ("heads", "mlp", "embed", "vocab", "norm", ...): a `DecodeParams`
    whose leaves are tuples of names."""
    return jax.tree_util.tree_map_with_path(_axes_of, params)


def decode_shardings(
    params: DecodeParams, mesh: Mesh, rules: sharding.Rules = sharding.INFERENCE_RULES
) -> DecodeParams:
    """A `NamedSharding` for every leaf of a `DecodeParams` (arrays or
    `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape(decode_params, ...)`) on `mesh`.

    With `INFERENCE_RULES` the fused q/k/v and gate/up rows, o_proj's and down_proj's
    inputs, and the vocabulary are split over `tensor`; norms are replicated. Raises
    ValueError naming the leaf for a dimension the mesh does not divide or an axis without
    a rule, and naming both numbers when the mesh would split the fused rows into pieces
    that are not whole shards (its size over those rows must divide `params.shards`).
    """

    def one(path, leaf):
        spec = sharding.logical_to_spec(
            _axes_of(path, leaf),
            rules,
            mesh=mesh,
            shape=np.shape(leaf),
            name=model_lib.tree_path_str(path),
        )
        return NamedSharding(mesh, spec)

    placed = jax.tree_util.tree_map_with_path(one, params)
    for logical in ("heads", "mlp"):
        spec = sharding.logical_to_spec((logical,), rules, mesh=mesh, name=logical)
        axes = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else spec[0]
        parts = math.prod(mesh.shape[axis] for axis in axes)
        if params.shards % parts:
            raise ValueError(
                f"DecodeParams.shards={params.shards} is not a multiple of the {parts} devices "
                f"of mesh axes {axes} that split the fused {logical!r} rows: a device would "
                f"hold part of a shard (lay the weights out with decode_params(..., "
                f"shards={parts}))"
            )

    return placed
