"""Parameter trees as flat `"/"`-joined names: validation and host staging for weight pushes.

Inference layer (transfer).

A weight push is accepted whole or not at all: every tensor of the serving params must come
with the same name, shape and dtype, and no other tensor may come. Transfers never pickle:
a tensor travels as (name, dtype name, shape) and its raw native (little-endian) bytes
(`sender.py`, `receiver.py`).

Host buffers for pushes are allocated once and reused (`StagingBuffers`): a fresh 0.5 GB
buffer per push costs a page fault per 4 KiB page on first touch, which on a CPU costs
about as much as the copy itself (docs/performance.md). They are 64-byte aligned, so that
`jax.device_put` of one on a CPU aliases it instead of copying.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.model import flatten_params  # the one weight naming; re-exported here

# Host buffers start at a multiple of this: XLA:CPU aliases (does not copy) such numpy arrays.
ALIGNMENT = 64


def unflatten_params(flat: Mapping[str, Any], like: Any) -> Any:
    """The pytree of `like` with its leaves taken from `flat` by name (names must match)."""
    names = flatten_params(like)  # the names in `like`'s leaf order
    check_names(names, flat)
    return jax.tree_util.tree_unflatten(jax.tree.structure(like), [flat[n] for n in names])


def check_names(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> None:
    missing = [n for n in reference if n not in candidate]
    unexpected = [n for n in candidate if n not in reference]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(
                f"unexpected tensors {unexpected[:8]}" + (" ..." if len(unexpected) > 8 else "")
            )
        raise ValueError("weights rejected: " + "; ".join(parts))


def check_params_match(reference: Any, candidate: Any) -> None:
    """Raises ValueError naming the first tensor whose name, shape or dtype differs."""
    ref = flatten_params(reference)
    cand = flatten_params(candidate)
    check_names(ref, cand)
    for name, r in ref.items():
        c = cand[name]
        r_shape, c_shape = tuple(np.shape(r)), tuple(np.shape(c))
        if r_shape != c_shape:
            raise ValueError(
                f"weights rejected: tensor {name!r} has shape {c_shape}, "
                f"the serving model expects {r_shape}"
            )
        r_dtype, c_dtype = jnp.result_type(r), jnp.result_type(c)
        if r_dtype != c_dtype:
            raise ValueError(
                f"weights rejected: tensor {name!r} has dtype {c_dtype}, "
                f"the serving model expects {r_dtype}"
            )


def dtype_from_name(name: str) -> np.dtype:
    """numpy dtype for a name like "float32" or "bfloat16" (ml_dtypes via jax.numpy)."""
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError as e:
        raise ValueError(f"unknown dtype name {name!r}") from e


def as_flat(params: Any) -> dict[str, Any]:
    """`params` as ``{name: array}``: a tree is flattened (`flatten_params`); a mapping whose
    values are all arrays is taken as already flat."""
    if isinstance(params, Mapping) and not any(isinstance(v, Mapping) for v in params.values()):
        return dict(params)
    return flatten_params(params)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array whose data starts at a multiple of `ALIGNMENT` bytes; a
    view whose `base` owns the memory (what an aliasing `jax.device_put` holds on to)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a weight push."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_json(self) -> list:
        return [self.name, self.dtype.name, list(self.shape)]

    @classmethod
    def from_json(cls, item: Any) -> TensorSpec:
        """From `to_json`'s list; ValueError naming what is malformed."""
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"a tensor spec is [name, dtype, shape], got {item!r}")
        name, dtype, shape = item
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise ValueError(f"a tensor spec's name and dtype are strings, got {item!r}")
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise ValueError(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
        return cls(name, dtype_from_name(dtype), tuple(shape))


def tensor_specs(params: Any) -> list[TensorSpec]:
    """The `TensorSpec` of every leaf (arrays or `jax.ShapeDtypeStruct`s), in tree order."""
    return [
        TensorSpec(name, _dtype_of(leaf), tuple(np.shape(leaf)))
        for name, leaf in flatten_params(params).items()
    ]


def _dtype_of(leaf: Any) -> np.dtype:
    """A leaf's own dtype (a numpy float64 stays float64; jax would canonicalise it)."""
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.dtype(jnp.result_type(leaf))


def check_specs_match(reference: list[TensorSpec], candidate: list[TensorSpec]) -> None:
    """Raises ValueError naming the first tensor whose name, shape or dtype differs (the
    candidate must list the reference's tensors, in its order)."""
    check_names({s.name: s for s in reference}, {s.name: s for s in candidate})
    for ref, cand in zip(reference, candidate, strict=True):
        if ref.name != cand.name:
            raise ValueError(
                f"weights rejected: tensor {cand.name!r} came where {ref.name!r} was expected "
                "(tensors go in the serving model's order)"
            )
        if ref.shape != cand.shape:
            raise ValueError(
                f"weights rejected: tensor {ref.name!r} has shape {cand.shape}, "
                f"the serving model expects {ref.shape}"
            )
        if ref.dtype != cand.dtype:
            raise ValueError(
                f"weights rejected: tensor {ref.name!r} has dtype {cand.dtype.name}, "
                f"the serving model expects {ref.dtype.name}"
            )


def host_array(leaf: Any, spec: TensorSpec) -> np.ndarray:
    """`leaf` (a jax or numpy array) as a numpy array of the spec's dtype: the leaf itself or
    a view of it where it already is one (a CPU jax array), else cast first on its own
    device (a float32 model served in bfloat16 moves half the bytes). ValueError names a
    shape or a non-float dtype that differs from the spec."""
    if tuple(np.shape(leaf)) != spec.shape:
        raise ValueError(
            f"weights rejected: tensor {spec.name!r} has shape {tuple(np.shape(leaf))}, "
            f"the serving model expects {spec.shape}"
        )
    dtype = _dtype_of(leaf)
    if dtype != spec.dtype:
        if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(spec.dtype, jnp.floating)):
            raise ValueError(
                f"weights rejected: tensor {spec.name!r} has dtype {dtype.name}, "
                f"the serving model expects {spec.dtype.name}"
            )
        leaf = leaf.astype(spec.dtype)
    # A CPU jax array reads as a numpy view: no copy.
    return np.asarray(jax.device_get(leaf))


