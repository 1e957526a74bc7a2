"""The decode engine as pure JAX functions: prefill, insert, generate over fixed slots.

Inference layer (engine). `engine_core.EngineCore` jits these functions and drives them.

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
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from a3po_jax import model as model_lib
from a3po_jax.inference.engine import decode_layout, sampling

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
    # One row of `prefill_batch`: the same model call, the same last position's logits.
    rows = prefill_batch(
        params,
        tokens[None, :],
        jnp.asarray(true_length, jnp.int32).reshape(1),
        config=config,
        cache_dtype=cache_dtype,
    )
    return Prefix(cache=rows.cache, last_logits=rows.last_logits[0])


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
    sampling_coords = (temperature, top_k, top_p, seed_hi, seed_lo, sample_index)
    state = _started(state, cache, set_at, token, jnp.ones((1,), jnp.int32), sampling_coords)
    return state, token[0], logprob[0]


_SAMPLING_COORDS = ("temperature", "top_k", "top_p", "seed_hi", "seed_lo", "sample_index")


def _started(state: DecodeState, cache, set_at, tokens, ones, sampling_coords) -> DecodeState:
    """`state` with the slots `set_at(array, values)` writes started: active, at step 1,
    their first tokens pending, their sampling coordinates (in `_SAMPLING_COORDS` order)."""
    coords = dict(zip(_SAMPLING_COORDS, sampling_coords, strict=True))
    return state.replace(
        cache=cache,
        tokens=set_at(state.tokens, tokens),
        active=set_at(state.active, ones.astype(jnp.bool_)),
        step=set_at(state.step, ones),
        **{name: set_at(getattr(state, name), value) for name, value in coords.items()},
    )


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
    sampling_coords = (temperature, top_k, top_p, seed_hi, seed_lo, sample_index)
    state = _started(state, cache, set_at, tokens, jnp.ones((N,), jnp.int32), sampling_coords)
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
