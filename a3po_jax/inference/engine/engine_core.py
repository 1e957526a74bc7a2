"""`EngineCore`: the engine's jitted programs for one model config and one slot layout.

Inference layer (engine).

The functions it runs are pure JAX, in `steps.py`; here are their jits (the decode state
donated, so the KV cache is updated in place), their shardings on an inference mesh, the
prompt buckets and attention windows, and the per-layer split of the weights the decode step
reads. Nothing here knows about threads, queues or versions: the host (`host.py`) and the
JetStream adapter (`jetstream_engine.py`) drive it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from a3po_jax import model as model_lib
from a3po_jax.inference.engine import decode_layout, sampling
from a3po_jax.inference.engine.steps import (
    DecodeState,
    Params,
    Prefix,
    PrefixBatch,
    SlotSampling,
    generate,
    generate_packed,
    init_decode_state,
    insert,
    insert_batch,
    prefill,
    prefill_batch,
    recompute_cache,
    release,
)
from a3po_jax.parallel import sharding


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
        self._split_jits: dict = {}  # the mesh's layout programs, by the params' shapes

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

        if self.mesh.size == 1:
            return self._layout(params)
        # Laid out straight into the mesh's shardings, on its devices: a `device_put` of a
        # layout placed as XLA chose would reshard through host memory.
        key = _shapes_key(params)
        if key not in self._split_jits:
            self._split_jits[key] = jax.jit(self._layout, out_shardings=self._shardings(params))
        return self._split_jits[key](params)

    def _layout(self, params: Params) -> decode_layout.DecodeParams:
        return decode_layout.decode_params(
            params, self.config, out_major=self.out_major, shards=self.shards
        )

    def _shardings(self, params: Params) -> decode_layout.DecodeParams:
        """The mesh's shardings of every leaf of ``params``' split (the layout's own checks
        run here, on shapes)."""
        return decode_layout.decode_shardings(jax.eval_shape(self._layout, params), self.mesh)

    def place_and_split(self, params: Params) -> decode_layout.DecodeParams:
        """`params` (stacked, on any devices) placed on this engine's devices and split as
        `split_params` does, device to device. On a mesh of several devices it goes one
        layer at a time (slice on the source, copy, lay out into the mesh's shardings), so a
        device holds its share of the split plus one layer in transit, never the whole placed
        model beside the split: at tensor T about 1/T of the model per device beyond the
        copy it serves (docs/scale-out.md)."""
        if self.mesh.size == 1:
            return self.split_params(self.place_params(params))
        key = ("by layer", *_shapes_key(params))
        if key not in self._split_jits:
            self._split_jits[key] = self._layer_programs(params)
        take, lay_out, out = self._split_jits[key]
        stacked = params["layers"]
        on_devices = all(isinstance(x, jax.Array) for x in jax.tree.leaves(stacked))
        # The layer index lives beside the weights (a host scalar would be a transfer).
        index = _zero_beside(jax.tree.leaves(stacked)[0]) if on_devices else None
        layers = []
        for i in range(self.config.n_layers):
            if on_devices:
                one, index = take(stacked, index)
            else:  # host data (a checkpoint read into numpy): a view, then a load
                one = jax.tree.map(lambda x, i=i: x[i : i + 1], stacked)
            layers.append(lay_out(self.place_params({"layers": one})["layers"]))
        lm_head = None if out.lm_head is None else params["lm_head"]["kernel"]
        return dataclasses.replace(
            out,
            embed=sharding.copy_to_sharding(params["embed"]["embedding"], out.embed),
            layers=tuple(layers),
            final_norm=sharding.copy_to_sharding(params["final_norm"]["scale"], out.final_norm),
            lm_head=None if lm_head is None else sharding.copy_to_sharding(lm_head, out.lm_head),
        )

    def _layer_programs(self, params: Params):
        """(slice layer i of the stacked layers on their devices, lay one placed layer out
        into the mesh's shardings, the whole split's shardings) for `place_and_split`."""
        out = self._shardings(params)

        def take(layers, i):  # (layer i as a stack of one, i + 1), on the layers' devices
            return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), layers), i + 1

        lay_out = jax.jit(
            functools.partial(
                decode_layout.layer_layout, out_major=self.out_major, shards=self.shards
            ),
            out_shardings=out.layers[0],
        )
        return jax.jit(take), lay_out, out

    def place_params(self, params: Params) -> Params:
        """`params` (stacked, on any devices) on this engine's devices, device to device
        (`sharding.device_to_device`: no byte through host memory, from a trainer's FSDP
        shards too): on a mesh, split over ``tensor`` as `sharding.INFERENCE_RULES` says."""
        if self.mesh.size == 1:
            device = self.mesh.devices.flat[0]
            whole = jax.tree.map(lambda _: replicated(self.mesh), params)
            # On its device as one: params already there are aliased, not copied.
            return jax.device_put(sharding.device_to_device(params, whole), device)
        shardings = sharding.param_shardings(params, self.mesh, sharding.INFERENCE_RULES)
        return sharding.device_to_device(params, shardings)

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


def _zero_beside(x: jax.Array) -> jax.Array:
    """An int32 zero on the devices of ``x`` (replicated), made there: no host transfer."""
    where = x.sharding
    if isinstance(where, NamedSharding):
        where = NamedSharding(where.mesh, PartitionSpec())
    return jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=where)()


def _shapes_key(params: Params) -> tuple:
    """A cache key of ``params``' tree and its leaves' shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(params)
    return (treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