def copy_to_host(buffer: np.ndarray, leaf: Any, spec: TensorSpec) -> None:
    """Copies `leaf` (a jax or numpy array) into `buffer`, cast to the spec's dtype first on
    its own device (`host_array`)."""
    np.copyto(buffer, host_array(leaf, spec), casting="no")


class Staged:
    """One staged copy of the weights: `arrays` maps each name to its host buffer, in the
    serving model's order. Valid while held (`StagingBuffers.hold` / `release`)."""

    def __init__(self, arrays: dict[str, np.ndarray], slot: int):
        self.arrays = arrays
        self.slot = slot

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class StagingBuffers:
    """Host copies of parameter trees in buffers allocated once, `sets` of them used in turn.

    `stage(params)` copies the params into a set no one holds and returns it held once by the
    caller; readers (a push to each host) `hold` it and `release` it when done. With two sets
    the newest weights can stay held (for a host that returns later) while the next ones are
    staged. When every set is held, a new one is allocated up to `max_sets`, and only then
    does `stage` wait: a push stalled on a frozen host holds its set until its connection
    times out, and the trainer must not wait for that.
    """

    def __init__(self, specs: list[TensorSpec], sets: int = 2, max_sets: int | None = None):
        max_sets = sets if max_sets is None else max_sets
        if sets < 1 or max_sets < sets:
            raise ValueError(f"need 1 <= sets <= max_sets, got sets={sets}, max_sets={max_sets}")
        self.specs = list(specs)
        self.max_sets = int(max_sets)
        self._sets: list[dict[str, np.ndarray] | None] = [None] * sets
        self._holds = [0] * sets
        self._cond = threading.Condition()

    @property
    def num_sets(self) -> int:
        """Sets allocated or reserved so far."""
        with self._cond:
            return len(self._holds)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def stage(self, params: Any, timeout: float | None = None) -> Staged:
        """Copies `params` (a tree or flat dict with the specs' names) into a free set; held
        once for the caller. ValueError names a missing, extra or mis-shaped tensor; a dtype
        differing from the spec is cast when both are floating point."""
        flat = as_flat(params)
        check_names({s.name: s for s in self.specs}, flat)
        with self._cond:
            free = lambda: 0 in self._holds or len(self._holds) < self.max_sets  # noqa: E731
            if not self._cond.wait_for(free, timeout=timeout):
                raise TimeoutError(f"no free staging buffers after {timeout} s")
            if 0 not in self._holds:
                self._sets.append(None)
                self._holds.append(0)
            slot = self._holds.index(0)
            self._holds[slot] = 1
        try:
            buffers = self._sets[slot]
            if buffers is None:
                buffers = {s.name: aligned_empty(s.shape, s.dtype) for s in self.specs}
                self._sets[slot] = buffers
            for spec in self.specs:
                copy_to_host(buffers[spec.name], flat[spec.name], spec)
        except BaseException:
            self.release(Staged({}, slot))
            raise
        return Staged(buffers, slot)

    def hold(self, staged: Staged) -> None:
        with self._cond:
            if self._holds[staged.slot] <= 0:
                raise RuntimeError("hold() of staged weights that were already released")
            self._holds[staged.slot] += 1

    def release(self, staged: Staged) -> None:
        with self._cond:
            if self._holds[staged.slot] <= 0:
                raise RuntimeError("release() of staged weights that are not held")
            self._holds[staged.slot] -= 1
            self._cond.notify_all()
