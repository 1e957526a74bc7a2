"""Parameter trees as flat `"/"`-joined names: validation and chunking for weight pushes.

Inference layer (host-side shell).

A weight push is accepted whole or not at all: every tensor of the serving params must come
with the same name, shape and dtype, and no other tensor may come. Transfers never pickle:
a tensor travels as (name, dtype name, shape, raw native (little-endian) bytes) in chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.model import flatten_params  # the one weight naming; re-exported here

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


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


def iter_tensor_chunks(
    params: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[str, str, tuple[int, ...], int, int, bytes]]:
    """Yields (name, dtype, shape, chunk_index, num_chunks, data) for every tensor.

    Tensors are fetched to host one at a time, so a push never holds two copies of the
    whole model in host memory.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    for name, leaf in flatten_params(params).items():
        # Native byte order: little-endian on every platform JAX runs on.
        arr = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
        raw = arr.reshape(-1).view(np.uint8)
        num_chunks = max(1, -(-raw.size // chunk_bytes))
        for i in range(num_chunks):
            data = raw[i * chunk_bytes : (i + 1) * chunk_bytes].tobytes()
            yield name, arr.dtype.name, tuple(arr.shape), i, num_chunks, data


class TensorAssembler:
    """Collects chunked tensors against a reference tree, rejecting bad ones on arrival.

    Checks name, dtype and shape at the first chunk of each tensor and chunk order after,
    so a wrong push fails before its bytes pile up in memory.
    """

    def __init__(self, reference: Any):
        self._ref = {
            name: (tuple(np.shape(x)), np.dtype(jnp.result_type(x)))
            for name, x in flatten_params(reference).items()
        }
        self._buffers: dict[str, bytearray] = {}
        self._next_chunk: dict[str, int] = {}
        self._num_chunks: dict[str, int] = {}
        self.num_bytes = 0

    def add(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        chunk_index: int,
        num_chunks: int,
        data: bytes,
    ) -> None:
        if name not in self._ref:
            raise ValueError(f"weights rejected: unexpected tensor {name!r}")
        ref_shape, ref_dtype = self._ref[name]
        if tuple(shape) != ref_shape:
            raise ValueError(
                f"weights rejected: tensor {name!r} has shape {tuple(shape)}, "
                f"the serving model expects {ref_shape}"
            )
        if dtype_from_name(dtype) != ref_dtype:
            raise ValueError(
                f"weights rejected: tensor {name!r} has dtype {dtype}, "
                f"the serving model expects {ref_dtype.name}"
            )
        expected = self._next_chunk.get(name, 0)
        if chunk_index != expected:
            raise ValueError(
                f"weights rejected: tensor {name!r} chunk {chunk_index} arrived, "
                f"expected chunk {expected}"
            )
        if name in self._num_chunks and self._num_chunks[name] != num_chunks:
            raise ValueError(f"weights rejected: tensor {name!r} changed its chunk count")
        buf = self._buffers.setdefault(name, bytearray())
        nbytes = int(np.prod(ref_shape, dtype=np.int64)) * ref_dtype.itemsize
        if len(buf) + len(data) > nbytes:
            raise ValueError(f"weights rejected: tensor {name!r} sent more than its {nbytes} bytes")
        buf += data
        self.num_bytes += len(data)
        self._next_chunk[name] = expected + 1
        self._num_chunks[name] = num_chunks

    def finish(self) -> dict[str, np.ndarray]:
        """All tensors as numpy arrays; ValueError if any is missing or incomplete."""
        missing = [n for n in self._ref if n not in self._buffers]
        if missing:
            raise ValueError(
                f"weights rejected: missing tensors {missing[:8]}"
                + (" ..." if len(missing) > 8 else "")
            )
        out = {}
        for name, (shape, dtype) in self._ref.items():
            buf = self._buffers[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if len(buf) != nbytes or self._next_chunk[name] != self._num_chunks[name]:
                raise ValueError(
                    f"weights rejected: tensor {name!r} is incomplete "
                    f"({len(buf)} of {nbytes} bytes)"
                )
            out[name] = np.frombuffer(bytes(buf), dtype=dtype).reshape(shape)
        return out
