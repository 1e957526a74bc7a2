"""The pusher's side of a weight push: `WeightSender`, over TCP or through shared memory.

Inference layer (transfer). The exchange is described in `framing.py`.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.transfer.framing import (
    WeightAuthError,
    answer,
    bytes_of,
    parse_json,
    recv_frame,
    recv_frame_with_fds,
    send_frame,
    send_json,
    specs_from,
)
from a3po_jax.inference.transfer.layout import (
    WIRE_LAYOUT,
    fill_options,
    fill_serving,
    layer_of,
    serving_source,
)
from a3po_jax.inference.transfer.shared_memory import (
    SHARED,
    SHARED_MEMORY,
    array_views,
    check_offsets,
)
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import HostClosedError, InferenceError


class WeightSender:
    """Pushes weights to one host's `WeightReceiver`.

    Args:
      address: the host's address (no port).
      port: its weight port (the gRPC server reports it in its stats as ``weight_port``).
      token: the host token.
      timeout: seconds to connect, and that the connection may stall.
      local_socket: the host's Unix socket (stats' ``weight_socket``): where it answers, the
        push goes through shared memory; a host on another machine does not, and the push
        takes the TCP port.
    """

    def __init__(
        self,
        address: str,
        port: int,
        token: str,
        *,
        timeout: float = 600.0,
        local_socket: str = "",
    ):
        self.address = address
        self.port = int(port)
        self.offered_socket = local_socket  # as the host reported it
        self.local_socket = local_socket if SHARED_MEMORY else ""  # "" once it did not answer
        self._key = token.encode()
        self._timeout = timeout
        self._specs: list[TensorSpec] | None = None
        # Host buffers for the serving tensors that are fused or transposed, reused (no page
        # faults per push); one push at a time per sender (`push_lock`).
        self._buffers: dict[str, np.ndarray] | None = None
        # The host's shared sets mapped here, by key: mapped once, written without page faults.
        self._maps: dict[str, mmap.mmap] = {}
        self.push_lock = threading.Lock()

    def specs(self) -> list[TensorSpec]:
        """The host's params (names, dtypes, shapes of the tree a push takes), asked once."""
        if self._specs is None:
            with self._connect() as conn:
                self._specs = self._handshake(conn).params
                send_frame(conn, b"BYE ")
        return self._specs

    def push(self, params: Any, version: int) -> dict[str, Any]:
        """Sends `params` (a tree or flat dict; jax or numpy arrays) stamped `version`; returns
        once the host has installed them, with the host's report plus ``send_s`` and
        ``layout_s``.

        The tensors go in the host's serving layout (`fill_serving`: q/k/v and
        gate/up fused, matrices out-major): over TCP laid out here tensor by tensor while
        the previous one is on the wire, through shared memory laid out straight into the
        host's buffers, so the host installs what it receives as it is. Floating-point
        tensors are cast to the host's dtypes first, on their own device.

        Raises ValueError (the host refused the weights: a name, shape, dtype or layout),
        WeightAuthError (the token), HostClosedError (the host is closing) or InferenceError
        (the connection).
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        flat = weight_sync.as_flat(params)
        try:
            with self.push_lock, self._connect() as conn:
                spec = self._handshake(conn)
                self._specs = spec.params
                weight_sync.check_names({s.name: s for s in self._specs}, flat)
                header = {
                    "version": version,
                    "layout": spec.layout,
                    "tensors": [s.to_json() for s in spec.wire],
                }
                if spec.shared_memory:
                    header["transport"] = SHARED
                send_json(conn, b"PUSH", header)
                model = _LazyHostArrays(flat, {s.name: s for s in self._specs})
                t0 = time.perf_counter()
                if spec.shared_memory:
                    layout_s = self._write_shared(conn, spec, model)
                else:
                    self._expect(conn, b"GO  ", raw=True)
                    t0 = time.perf_counter()
                    layout_s = self._send_tensors(conn, spec, model)
                t1 = time.perf_counter()
                report = self._expect(conn, b"DONE")
        except (OSError, ConnectionError) as err:
            raise InferenceError(
                f"weight push to {self.address}:{self.port} failed: {err}"
            ) from None
        return {**report, "send_s": t1 - t0, "layout_s": layout_s}

    def _send_tensors(self, conn: socket.socket, spec: _Spec, model: Mapping) -> float:
        """Lays out serving tensor i + 1 (in a thread) while tensor i is on the wire; returns
        the seconds spent laying out."""
        wire = spec.wire
        buffers = self._buffers = _reusable_buffers(self._buffers, wire)
        ready: list[np.ndarray | None] = [None] * len(wire)
        done = [threading.Event() for _ in wire]
        error: list[BaseException] = []
        seconds = [0.0]

        def lay_out_all() -> None:
            try:
                for i, tensor in enumerate(wire):
                    t0 = time.perf_counter()
                    source = serving_source(tensor.name, model, **spec.options)
                    if _fits(source, tensor):  # a view of the model's array: sent as it lies
                        ready[i] = source
                    else:
                        out = buffers[tensor.name]
                        fill_serving(out, tensor.name, model, **spec.options)
                        ready[i] = out
                    seconds[0] += time.perf_counter() - t0
                    done[i].set()
            except BaseException as err:  # noqa: BLE001 -- re-raised in the sending thread
                error.append(err)
                for event in done:
                    event.set()

        worker = threading.Thread(target=lay_out_all, name="weight-layout", daemon=True)
        worker.start()
        try:
            for i in range(len(wire)):
                done[i].wait()
                if error:
                    raise error[0]
                conn.sendall(bytes_of(ready[i]))
        finally:
            worker.join()
        return seconds[0]

    def _write_shared(self, conn: socket.socket, spec: _Spec, model: Mapping) -> float:
        """Waits for the host's GO and shared set, lays every serving tensor out straight
        into it (first copying the raw weights of the layers the host lays out itself, if
        it said so), and says SENT; returns the seconds spent."""
        (kind, payload), fds = recv_frame_with_fds(conn)
        try:
            if kind != b"GO  ":
                self._raise_for(kind, payload, b"GO  ")
            where = parse_json(payload, "GO")
            first, last = _host_layers(where.get("host_layers"))
            if len(fds) != (2 if first < last else 1):
                raise InferenceError(f"host {self.address} sent {len(fds)} descriptors")
            offsets = where.get("offsets")
            check_offsets(offsets, spec.wire, where.get("size"))
            mapped = self._map(where.get("set"), where.get("size"), fds[0])
            if first < last:
                raw = self._map(where.get("raw_set"), where.get("raw_size"), fds[1])
        finally:
            for fd in fds:
                os.close(fd)
        t0 = time.perf_counter()
        if first < last:  # the host lays out these layers itself: their raw weights first
            self._write_raw(conn, raw, where.get("raw"), model, first, last)
        views = array_views(mapped, spec.wire, offsets)
        for tensor in spec.wire:
            if not first <= layer_of(tensor.name) < last:
                fill_serving(views[tensor.name], tensor.name, model, **spec.options)
        seconds = time.perf_counter() - t0
        del views
        send_frame(conn, b"SENT")
        return seconds

    def _map(self, key: Any, size: Any, fd: int) -> mmap.mmap:
        """The host's memfd `key` mapped here: mapped once, reused while the host uses it."""
        if not (isinstance(key, str) and isinstance(size, int) and size > 0):
            raise InferenceError(f"host {self.address} named no shared set ({key!r}, {size!r})")
        if key not in self._maps:
            for old in list(self._maps)[:-4]:  # the host keeps three sets and a raw region
                del self._maps[old]  # unmapped once its last view is gone
            self._maps[key] = mmap.mmap(fd, size)
        return self._maps[key]

    def _write_raw(
        self,
        conn: socket.socket,
        mapped: mmap.mmap,
        raw: Any,
        model: Mapping,
        first: int,
        last: int,
    ) -> None:
        """Copies layers [first, last) of each stacked layer param where the host's GO
        placed them (the model's own layout, the host's dtypes), saying RAW after each
        layer so that the host lays it out while the next is copied."""
        if not isinstance(raw, list):
            raise InferenceError("the host's GO shares layers but names no raw region")
        specs, offsets = [], []
        by_name = {s.name: s for s in self._specs or []}
        for item in raw:
            name, at = item if isinstance(item, list) and len(item) == 2 else (None, None)
            param = by_name.get(name)
            if param is None or not param.shape or param.shape[0] < last:
                raise InferenceError(f"the host's raw region names {name!r}")
            specs.append(TensorSpec(name, param.dtype, (last - first, *param.shape[1:])))
            offsets.append(at)
        check_offsets(offsets, specs, len(mapped), ordered=False)
        views = array_views(mapped, specs, offsets)
        for layer in range(first, last):
            for name, view in views.items():
                np.copyto(view[layer - first], model[name][layer], casting="no")
            send_frame(conn, b"RAW ")

    def _connect(self) -> socket.socket:
        if self.local_socket:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(self._timeout)
            try:
                local.connect("\0" + self.local_socket)
                return local
            except OSError:  # another machine (or namespace): the TCP port
                local.close()
                self.local_socket = ""
        try:
            conn = socket.create_connection((self.address, self.port), timeout=self._timeout)
        except OSError as err:
            raise HostClosedError(
                f"no weight receiver at {self.address}:{self.port}: {err}"
            ) from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _handshake(self, conn: socket.socket) -> _Spec:
        """The host's SPEC: its layout, params, serving tensors in wire order, and whether it
        offers shared memory on this connection."""
        answer(conn, self._key, f"{self.address}:{self.port}")
        spec = parse_json(self._expect(conn, b"SPEC", raw=True), "SPEC")
        layout = spec.get("layout")
        if not (isinstance(layout, dict) and layout.get("name") == WIRE_LAYOUT):
            name = layout.get("name") if isinstance(layout, dict) else layout
            raise ValueError(
                f"weights not sent: the host at {self.address}:{self.port} receives layout "
                f"{name!r}, this pusher sends {WIRE_LAYOUT!r} (pusher and host "
                "must run the same weight layout)"
            )
        return _Spec(
            layout=layout,
            params=specs_from({"tensors": spec.get("params")}, "SPEC's params"),
            wire=specs_from(spec, "SPEC"),
            shared_memory=spec.get("shared_memory") is True and conn.family == socket.AF_UNIX,
        )

    def _expect(self, conn: socket.socket, kind: bytes, raw: bool = False) -> Any:
        got, payload = recv_frame(conn)
        if got != kind:
            self._raise_for(got, payload, kind)
        return payload if raw else parse_json(payload, kind.decode().strip())

    def _raise_for(self, got: bytes, payload: bytes, expected: bytes) -> None:
        """Raises the host's ERR as its kind of error, or says what frame came instead."""
        if got == b"ERR ":
            err = parse_json(payload, "ERR")
            message, what = str(err.get("message")), err.get("kind")
            if what == "auth":
                raise WeightAuthError(f"weight push to {self.address}: {message}")
            if what == "closed":
                raise HostClosedError(message)
            raise ValueError(message)
        raise InferenceError(f"expected a {expected!r} frame from the host, got {got!r}")


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a host's SPEC says to a pusher."""

    layout: dict
    params: list[TensorSpec]  # the model's tree
    wire: list[TensorSpec]  # the serving tensors, in the order they go
    shared_memory: bool  # the host offers a shared set on this connection

    @property
    def options(self) -> dict[str, Any]:
        """`fill_serving`'s layout arguments."""
        return fill_options(self.layout)


