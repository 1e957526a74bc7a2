"""The decode engine as pure JAX functions: prefill, insert, generate over fixed slots.

Inference layer (host-side shell).

A `DecodeState` holds `N` slots, each one running sample: its KV cache rows, the last sampled
token (not yet fed to the model), and its sampling settings and PRNG coordinates. One
`generate` call feeds every slot's last token, writes its keys/values at the slot's length
and samples the next token, for all `N` slots at once (inactive slots compute and are
ignored: a fixed batch shape compiles once).

    prompt ──prefill──▶ Prefix (cache [L,1,Tb,..], last logits [V]) ──insert(slot, i)──▶
    DecodeState slot (first token sampled at step 0) ──generate──▶ next token per slot ...

The host's batched forms: `prefill_batch` prefills R prompts of one bucket in one call
(only each row's last position goes through the lm_head), `insert_batch` starts up to N
samples from its rows in one call (the G samples of a prompt share one row), and
`generate_packed` returns a step's tokens and log-probs as one `[2, N]` array, so a step's
results leave the device in one copy.

After an in-flight weight swap, `recompute_cache` rewrites the running slots' caches under
the new weights (one batched prefill of each slot's prompt + tokens so far), so decoding
continues as if the new weights had computed the whole sequence.

Prompts are right-padded to a bucket length `Tb`, so a run compiles one prefill (and one
insert) per bucket. Nothing here knows about threads, queues or versions: the host
(`host.py`) and the JetStream adapter (`jetstream_engine.py`) drive these functions.

The log-prob of each sampled token is the behaviour log-prob, see `sampling.py`.

Prefill runs the model on the params as given, stacked (`model.hidden_states`) or laid out
per layer (`decode_layout.hidden_states`); the decode step runs `decode_layout.apply_decode`
on the per-layer layout (`decode_layout.decode_params`), which reads each layer's weights in
place instead of copying its slice every step: decode at small batch is bound by reading the
weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from a3po_jax import model as model_lib
from a3po_jax.inference.engine import decode_layout, sampling
from a3po_jax.parallel import sharding

Params = Any


@struct.dataclass
class Prefix:
    """A prefilled prompt, ready to be inserted into one or more slots."""

    cache: model_lib.KVCache  # k, v [L, 1, Tb, Hkv, K]; lengths [1] = true prompt length
    last_logits: jax.Array  # [V] float32 logits after the last prompt token


@struct.dataclass
class DecodeState:
    """Everything one decode step reads, for N slots (a pytree; donated to each step)."""

    cache: model_lib.KVCache  # k, v [L, N, S, Hkv, K]; lengths [N] tokens in the cache
    tokens: jax.Array  # [N] int32 last sampled token, fed to the model at the next step
    active: jax.Array  # [N] bool slot runs a sample
    temperature: jax.Array  # [N] float32, 0 = greedy
    top_k: jax.Array  # [N] int32, 0 = off
    top_p: jax.Array  # [N] float32, 1 = off
    seed_hi: jax.Array  # [N] uint32 request seed, high word
    seed_lo: jax.Array  # [N] uint32 request seed, low word
    sample_index: jax.Array  # [N] int32 sample number within its request
    step: jax.Array  # [N] int32 index of the next token to draw (0 = first after prompt)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.cache.k.shape[2]


@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Sampling coordinates of one sample, as written into a slot by `insert`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    sample_index: int = 0

    def as_arrays(self) -> dict[str, jax.Array]:
        hi, lo = sampling.split_seed(self.seed)
        return dict(
            temperature=jnp.float32(self.temperature),
            top_k=jnp.int32(self.top_k),
            top_p=jnp.float32(self.top_p),
            seed_hi=jnp.uint32(hi),
            seed_lo=jnp.uint32(lo),
            sample_index=jnp.int32(self.sample_index),
        )


def init_decode_state(
    config: model_lib.ModelConfig, num_slots: int, capacity: int, dtype=None
) -> DecodeState:
    """N empty (inactive) slots with a KV cache of `capacity` positions each."""
    if num_slots <= 0:
        raise ValueError(f"num_slots must be > 0, got {num_slots}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    N = num_slots
    return DecodeState(
        cache=model_lib.init_kv_cache(config, N, capacity, dtype=dtype),
        tokens=jnp.zeros((N,), jnp.int32),
        active=jnp.zeros((N,), jnp.bool_),
        temperature=jnp.zeros((N,), jnp.float32),
        top_k=jnp.zeros((N,), jnp.int32),
        top_p=jnp.ones((N,), jnp.float32),
        seed_hi=jnp.zeros((N,), jnp.uint32),
        seed_lo=jnp.zeros((N,), jnp.uint32),
        sample_index=jnp.zeros((N,), jnp.int32),
        step=jnp.zeros((N,), jnp.int32),
    )


def _hidden_states(params: Params, tokens: jax.Array, positions: jax.Array, **kwargs):
    """`hidden_states` over either weight layout: stacked params or a per-layer split."""
    if isinstance(params, decode_layout.DecodeParams):
        return decode_layout.hidden_states(params, tokens, positions, **kwargs)
    return model_lib.hidden_states(params, tokens, positions, **kwargs)


def _lm_head_logits(params: Params, hidden: jax.Array, config: model_lib.ModelConfig):
    """[M, D] float32 hidden states -> [M, V] float32 logits, over either weight layout."""
    if isinstance(params, decode_layout.DecodeParams):
        return decode_layout.lm_head_logits(params, hidden)
    return model_lib.lm_head_logits(params, hidden, config)


def prefill(
    params: Params,
    tokens: jax.Array,
    true_length: jax.Array,
    *,
    config: model_lib.ModelConfig,
    cache_dtype=None,
) -> Prefix:
    """Runs a right-padded prompt through the model, filling a KV cache of the bucket length.

    Args:
      params: model parameters, stacked or a `decode_layout.decode_params` split.
      tokens: `[Tb]` int32 prompt, right-padded to its bucket length Tb.
      true_length: int32 scalar, number of real tokens (1 <= true_length <= Tb).
      config: the model's config (static).
      cache_dtype: KV cache dtype (default: the model's choice).

    Returns:
      `Prefix` with the cache (`lengths == [true_length]`) and the logits that predict the
      first new token.
    """
    chex.assert_rank(tokens, 1)
    (Tb,) = tokens.shape
    t = jnp.arange(Tb, dtype=jnp.int32)  # [T]
    segment_ids = (t < true_length).astype(jnp.int32)[None, :]  # [1, T]; 0 marks padding
    cache = model_lib.init_kv_cache(config, 1, Tb, dtype=cache_dtype)
    hidden, cache = _hidden_states(
        params,
        tokens[None, :].astype(jnp.int32),
        t[None, :],
        config=config,
        segment_ids=segment_ids,
        kv_cache=cache,
    )  # [1, T, D] float32; only the last real position goes through the lm_head
    last = jax.lax.dynamic_slice_in_dim(hidden[0], true_length - 1, 1, axis=0)  # [1, D]
    logits = _lm_head_logits(params, last, config)[0]
    return Prefix(cache=cache, last_logits=logits.astype(jnp.float32))


def insert(
    prefix: Prefix,
    state: DecodeState,
    slot: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed_hi: jax.Array,
    seed_lo: jax.Array,
    sample_index: jax.Array,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Starts one sample of a prefilled prompt in `slot`, drawing its first token (step 0).

    The prefix cache is copied into the slot's first Tb positions (`Tb <= S`); positions past
    the prompt keep stale values, which attention never reads (it stops at the length).
    One prefix can be inserted into several slots with different sample indices.

    Args:
      prefix: from `prefill`.
      state: the decode state (donated by the jitted wrapper).
      slot: int32 scalar slot index.
      temperature, top_k, top_p, seed_hi, seed_lo, sample_index: scalars, see `DecodeState`.

    Returns:
      (new state, first token int32 scalar, its behaviour log-prob float32 scalar).
    """
    Tb = prefix.cache.k.shape[2]
    if Tb > state.capacity:
        raise ValueError(f"prefix length {Tb} exceeds the cache capacity {state.capacity}")
    as_row = lambda x, dtype: jnp.asarray(x, dtype).reshape(1)
    temperature = as_row(temperature, jnp.float32)
    top_k = as_row(top_k, jnp.int32)
    top_p = as_row(top_p, jnp.float32)
    seed_hi = as_row(seed_hi, jnp.uint32)
    seed_lo = as_row(seed_lo, jnp.uint32)
    sample_index = as_row(sample_index, jnp.int32)
    step0 = jnp.zeros((1,), jnp.int32)

    keys = sampling.sample_keys(seed_hi, seed_lo, sample_index, step0)
    token, logprob = sampling.sample_tokens(
        prefix.last_logits[None, :], keys, temperature, top_k, top_p
    )  # [1], [1]

    def write(dst, src):  # dst [L, N, S, Hkv, K], src [L, 1, Tb, Hkv, K]
        zero = jnp.zeros((), jnp.int32)
        return jax.lax.dynamic_update_slice(
            dst, src.astype(dst.dtype), (zero, slot.astype(jnp.int32), zero, zero, zero)
        )

    cache = state.cache
    cache = cache._replace(
        k=write(cache.k, prefix.cache.k),
        v=write(cache.v, prefix.cache.v),
        lengths=cache.lengths.at[slot].set(prefix.cache.lengths[0]),
    )
    set_at = lambda arr, value: arr.at[slot].set(value[0])
    state = state.replace(
        cache=cache,
        tokens=set_at(state.tokens, token),
        active=state.active.at[slot].set(True),
        temperature=set_at(state.temperature, temperature),
        top_k=set_at(state.top_k, top_k),
        top_p=set_at(state.top_p, top_p),
        seed_hi=set_at(state.seed_hi, seed_hi),
        seed_lo=set_at(state.seed_lo, seed_lo),
        sample_index=set_at(state.sample_index, sample_index),
        step=state.step.at[slot].set(1),
    )
    return state, token[0], logprob[0]


@struct.dataclass
class PrefixBatch:
    """R prefilled prompts of one bucket length, made by one `prefill_batch` call."""

    cache: model_lib.KVCache  # k, v [L, R, Tb, Hkv, K]; lengths [R] = true prompt lengths
    last_logits: jax.Array  # [R, V] float32 logits after each row's last prompt token


def prefill_batch(
    params: Params,
    tokens: jax.Array,
    true_lengths: jax.Array,
    *,
    config: model_lib.ModelConfig,
    cache_dtype=None,
) -> PrefixBatch:
    """`prefill` for R right-padded prompts of one bucket length in one call.

    Only each row's last real position goes through the lm_head (an [R, D] x [D, V]
    product), not all R * Tb positions: the logits of the other positions are never read.
    Rows are independent; padding rows (any `true_length` >= 1) cost compute only.

    Args:
      params: model parameters, stacked or a `decode_layout.decode_params` split.
      tokens: `[R, Tb]` int32 prompts, right-padded to the bucket length Tb.
      true_lengths: `[R]` int32 real tokens per row (1 <= true_length <= Tb).
      config: the model's config (static).
      cache_dtype: KV cache dtype (default: the model's choice).

    Returns:
      `PrefixBatch` with the caches (`lengths == true_lengths`) and each row's logits that
      predict its first new token.
    """
    chex.assert_rank(tokens, 2)
    R, Tb = tokens.shape
    chex.assert_shape(true_lengths, (R,))
    t = jnp.arange(Tb, dtype=jnp.int32)[None, :]  # [1, T]
    segment_ids = (t < true_lengths[:, None]).astype(jnp.int32)  # [R, T]; 0 marks padding
    cache = model_lib.init_kv_cache(config, R, Tb, dtype=cache_dtype)
    hidden, cache = _hidden_states(
        params,
        tokens.astype(jnp.int32),
        jnp.broadcast_to(t, (R, Tb)),
        config=config,
        segment_ids=segment_ids,
        kv_cache=cache,
    )  # [R, T, D] float32 (after the final norm)
    last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]  # [R, D]
    logits = _lm_head_logits(params, last, config)
    return PrefixBatch(cache=cache, last_logits=logits.astype(jnp.float32))


