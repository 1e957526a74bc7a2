"""The serving layout on the wire, laid out with numpy on the host's CPU: what a weight push
carries, tensor by tensor, and the window a host reads the layers it lays out itself from.

Inference layer (transfer). The same values, in the same order, as the engine's
`decode_layout.decode_params` lays out on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# The name a host states in its weight port's handshake (`framing.py`) for the
# tensors it receives: `DecodeParams`' leaves under their `flatten_params` names. A pusher
# that lays out something else is refused by this name (change it with the layout).
WIRE_LAYOUT = "decode-params-v1"


def serving_source(
    name: str, model: Mapping[str, np.ndarray], *, out_major: bool, shards: int
) -> np.ndarray | None:
    """The model array (a view, no copy) that serving tensor `name` (a `flatten_params` name
    of `DecodeParams`) is as it stands, or None for the fused or transposed matrices, which
    `fill_serving` writes. `model` maps the stacked params' flat names to numpy arrays."""
    if name == "embed":
        return model["embed/embedding"]
    if name == "final_norm":
        return model["final_norm/scale"]
    if name == "lm_head":
        return model["lm_head/kernel"]
    layer, key = layer_key(name)
    if key.startswith(("attn/qkv/", "mlp/gate_up/")) or (
        out_major and key in ("attn/o_proj/kernel_t", "mlp/down_proj/kernel_t")
    ):
        return None
    return model["layers/" + key][layer]


def fill_serving(
    out: np.ndarray, name: str, model: Mapping[str, np.ndarray], *, out_major: bool, shards: int
) -> None:
    """Writes serving tensor `name` into `out` from the model's stacked arrays: the same
    values, in the same order, as `decode_layout.decode_params` lays out, computed with
    numpy on the pusher's side, so the host receives what its decode step reads."""
    src = serving_source(name, model, out_major=out_major, shards=shards)
    if src is not None:
        np.copyto(out, src, casting="no")
        return
    layer, key = layer_key(name)

    def kernel(proj: str) -> np.ndarray:  # layer's [I, O] kernel of `proj`
        k = model[f"layers/{proj}/kernel"][layer]
        return k.reshape(-1, k.shape[-1]) if proj == "attn/o_proj" else k.reshape(k.shape[0], -1)

    if key in ("attn/o_proj/kernel_t", "mlp/down_proj/kernel_t"):
        copy_transposed(out, kernel(key.rsplit("/", 1)[0]))
        return
    if key == "attn/qkv/bias":
        parts = [model[f"layers/attn/{x}_proj/bias"][layer].reshape(shards, -1) for x in "qkv"]
        _fill_shard_major(out, [p[s] for s in range(shards) for p in parts], axis=0)
        return
    projs = {
        "attn/qkv": ("attn/q_proj", "attn/k_proj", "attn/v_proj"),
        "mlp/gate_up": ("mlp/gate_proj", "mlp/up_proj"),
    }[key.rsplit("/", 1)[0]]
    pieces = [kernel(p).reshape(-1, shards, kernel(p).shape[1] // shards) for p in projs]
    blocks = [p[:, s] for s in range(shards) for p in pieces]  # [I, O_j / S] shard by shard
    if key.endswith("kernel_t"):  # rows: each block transposed, stacked
        at = 0
        for block in blocks:
            copy_transposed(out[at : at + block.shape[1]], block)
            at += block.shape[1]
        if at != out.shape[0]:
            raise ValueError(f"serving tensor {name!r} of shape {out.shape} got {at} rows")
    else:  # columns: the blocks side by side
        _fill_shard_major(out, blocks, axis=1)


def _fill_shard_major(out: np.ndarray, blocks: list[np.ndarray], axis: int) -> None:
    at = 0
    for block in blocks:
        n = block.shape[axis]
        np.copyto(out[at : at + n] if axis == 0 else out[:, at : at + n], block, casting="no")
        at += n
    if at != out.shape[axis]:
        raise ValueError(f"serving tensor of shape {out.shape} got {at} along axis {axis}")


# Side of the square tiles `copy_transposed` copies: a tile's rows and columns both stay in
# cache, where a whole-matrix transposed copy misses on every strided read (the measured
# gain over np.copyto(out, src.T) is in docs/log.md).
_TRANSPOSE_TILE = 128


def copy_transposed(out: np.ndarray, src: np.ndarray) -> None:
    """out [O, I] = src [I, O] transposed, tile by tile (the same values, copied exactly)."""
    if out.shape != src.shape[::-1]:
        raise ValueError(f"cannot write the transpose of {src.shape} into {out.shape}")
    rows, cols = src.shape
    t = _TRANSPOSE_TILE
    for i in range(0, rows, t):
        for j in range(0, cols, t):
            np.copyto(out[j : j + t, i : i + t], src[i : i + t, j : j + t].T, casting="no")


def layer_key(name: str) -> tuple[int, str]:
    """ "layers/<i>/<key>" -> (i, key); ValueError for any other name."""
    parts = name.split("/")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"{name!r} is not a serving tensor of DecodeParams")
    return int(parts[1]), "/".join(parts[2:])


def fill_options(layout: Mapping[str, Any]) -> dict[str, Any]:
    """`fill_serving`'s layout arguments from a SPEC's layout."""
    return {"out_major": bool(layout["out_major"]), "shards": int(layout["shards"])}


class LayerWindow(Mapping):
    """Stacked layer params of layers ``first`` and up, read by absolute layer index
    (``window[name][layer]``), as `fill_serving` reads the whole stack."""

    def __init__(self, arrays: dict[str, np.ndarray], first: int):
        self._arrays, self._first = arrays, first

    def __getitem__(self, name: str) -> _Shifted:
        return _Shifted(self._arrays[name], self._first)

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


class _Shifted:
    def __init__(self, array: np.ndarray, first: int):
        self._array, self._first = array, first

    def __getitem__(self, layer: int) -> np.ndarray:
        if layer < self._first:
            raise IndexError(f"layer {layer} is not in the window from layer {self._first}")
        return self._array[layer - self._first]


def layer_of(name: str) -> int:
    """The layer index of a serving tensor "layers/<i>/...", or -1 for the others."""
    try:
        return layer_key(name)[0]
    except ValueError:
        return -1
