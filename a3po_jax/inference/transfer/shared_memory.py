"""Shared memory for weight pushes on one machine: memfd sets the host serves from, the raw
region a pusher copies the host's share of the layers into, and their offsets and views.

Inference layer (transfer).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import sys
from typing import Any

import numpy as np

from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.transfer.layout import LayerWindow, fill_options, fill_serving, layer_of
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import InferenceError

log = logging.getLogger(__name__)

# Shared-memory pushes need memfds and descriptor passing (Linux, Python >= 3.9).
SHARED_MEMORY = (
    sys.platform.startswith("linux")
    and hasattr(os, "memfd_create")
    and hasattr(socket, "send_fds")
    and hasattr(socket, "SO_PEERCRED")
)
SHARED = "shared_memory"  # the PUSH header's "transport" for a push through a shared set


def memfd_works() -> bool:
    """`SHARED_MEMORY`, and a memfd can be made here: a sandbox that refuses memfd_create
    (seccomp) leaves the host on TCP instead of failing every local push."""
    if not SHARED_MEMORY:
        return False
    try:
        os.close(os.memfd_create("a3po-weights-probe", os.MFD_CLOEXEC))
    except OSError as error:
        log.warning("memfd_create refused (%s): weight pushes go over TCP only", error)
        return False
    return True


def free_set(sets: list, specs: list[TensorSpec], arrays_of) -> Any:
    """The first of `sets` whose arrays fit `specs` and that no one else holds, or None
    (`sets` is emptied when the layout changed).

    The host's arrays made from a set hold each array's memory owner (`ndarray.base`) for
    as long as they live, including while a computation still reads them, so an owner
    referenced by its own array alone (reference count 2, with the call's argument) is free.
    Up to three sets are kept: serving, staged, and the one being received.
    """
    layout = [(s.name, s.shape, s.dtype) for s in specs]
    if sets and [(n, b.shape, b.dtype) for n, b in arrays_of(sets[0]).items()] != layout:
        for old in sets:
            if isinstance(old, SharedSet):
                old.close()
        sets.clear()
    for candidate in sets:
        if all(sys.getrefcount(b.base) <= 2 for b in arrays_of(candidate).values()):
            return candidate
    return None


class _Memfd:
    """A memfd of `size` bytes mapped here, with a random key a pusher caches its mapping by."""

    def __init__(self, size: int):
        self.key = secrets.token_hex(8)
        self.size = max(size, 1)
        self.fd = os.memfd_create(f"a3po-weights-{self.key}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self._map = mmap.mmap(self.fd, self.size)

    def close(self) -> None:
        """Closes the descriptor; the memory stays while an array (or a peer) maps it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedSet(_Memfd):
    """One set of receive buffers in a memfd: every serving tensor at an aligned offset, each
    a numpy array over its own slice of the mapping (so its `base` is its own, as
    `free_set` needs)."""

    def __init__(self, specs: list[TensorSpec]):
        self.offsets = aligned_offsets(specs)
        super().__init__(_end(specs, self.offsets))
        self.arrays = array_views(self._map, specs, self.offsets)


class RawRegion(_Memfd):
    """Where a pusher copies the weights of the layers the host lays out itself (layers
    ``first_layer`` and up of every stacked layer param, in the model's own layout). One
    per receiver: pushes install one at a time."""

    def __init__(self, params: list[TensorSpec], share: float):
        stacked = [p for p in params if p.name.startswith("layers/") and p.shape]
        self.params = params
        self.num_layers = stacked[0].shape[0] if stacked else 0
        self.first_layer = self.num_layers - round(share * self.num_layers)
        raw = [
            TensorSpec(p.name, p.dtype, (self.num_layers - self.first_layer, *p.shape[1:]))
            for p in stacked
        ]
        offsets = aligned_offsets(raw)
        super().__init__(_end(raw, offsets))
        self.offsets = {p.name: at for p, at in zip(raw, offsets, strict=True)}
        self.arrays = array_views(self._map, raw, offsets)

    def lay_out(
        self, out: dict[str, np.ndarray], specs: list[TensorSpec], layout: dict, layer: int
    ) -> None:
        """Writes the serving tensors of `layer` (``first_layer`` or later) into `out` from
        what the pusher copied here, as the pusher writes the other layers."""
        model = LayerWindow(self.arrays, self.first_layer)
        options = fill_options(layout)
        for spec in specs:
            if layer_of(spec.name) == layer:
                fill_serving(out[spec.name], spec.name, model, **options)


def _end(specs: list[TensorSpec], offsets: list[int]) -> int:
    return offsets[-1] + specs[-1].nbytes if specs else 0


def aligned_offsets(specs: list[TensorSpec]) -> list[int]:
    """Offsets of `specs` packed one after another, each at a multiple of `ALIGNMENT`."""
    offsets, at = [], 0
    for spec in specs:
        at += -at % weight_sync.ALIGNMENT
        offsets.append(at)
        at += spec.nbytes
    return offsets


def array_views(buffer: Any, specs: list[TensorSpec], offsets: list[int]) -> dict[str, np.ndarray]:
    """numpy arrays of `specs` at `offsets` of `buffer` (a writable mapping), each over a
    memoryview slice of its own."""
    whole = memoryview(buffer)
    return {
        s.name: np.frombuffer(whole[at : at + s.nbytes], np.uint8).view(s.dtype).reshape(s.shape)
        for s, at in zip(specs, offsets, strict=True)
    }


def check_offsets(
    offsets: Any, tensors: list[TensorSpec], size: Any, *, ordered: bool = True
) -> None:
    """The host's offsets place every tensor, aligned, inside its set (one after another
    when `ordered`)."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise InferenceError(f"the host's shared set has size {size!r}")
    if not (isinstance(offsets, list) and len(offsets) == len(tensors)):
        raise InferenceError("the host's shared set does not list one offset per tensor")
    end = 0
    for at, tensor in zip(offsets, tensors, strict=True):
        bad = not isinstance(at, int) or isinstance(at, bool) or at < (end if ordered else 0)
        if bad or at % weight_sync.ALIGNMENT or at + tensor.nbytes > size:
            raise InferenceError(f"the host's shared set places {tensor.name!r} at {at!r}")
        end = at + tensor.nbytes