def pack_outputs(tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
    """tokens `[N]` int32 and logprobs `[N]` float32 as one `[2, N]` int32 array (the
    log-probs' bits), so the host copies a step's results out in one transfer."""
    return jnp.stack([tokens.astype(jnp.int32), jax.lax.bitcast_convert_type(logprobs, jnp.int32)])


def unpack_outputs(packed) -> tuple:
    """`pack_outputs`' inverse on the host: (tokens [N] int32, logprobs [N] float32)."""
    packed = np.asarray(packed)
    return packed[0], packed[1].view(np.float32)


def insert_batch(
    prefixes: PrefixBatch,
    state: DecodeState,
    rows: jax.Array,
    slots: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed_hi: jax.Array,
    seed_lo: jax.Array,
    sample_index: jax.Array,
) -> tuple[DecodeState, jax.Array]:
    """`insert` for up to N samples at once: entry m starts prefix row `rows[m]` in slot
    `slots[m]` and draws its first token. Several entries may share a row (the G samples of
    one prompt share one prefill); an entry with `slots[m] >= N` is padding and changes
    nothing (the entry count is always N, so one program serves any number of inserts).

    Args:
      prefixes: from `prefill_batch`, R rows of length Tb <= S.
      state: the decode state (donated by the jitted wrapper).
      rows: `[N]` int32 prefix row of each entry.
      slots: `[N]` int32 distinct target slots (padding entries: N).
      temperature, top_k, top_p, seed_hi, seed_lo, sample_index: `[N]`, see `DecodeState`.

    Returns:
      (new state, `pack_outputs(first tokens, their behaviour log-probs)` `[2, N]`, entry
      m's in column `slots[m]`; other columns are zero).
    """
    N = state.num_slots
    Tb = prefixes.cache.k.shape[2]
    if Tb > state.capacity:
        raise ValueError(f"prefix length {Tb} exceeds the cache capacity {state.capacity}")
    chex.assert_shape([rows, slots, temperature, top_k, top_p], (N,))
    chex.assert_shape([seed_hi, seed_lo, sample_index], (N,))
    step0 = jnp.zeros((N,), jnp.int32)
    keys = sampling.sample_keys(seed_hi, seed_lo, sample_index, step0)
    tokens, logprobs = sampling.sample_tokens(
        prefixes.last_logits[rows], keys, temperature, top_k, top_p
    )  # [N], [N]

    def write(dst, src):  # dst [L, N, S, Hkv, K], src [L, R, Tb, Hkv, K]
        # Positions past each prompt keep stale values, which attention never reads. One
        # entry at a time, in place: `dst.at[:, slots, :Tb].set(src[:, rows])` would gather
        # every entry's rows into an [L, N, Tb, Hkv, K] temporary first, alive beside a train
        # step's temporaries in an embedded host (docs/performance.md).
        L, _, _, Hkv, K = dst.shape
        src = src.astype(dst.dtype)

        def one(m, out):
            slot = jnp.minimum(slots[m], N - 1)  # padding (slot N) writes back what is there
            piece = jax.lax.dynamic_slice_in_dim(src, rows[m], 1, axis=1)  # [L, 1, Tb, ..]
            here = jax.lax.dynamic_slice(out, (0, slot, 0, 0, 0), (L, 1, Tb, Hkv, K))
            piece = jnp.where(slots[m] < N, piece, here)
            return jax.lax.dynamic_update_slice(out, piece, (0, slot, 0, 0, 0))

        return jax.lax.fori_loop(0, N, one, dst)

    set_at = lambda arr, value: arr.at[slots].set(value.astype(arr.dtype), mode="drop")
    cache = state.cache._replace(
        k=write(state.cache.k, prefixes.cache.k),
        v=write(state.cache.v, prefixes.cache.v),
        lengths=set_at(state.cache.lengths, prefixes.cache.lengths[rows]),
    )
    state = state.replace(
        cache=cache,
        tokens=set_at(state.tokens, tokens),
        active=set_at(state.active, jnp.ones((N,), jnp.bool_)),
        temperature=set_at(state.temperature, temperature),
        top_k=set_at(state.top_k, top_k),
        top_p=set_at(state.top_p, top_p),
        seed_hi=set_at(state.seed_hi, seed_hi),
        seed_lo=set_at(state.seed_lo, seed_lo),
        sample_index=set_at(state.sample_index, sample_index),
        step=set_at(state.step, jnp.ones((N,), jnp.int32)),
    )
    # Entry m's outputs go to column slots[m], so the host reads them by slot.
    by_slot = lambda x: jnp.zeros_like(x).at[slots].set(x, mode="drop")
    return state, pack_outputs(by_slot(tokens), by_slot(logprobs))


def generate(
    params: decode_layout.DecodeParams,
    state: DecodeState,
    *,
    config: model_lib.ModelConfig,
    window: int | None = None,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One decode step for all N slots: feed each slot's last token, sample the next.

    Inactive slots run too (fixed shapes) but their length, token and step do not change.
    The caller must not run a slot whose length has reached the capacity S.

    Args:
      params: the weights split per layer (`decode_layout.decode_params`; `EngineCore` keeps them
        once per weight version).
      state: the decode state (donated by the jitted wrapper: the cache is written in place).
      config: the model's config (static).
      window: attend to the first `window` cache slots only (static; None = the capacity).
        Every active slot's length must be < window (its fed token is written at `length`).

    Returns:
      (new state, tokens `[N]` int32, behaviour log-probs `[N]` float32); entries of
      inactive slots are meaningless.
    """
    N = state.num_slots
    positions = state.cache.lengths[:, None]  # [N, 1]; the fed token's position
    segment_ids = state.active.astype(jnp.int32)[:, None]  # [N, 1]; 0 keeps lengths as is
    # The tied lm_head's out-major product is vocabulary-major ([V, N]) as it comes, and is
    # sampled that way without a transpose; an untied [D, V] head gives [N, V] rows (made
    # vocabulary-major, its product would take the [D, V] matrix transposed, a copy of it).
    vocab_major = params.lm_head is None
    logits, cache = decode_layout.apply_decode(
        params,
        state.tokens[:, None],
        positions,
        config=config,
        segment_ids=segment_ids,
        kv_cache=state.cache,
        window=window,
        vocab_major=vocab_major,
    )  # [V, N] or [N, 1, V]
    keys = sampling.sample_keys(state.seed_hi, state.seed_lo, state.sample_index, state.step)
    slots = (state.temperature, state.top_k, state.top_p)
    if vocab_major:
        chex.assert_shape(logits, (None, N))
        tokens, logprobs = sampling.sample_tokens_vocab_major(logits, keys, *slots)  # [N], [N]
    else:
        chex.assert_shape(logits, (N, 1, None))
        tokens, logprobs = sampling.sample_tokens(logits[:, 0, :], keys, *slots)  # [N], [N]
    state = state.replace(
        cache=cache,
        tokens=jnp.where(state.active, tokens, state.tokens),
        step=state.step + state.active.astype(jnp.int32),
    )
    return state, tokens, logprobs


def generate_packed(
    params: decode_layout.DecodeParams,
    state: DecodeState,
    *,
    config: model_lib.ModelConfig,
    window: int | None = None,
) -> tuple[DecodeState, jax.Array]:
    """`generate` with its outputs as one `[2, N]` array (`pack_outputs`): what the host
    dispatches, one device -> host copy per step."""
    state, tokens, logprobs = generate(params, state, config=config, window=window)
    return state, pack_outputs(tokens, logprobs)


def recompute_cache(
    params: Params,
    state: DecodeState,
    tokens: jax.Array,
    *,
    config: model_lib.ModelConfig,
) -> DecodeState:
    """Recomputes the KV cache of every active slot under `params` (one batched prefill).

    After an in-flight weight swap the cache still holds keys/values computed by the old
    weights; decoding on from it would draw tokens from neither policy. This rewrites the
    first W cache positions of each active slot from its token history, as AReaL's
    interruptible rollout does, so the next token's log-prob is the new policy's
    probability of it given the whole sequence. Lengths, the pending token and the sampling
    coordinates are unchanged; inactive slots keep their cache as it is.

    Args:
      params: the (new) model parameters, stacked or split per layer (either runs, as in
        `prefill`).
      state: the decode state (donated by the jitted wrapper).
      tokens: `[N, W]` int32, row n = the tokens in slot n's cache (prompt + generated
        tokens already fed), right-padded; W >= every active slot's length (static shape).
      config: the model's config (static).

    Returns:
      The state with the active slots' cache positions [0, W) recomputed.
    """
    N, W = tokens.shape
    chex.assert_shape(tokens, (state.num_slots, None))
    if W > state.capacity:
        raise ValueError(f"recompute window {W} exceeds the cache capacity {state.capacity}")
    lengths = state.cache.lengths  # [N]
    t = jnp.arange(W, dtype=jnp.int32)[None, :]  # [1, W]
    positions = jnp.broadcast_to(t, (N, W))
    # Padding past each length is written too (fixed shapes) but never read: decode attends
    # to slots <= length and overwrites slot `length` with the fed token first.
    segment_ids = (t < lengths[:, None]).astype(jnp.int32)  # [N, W]
    fresh = model_lib.init_kv_cache(config, N, W, dtype=state.cache.k.dtype)
    # Only the cache is needed: no lm_head (N * W * V logits would dominate memory).
    _, fresh = _hidden_states(
        params,
        tokens.astype(jnp.int32),
        positions,
        config=config,
        segment_ids=segment_ids,
        kv_cache=fresh,
    )
    keep_old = ~state.active[None, :, None, None, None]  # [1, N, 1, 1, 1]

    def rewrite(old, new):  # old [L, N, S, Hkv, K], new [L, N, W, Hkv, K]
        merged = jnp.where(keep_old, old[:, :, :W], new.astype(old.dtype))
        return jax.lax.dynamic_update_slice(old, merged, (0, 0, 0, 0, 0))

    cache = state.cache._replace(
        k=rewrite(state.cache.k, fresh.k), v=rewrite(state.cache.v, fresh.v)
    )
    return state.replace(cache=cache)


def release(state: DecodeState, finished: jax.Array) -> DecodeState:
    """Marks the slots where `finished [N]` is true inactive (their cache is left to reuse)."""
    chex.assert_shape(finished, (state.num_slots,))
    return state.replace(active=state.active & ~finished)


@dataclasses.dataclass(frozen=True)
class _Jits:
    """The jitted engine functions. The decode state is donated, so the KV cache is updated
    in place instead of copied every step."""

    prefill: Any
    insert: Any
    generate: Any
    release: Any
    prefill_batch: Any
    insert_batch: Any
    generate_packed: Any
    recompute: Any


def _make_jits(mesh: Mesh | None) -> _Jits:
    """The engine's jits; on a mesh, with the decode state sharded as `state_shardings` says
    on the way out too (so that donation updates it in place), the prefixes' caches split
    over heads, and the small outputs replicated."""
    if mesh is None:
        state = prefix = single = rep = None
    else:
        state, prefix, rep = state_shardings(mesh), prefix_shardings(mesh), replicated(mesh)
        single = Prefix(cache=prefix.cache, last_logits=prefix.last_logits)

    def jit(fn, out_shardings, **kwargs):
        if mesh is not None:
            kwargs["out_shardings"] = out_shardings
        return jax.jit(fn, **kwargs)

    static = ("config", "cache_dtype")
    return _Jits(
        prefill=jit(prefill, single, static_argnames=static),
        insert=jit(insert, (state, rep, rep), donate_argnums=(1,)),
        generate=jit(
            generate, (state, rep, rep), static_argnames=("config", "window"), donate_argnums=(1,)
        ),
        release=jit(release, state, donate_argnums=(0,)),
        prefill_batch=jit(prefill_batch, prefix, static_argnames=static),
        insert_batch=jit(insert_batch, (state, rep), donate_argnums=(1,)),
        generate_packed=jit(
            generate_packed, (state, rep), static_argnames=("config", "window"), donate_argnums=(1,)
        ),
        recompute=jit(recompute_cache, state, static_argnames=("config",), donate_argnums=(1,)),
    )


# One device: module-level jits, so every EngineCore with the same model and shapes shares
# one compilation (jit keys on the hashable, frozen config).
_ONE_DEVICE_JITS = _make_jits(None)


@functools.cache
def _mesh_jits(mesh: Mesh) -> _Jits:
    return _make_jits(mesh)


def state_shardings(mesh: Mesh) -> DecodeState:
    """How a `DecodeState` lies on an inference mesh: slots split over ``data`` (and
    ``fsdp``), the KV cache's heads over ``tensor`` (`sharding.INFERENCE_RULES`)."""
    rules = sharding.INFERENCE_RULES
    kv = sharding.kv_cache_shardings(mesh, rules)
    slots = NamedSharding(mesh, sharding.logical_to_spec(("batch",), rules, mesh=mesh))
    return DecodeState(
        cache=kv,
        tokens=slots,
        active=slots,
        temperature=slots,
        top_k=slots,
        top_p=slots,
        seed_hi=slots,
        seed_lo=slots,
        sample_index=slots,
        step=slots,
    )


def prefix_shardings(mesh: Mesh) -> PrefixBatch:
    """How prefilled prompts lie on an inference mesh: every row on every ``data`` group
    (any slot may take any row), the cache's heads over ``tensor``; logits replicated."""
    rows_whole = tuple((k, None if k == "batch" else v) for k, v in sharding.INFERENCE_RULES)
    kv = sharding.kv_cache_shardings(mesh, rows_whole)
    return PrefixBatch(cache=kv._replace(lengths=replicated(mesh)), last_logits=replicated(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class EngineCore:
    """The jitted engine functions for one model config and one slot layout.

    `params` are an argument of every call, so a weight swap is simply calling with other
    params (same shapes and dtypes: no recompilation). The decode step runs on the weights
    split per layer (`decode_layout.decode_params`, one more copy of the layer weights); the
    split of the params last seen is kept, so it is made once per weight version, at the
    first step with those weights. A caller that wants it off the decode loop (in its weight-update
    path) can pass `split_params(params)` to `generate` instead. The split's layer matrices
    are out-major (the faster layout from two rows up) unless the engine has a single slot
    (`decode_params`' `out_major`). Prefill and the cache recompute take either form:
    a caller that holds only the split (`InferenceHost`) keeps one copy of the weights. The
    decode state is donated to each step, so its KV cache is updated in place.

    Attention reads every cache slot it covers at every step, so a step attends to a window
    of the first W slots, W from `decode_windows` (the smallest prefill bucket doubled up to
    the capacity, which is always the last): the caller that knows the slots' lengths passes
    `window_for(longest)`, and a step costs what its longest sample needs, not the capacity.
    One decode program is compiled per window used.

    On a `mesh` of several devices (``data`` x ``tensor``, `sharding.INFERENCE_RULES`) the
    engine is data- and tensor-parallel: the slots are split over ``data``, the weights
    (laid out with ``shards`` = the ``tensor`` size, `decode_layout.decode_shardings`) and
    the KV cache's heads over ``tensor``, so a model too large for one device serves from
    several. Without one it runs on this process's first device.

    With ``batch_invariant`` the engine compiles one shape per prompt bucket and one decode
    window: every prompt is prefilled alone (`prefill_rows` = (1,)) and every step attends to
    the whole cache (`decode_windows` = (capacity,)). A compiled program's rows do not mix,
    so a sample's tokens and log-probs then depend only on its prompt, its sampling seed and
    the weights, never on the prompts prefilled with it or on its neighbours' lengths.
    """

    def __init__(
        self,
        config: model_lib.ModelConfig,
        *,
        num_slots: int,
        capacity: int,
        prefill_buckets: tuple[int, ...],
        cache_dtype=None,
        mesh: Mesh | None = None,
        batch_invariant: bool = False,
    ):
        buckets = tuple(sorted(set(int(b) for b in prefill_buckets)))
        if not buckets or buckets[0] <= 0:
            raise ValueError(f"prefill_buckets must be positive lengths, got {prefill_buckets}")
        if buckets[-1] > capacity:
            raise ValueError(
                f"the largest prefill bucket {buckets[-1]} exceeds the cache capacity {capacity}"
            )
        if capacity > config.max_seq_len:
            raise ValueError(
                f"cache capacity {capacity} exceeds the model's max_seq_len {config.max_seq_len}"
            )
        self.config = config
        self.num_slots = int(num_slots)
        if mesh is None:
            mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self.mesh = mesh
        # Weights split over `tensor` (shards) and slots over `data`: both must divide.
        self.shards = int(mesh.shape["tensor"])
        groups = int(mesh.shape["data"] * mesh.shape["fsdp"])
        if self.num_slots % groups:
            raise ValueError(
                f"num_slots={self.num_slots} must be a multiple of the inference mesh's data x "
                f"fsdp size {groups} (the slots are split over it)"
            )
        # The decode step's weight layout (`decode_params`' out_major): out-major from 2 slots up.
        self.out_major = self.num_slots > 1
        self.capacity = int(capacity)
        self.prefill_buckets = buckets
        self.cache_dtype = cache_dtype
        jits = _ONE_DEVICE_JITS if mesh.size == 1 else _mesh_jits(mesh)
        self._jits = jits
        self._prefill = functools.partial(jits.prefill, config=config, cache_dtype=cache_dtype)
        self._generate = functools.partial(jits.generate, config=config)
        self._recompute = functools.partial(jits.recompute, config=config)
        # Batch-invariant: one program shape per prompt bucket and one decode window, so a
        # sample's numbers never depend on which prompts share its prefill or how long its
        # neighbours run (the cost is in docs/performance.md, "Batch-invariant generation").
        self.batch_invariant = bool(batch_invariant)
        windows, w = [], buckets[0]
        while w < self.capacity and not self.batch_invariant:
            windows.append(w)
            w *= 2
        self.decode_windows = (*windows, self.capacity)
        # Prompts prefilled together are padded to a power of two of rows (up to the slot
        # count): one prefill program per (rows, bucket), not per number of prompts.
        rows, r = [], 1
        while r < self.num_slots and not self.batch_invariant:
            rows.append(r)
            r *= 2
        self.prefill_rows = (1,) if self.batch_invariant else (*rows, self.num_slots)
        self._prefill_batch = functools.partial(
            jits.prefill_batch, config=config, cache_dtype=cache_dtype
        )
        self._generate_packed = functools.partial(jits.generate_packed, config=config)
        # (leaves of the params last split, their split). The leaves are held so that their
        # ids cannot be reused by new arrays while the entry lives.
        self._split: tuple[list[jax.Array], decode_layout.DecodeParams] | None = None

    @property
    def max_prompt_length(self) -> int:
        return self.prefill_buckets[-1]

    def bucket_for(self, prompt_length: int) -> int:
        """The smallest bucket that holds a prompt of this length (ValueError if none)."""
        if prompt_length <= 0:
            raise ValueError("prompt_tokens is empty: a prompt needs at least one token")
        for b in self.prefill_buckets:
            if prompt_length <= b:
                return b
        raise ValueError(
            f"prompt_tokens has {prompt_length} tokens, more than the largest prefill bucket "
            f"{self.prefill_buckets[-1]} (prefill_buckets={self.prefill_buckets})"
        )

    def init_decode_state(self) -> DecodeState:
        state = init_decode_state(self.config, self.num_slots, self.capacity, self.cache_dtype)
        # Committed like the outputs of the jitted steps, so the first insert compiles the
        # same executable as every later one (jit keys on committed-ness too).
        if self.mesh.size == 1:
            return jax.device_put(state, self.mesh.devices.flat[0])
        return jax.device_put(state, state_shardings(self.mesh))

    def prefill(self, params: Params, prompt_tokens) -> Prefix:
        """Prefills one prompt (a sequence of ints), padded to its bucket."""
        P = len(prompt_tokens)
        Tb = self.bucket_for(P)
        padded = jnp.zeros((Tb,), jnp.int32).at[:P].set(jnp.asarray(prompt_tokens, jnp.int32))
        return self._prefill(params, padded, jnp.int32(P))

    def prefill_padded(self, params: Params, tokens: jax.Array, true_length: int) -> Prefix:
        """Prefills a prompt already right-padded to some length Tb <= capacity."""
        (Tb,) = tokens.shape
        if Tb > self.capacity:
            raise ValueError(f"padded prompt length {Tb} exceeds the cache capacity")
        if not 1 <= true_length <= Tb:
            raise ValueError(f"true_length must be in [1, {Tb}], got {true_length}")
        return self._prefill(params, jnp.asarray(tokens, jnp.int32), jnp.int32(true_length))

    def insert(
        self, prefix: Prefix, state: DecodeState, slot: int, slot_sampling: SlotSampling
    ) -> tuple[DecodeState, jax.Array, jax.Array]:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        return self._jits.insert(prefix, state, jnp.int32(slot), **slot_sampling.as_arrays())

    def prefill_batch(self, params: Params, prompts) -> PrefixBatch:
        """Prefills several prompts (sequences of ints) of one bucket in one call; the rows
        are padded to the next of `prefill_rows` (padding rows repeat the first prompt).
        Row r of the result is `prompts[r]`."""
        R = len(prompts)
        if not 1 <= R <= self.prefill_rows[-1]:
            raise ValueError(f"prefill_batch takes 1..{self.prefill_rows[-1]} prompts, got {R}")
        Tb = self.bucket_for(max(len(p) for p in prompts))
        Rb = next(r for r in self.prefill_rows if R <= r)
        tokens = np.zeros((Rb, Tb), np.int32)
        lengths = np.full((Rb,), len(prompts[0]), np.int32)
        for r in range(Rb):
            prompt = prompts[r] if r < R else prompts[0]
            tokens[r, : len(prompt)] = prompt
            lengths[r] = len(prompt)
        return self._prefill_batch(params, tokens, lengths)

    def insert_batch(
        self,
        prefixes: PrefixBatch,
        state: DecodeState,
        entries: list[tuple[int, int, SlotSampling]],
    ) -> tuple[DecodeState, jax.Array]:
        """Starts samples `entries = [(prefix row, slot, sampling), ...]` (at most one per
        slot) in one call; returns the state and the packed `[2, N]` first tokens and
        log-probs (`unpack_outputs`), each entry's in its slot's column."""
        N = self.num_slots
        if len({slot for _, slot, _ in entries}) != len(entries) or len(entries) > N:
            raise ValueError(f"entries need distinct slots, at most {N}, got {entries}")
        cols = {
            "rows": np.zeros((N,), np.int32),
            "slots": np.full((N,), N, np.int32),  # N = padding, dropped
            "temperature": np.zeros((N,), np.float32),
            "top_k": np.zeros((N,), np.int32),
            "top_p": np.ones((N,), np.float32),
            "seed_hi": np.zeros((N,), np.uint32),
            "seed_lo": np.zeros((N,), np.uint32),
            "sample_index": np.zeros((N,), np.int32),
        }
        for m, (row, slot, s) in enumerate(entries):
            if not 0 <= slot < N:
                raise ValueError(f"slot must be in [0, {N}), got {slot}")
            hi, lo = sampling.split_seed(s.seed)
            for name, value in (
                ("rows", row),
                ("slots", slot),
                ("temperature", s.temperature),
                ("top_k", s.top_k),
                ("top_p", s.top_p),
                ("seed_hi", hi),
                ("seed_lo", lo),
                ("sample_index", s.sample_index),
            ):
                cols[name][m] = value
        return self._jits.insert_batch(prefixes, state, **cols)

    def split_params(self, params: Params) -> decode_layout.DecodeParams:
        """`decode_layout.decode_params(params)` in this engine's layout (a new split, not
        cached), laid out for its ``tensor`` size and, on a mesh, placed on it."""
        split = decode_layout.decode_params(
            params, self.config, out_major=self.out_major, shards=self.shards
        )
        if self.mesh.size > 1:
            split = jax.device_put(split, decode_layout.decode_shardings(split, self.mesh))
        return split

    def place_params(self, params: Params) -> Params:
        """`params` (stacked, on any devices) on this engine's devices, device to device: on
        a mesh, split over ``tensor`` as `sharding.INFERENCE_RULES` says."""
        if self.mesh.size == 1:
            return jax.device_put(params, self.mesh.devices.flat[0])
        shardings = sharding.param_shardings(params, self.mesh, sharding.INFERENCE_RULES)
        return jax.device_put(params, shardings)

    def decode_params(self, params: Params) -> decode_layout.DecodeParams:
        """`params` split per layer for the decode step; the split is cached, so calling this
        with the params of every step costs a tree flatten, and the copy happens once per
        weight version. Already split params are returned as they are."""
        if isinstance(params, decode_layout.DecodeParams):
            return params
        leaves = jax.tree.leaves(params)
        cached = self._split  # one read: another thread may replace it meanwhile
        if (
            cached is not None
            and len(cached[0]) == len(leaves)
            and all(a is b for a, b in zip(cached[0], leaves, strict=True))
        ):
            return cached[1]
        self._split = None  # let the old split go before the new one is made
        split = self.split_params(params)
        self._split = (leaves, split)
        return split

    def window_for(self, longest: int) -> int:
        """The smallest decode window for a step whose longest active slot has `longest`
        tokens in its cache (the step writes its fed token at that position)."""
        if not 0 <= longest < self.capacity:
            raise ValueError(f"longest must be in [0, capacity={self.capacity}), got {longest}")
        return next(w for w in self.decode_windows if longest < w)

    def generate(self, params: Params, state: DecodeState, window: int | None = None):
        """One decode step (`generate`) with `params` (split or not) for all slots,
        attending to the first `window` cache slots (one of `decode_windows`; None = all)."""
        return self._generate(self.decode_params(params), state, window=self._window(window))

    def generate_packed(self, params: Params, state: DecodeState, window: int | None = None):
        """`generate` returning (state, packed `[2, N]` tokens and log-probs): one array to
        copy out per step (`unpack_outputs`)."""
        return self._generate_packed(self.decode_params(params), state, window=self._window(window))

    def _window(self, window: int | None) -> int | None:
        if window is not None and window not in self.decode_windows:
            raise ValueError(f"window must be one of {self.decode_windows}, got {window}")
        return None if window == self.capacity else window  # one program for the whole cache

    def release(self, state: DecodeState, finished) -> DecodeState:
        return self._jits.release(state, jnp.asarray(finished, jnp.bool_))

    def recompute_cache(self, params: Params, state: DecodeState, tokens) -> DecodeState:
        """Recomputes the active slots' caches under `params` (`recompute_cache`) from
        `tokens [N, W]`, W one of `decode_windows` (one program per window used)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.shape[0] != self.num_slots or tokens.shape[1] not in self.decode_windows:
            raise ValueError(
                f"tokens must be [{self.num_slots}, W] with W in {self.decode_windows}, "
                f"got {tuple(tokens.shape)}"
            )
        return self._recompute(params, state, tokens)

    def warmup(
        self, params: Params, decode_params: decode_layout.DecodeParams | None = None
    ) -> None:
        """Compiles prefill and insert for every bucket, the decode step for every window
        and release (the decode step on `decode_params` if given, else on `params`' cached
        split)."""
        state = self.init_decode_state()
        for bucket in self.prefill_buckets:
            prefix = self.prefill(params, [0] * bucket)
            state, _, _ = self.insert(prefix, state, 0, SlotSampling())
        for window in self.decode_windows:
            state, tokens, _ = self.generate(
                params if decode_params is None else decode_params, state, window
            )
        state = self.release(state, jnp.ones((self.num_slots,), jnp.bool_))
        jax.block_until_ready((state, tokens))

    def warmup_batched(
        self, params: Params, decode_params: decode_layout.DecodeParams | None = None
    ) -> None:
        """Compiles what `InferenceHost` runs: `prefill_batch` and `insert_batch` for every
        (prefill rows, bucket), `generate_packed` for every window, and release, so that no
        admission pattern compiles while serving."""
        state = self.init_decode_state()
        greedy = SlotSampling()
        for bucket in self.prefill_buckets:
            for rows in self.prefill_rows:
                prefixes = self.prefill_batch(params, [[0] * bucket] * rows)
                state, packed = self.insert_batch(prefixes, state, [(0, 0, greedy)])
        for window in self.decode_windows:
            state, packed = self.generate_packed(
                params if decode_params is None else decode_params, state, window
            )
        state = self.release(state, jnp.ones((self.num_slots,), jnp.bool_))
        jax.block_until_ready((state, packed))