def _host_layers(value: Any) -> tuple[int, int]:
    """The GO's ``host_layers`` [first, last) (none when absent)."""
    if value is None:
        return 0, 0
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] <= value[1]
    ):
        raise InferenceError(f"the host's GO has host_layers {value!r}")
    return value[0], value[1]


def _fits(array: np.ndarray | None, spec: TensorSpec) -> bool:
    """Whether `array` can go on the wire as it is (C-contiguous, the spec's dtype and shape)."""
    return (
        array is not None
        and array.dtype == spec.dtype
        and array.shape == spec.shape
        and array.flags.c_contiguous
    )


class _LazyHostArrays(Mapping):
    """The pushed params by name as numpy arrays in the host's dtypes, each made on first
    read (`weight_sync.host_array`: a view where the leaf already is one, else a cast or a
    copy off its device), so the first tensors go on the wire before the last are read."""

    def __init__(self, flat: dict, specs: dict[str, TensorSpec]):
        self._flat, self._specs, self._arrays = flat, specs, {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = weight_sync.host_array(self._flat[name], self._specs[name])
        return self._arrays[name]

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _reusable_buffers(
    buffers: dict[str, np.ndarray] | None, specs: list[TensorSpec]
) -> dict[str, np.ndarray]:
    """`buffers` if they fit `specs` (names, shapes, dtypes, order), else new aligned ones."""
    if buffers is not None and [(n, b.shape, b.dtype) for n, b in buffers.items()] == [
        (s.name, s.shape, s.dtype) for s in specs
    ]:
        return buffers
    return {s.name: weight_sync.aligned_empty(s.shape, s.dtype) for s in specs}
