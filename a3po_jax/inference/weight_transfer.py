"""Weight pushes over a TCP connection of their own: raw tensor bytes, no RPC framing.

Inference layer (host-side shell).

A gRPC message costs several copies of its bytes on each side (serialisation, the
transport's buffers, parsing), which held pushes to a fraction of what the link carries. Here
the sender writes each tensor's bytes straight from a host buffer into the socket and the
receiver reads them straight into the buffers the host then serves from (`recv_into`), so
each side copies a byte once more than the kernel does (docs/performance.md has the figures).

The tensors travel in the host's serving layout (`decode_layout.DecodeParams`: q/k/v and
gate/up fused, the layer matrices out-major where the host's decode step wants them), laid
out by the pusher (`decode_layout.fill_serving`, tensor by tensor while the previous one is
on the wire): the host places what it received on its device as it is, with no transform
of its own between the last byte and serving.

The exchange, one push per connection (frames are a 4-byte kind, an 8-byte little-endian
length and a payload)::

    host   -> pusher   MAGIC + 32-byte nonce
    pusher -> host     HMAC-SHA256(token, nonce)              (the token never travels)
    host   -> pusher   SPEC  {"layout": {"name", "out_major", "shards"},
                              "tensors": [[name, dtype, shape], ...],   (serving layout)
                              "params": [[name, dtype, shape], ...]}    (the model's tree)
    pusher -> host     PUSH  {"version": v, "layout": ..., "tensors": [...]}  or  BYE
    host   -> pusher   GO                                      (or ERR {"kind", "message"})
    pusher -> host     every serving tensor's raw bytes, in the spec's order
    host   -> pusher   DONE  {"version", "bytes", "receive_s", "install_s"}  (or ERR)

The layout is named (`decode_layout.WIRE_LAYOUT`): a pusher and a host of different layouts
refuse each other by that name before any tensor byte moves. The host validates the layout,
names, shapes and dtypes before any byte is read, and installs the weights only once every
byte arrived: a push that fails or breaks off leaves the serving weights as they were. The
pusher casts floating-point tensors to the host's dtypes first (a host that serves bfloat16
receives half the bytes of a float32 trainer's weights). Nothing is pickled; the bind
address follows the gRPC server's (127.0.0.1 unless told).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from a3po_jax.inference import decode_layout, weight_sync
from a3po_jax.inference.types import HostClosedError, InferenceError
from a3po_jax.inference.weight_sync import TensorSpec

log = logging.getLogger(__name__)

MAGIC = b"A3PW\x01"
_NONCE_BYTES = 32
_FRAME = struct.Struct("<4sQ")
_MAX_HEADER_BYTES = 64 << 20  # a manifest of a few thousand tensors is a few hundred KiB
# recv_into asks for at most this much per call (the kernel returns what it has).
_RECV_BYTES = 16 << 20
# Seconds a connection may take to prove the token: a stranger cannot hold a thread long.
AUTH_TIMEOUT_S = 10.0


class WeightAuthError(InferenceError):
    """The host refused the token."""


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _send_frame(conn: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    conn.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _send_json(conn: socket.socket, kind: bytes, value: Any) -> None:
    _send_frame(conn, kind, json.dumps(value).encode())


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    _recv_into(conn, memoryview(out))
    return bytes(out)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, _RECV_BYTES))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def _recv_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    kind, length = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"frame {kind!r} of {length} bytes exceeds {_MAX_HEADER_BYTES}")
    return kind, _recv_exact(conn, length)


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def _parse_json(payload: bytes, what: str) -> dict:
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _specs_from(value: dict, what: str) -> list[TensorSpec]:
    tensors = value.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError(f"{what} needs a 'tensors' list")
    return [TensorSpec.from_json(item) for item in tensors]


# ---------------------------------------------------------------------------------------------
# The host's side


class WeightReceiver:
    """Accepts weight pushes for `host` on a TCP port of their own (a thread per connection;
    one push installs at a time).

    Args:
      host: the serving `InferenceHost` (``params_spec``, ``serving_layout``,
        ``serving_specs``, ``install_serving``).
      token: the host token; a pusher proves it knows it (HMAC of a fresh nonce).
      bind: address to listen on (the gRPC server's).
      port: 0 picks a free one (`port` says which).
      timeout: seconds a connection may stall before it is dropped.
    """

    def __init__(
        self, host: Any, token: str, *, bind: str = "127.0.0.1", port: int = 0, timeout=600.0
    ):
        if not token:
            raise ValueError("token must be a non-empty string")
        self._host = host
        self._key = token.encode()
        self._timeout = timeout
        self._sock = socket.create_server((bind, port))
        self.port = self._sock.getsockname()[1]
        self._install_lock = threading.Lock()
        # Sets of receive buffers. The host serves from a set as it is (a CPU aliases it), so a
        # set is filled again only once nothing but this list holds it (`_free_buffers`):
        # reused, a set costs no page faults per push, which for fresh memory cost as much
        # as the receive itself (docs/performance.md).
        self._sets: list[dict[str, np.ndarray]] = []
        self._closed = threading.Event()
        self._counts = {"pushes": 0, "bytes": 0, "receive_s": 0.0, "install_s": 0.0}
        self._thread = threading.Thread(target=self._accept, name="weight-receiver", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, float]:
        """Pushes installed, their bytes, and seconds spent receiving and installing (totals)."""
        return dict(self._counts)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="weight-push", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(min(self._timeout, AUTH_TIMEOUT_S))  # the long one once proven
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._exchange(conn)
            except (ValueError, HostClosedError) as err:
                kind = "closed" if isinstance(err, HostClosedError) else "invalid"
                log.warning("weight push refused: %s", err)
                _try_send_error(conn, kind, str(err))
            except WeightAuthError as err:
                log.warning("weight push refused: %s", err)
                _try_send_error(conn, "auth", str(err))
            except (OSError, ConnectionError) as err:
                log.warning("weight push broke off (serving weights unchanged): %s", err)

    def _exchange(self, conn: socket.socket) -> None:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        conn.sendall(MAGIC + nonce)
        if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self._key, nonce)):
            raise WeightAuthError("missing or wrong host token")
        conn.settimeout(self._timeout)
        layout = self._host.serving_layout()
        specs = self._host.serving_specs()
        params = weight_sync.tensor_specs(self._host.params_spec)
        _send_json(
            conn,
            b"SPEC",
            {
                "layout": layout,
                "tensors": [s.to_json() for s in specs],
                "params": [s.to_json() for s in params],
            },
        )
        kind, payload = _recv_frame(conn)
        if kind == b"BYE ":
            return
        if kind != b"PUSH":
            raise ValueError(f"expected a PUSH frame, got {kind!r}")
        header = _parse_json(payload, "the PUSH header")
        version = header.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        if header.get("layout") != layout:
            raise ValueError(
                f"weights rejected: the pusher lays them out as {header.get('layout')!r}, this "
                f"host receives {layout!r} (pusher and host must run the same weight layout)"
            )
        weight_sync.check_specs_match(specs, _specs_from(header, "the PUSH header"))
        with self._install_lock:
            _send_frame(conn, b"GO  ")
            buffers = self._free_buffers(specs)
            t0 = time.perf_counter()
            for spec in specs:
                _recv_into(conn, _bytes_of(buffers[spec.name]))
            t1 = time.perf_counter()
            # Every byte is here: only now does anything reach the host.
            self._host.install_serving(buffers, version)
            t2 = time.perf_counter()
            nbytes = sum(s.nbytes for s in specs)
            self._counts["pushes"] += 1
            self._counts["bytes"] += nbytes
            self._counts["receive_s"] += t1 - t0
            self._counts["install_s"] += t2 - t1
        _send_json(
            conn,
            b"DONE",
            {"version": version, "bytes": nbytes, "receive_s": t1 - t0, "install_s": t2 - t1},
        )

    def _free_buffers(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        """A set of receive buffers for `specs` that no one else holds, else a new one.

        The host's arrays made from a set hold its memory's owner (`ndarray.base`) for as
        long as they live, including while a computation still reads them, so an owner
        referenced by its own array alone (reference count 2, with the call's argument) is
        free. Up to three sets are kept: serving, staged, and the one being received.
        """
        layout = [(s.name, s.shape, s.dtype) for s in specs]
        if self._sets and [(n, b.shape, b.dtype) for n, b in self._sets[0].items()] != layout:
            self._sets = []
        for buffers in self._sets:
            if all(sys.getrefcount(b.base) <= 2 for b in buffers.values()):
                return buffers
        buffers = {s.name: weight_sync.aligned_empty(s.shape, s.dtype) for s in specs}
        self._sets = [*self._sets[-2:], buffers]
        return buffers


def _try_send_error(conn: socket.socket, kind: str, message: str) -> None:
    try:
        _send_json(conn, b"ERR ", {"kind": kind, "message": message})
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The pusher's side


class WeightSender:
    """Pushes weights to one host's `WeightReceiver`.

    Args:
      address: the host's address (no port).
      port: its weight port (the gRPC server reports it in its stats as ``weight_port``).
      token: the host token.
      timeout: seconds to connect, and that the connection may stall.
    """

    def __init__(self, address: str, port: int, token: str, *, timeout: float = 600.0):
        self.address = address
        self.port = int(port)
        self._key = token.encode()
        self._timeout = timeout
        self._specs: list[TensorSpec] | None = None
        # Host buffers for the serving tensors that are fused or transposed, reused (no page
        # faults per push); one push at a time per sender (`push_lock`).
        self._buffers: dict[str, np.ndarray] | None = None
        self.push_lock = threading.Lock()

    def specs(self) -> list[TensorSpec]:
        """The host's params (names, dtypes, shapes of the tree a push takes), asked once."""
        if self._specs is None:
            with self._connect() as conn:
                self._specs = self._handshake(conn)[1]
                _send_frame(conn, b"BYE ")
        return self._specs

    def push(self, params: Any, version: int) -> dict[str, Any]:
        """Sends `params` (a tree or flat dict; jax or numpy arrays) stamped `version`; returns
        once the host has installed them, with the host's report plus ``send_s``.

        The tensors go in the host's serving layout (`decode_layout.fill_serving`: q/k/v and
        gate/up fused, matrices out-major), laid out here tensor by tensor while the previous
        one is on the wire, so the host installs what it receives as it is. Floating-point
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
                layout, self._specs, wire = self._handshake(conn)
                weight_sync.check_names({s.name: s for s in self._specs}, flat)
                header = {
                    "version": version,
                    "layout": layout,
                    "tensors": [s.to_json() for s in wire],
                }
                _send_json(conn, b"PUSH", header)
                self._expect(conn, b"GO  ", raw=True)
                t0 = time.perf_counter()
                layout_s = self._send_tensors(conn, layout, wire, self._specs, flat)
                t1 = time.perf_counter()
                report = self._expect(conn, b"DONE")
        except (OSError, ConnectionError) as err:
            raise InferenceError(
                f"weight push to {self.address}:{self.port} failed: {err}"
            ) from None
        return {**report, "send_s": t1 - t0, "layout_s": layout_s}

    def _send_tensors(
        self,
        conn: socket.socket,
        layout: dict,
        wire: list[TensorSpec],
        params: list[TensorSpec],
        flat: dict,
    ) -> float:
        """Lays out serving tensor i + 1 (in a thread) while tensor i is on the wire; returns
        the seconds spent laying out."""
        options = {"out_major": bool(layout["out_major"]), "shards": int(layout["shards"])}
        buffers = self._buffers = _reusable_buffers(self._buffers, wire)
        model = _LazyHostArrays(flat, {s.name: s for s in params})
        ready: list[np.ndarray | None] = [None] * len(wire)
        done = [threading.Event() for _ in wire]
        error: list[BaseException] = []
        seconds = [0.0]

        def lay_out_all() -> None:
            try:
                for i, spec in enumerate(wire):
                    t0 = time.perf_counter()
                    source = decode_layout.serving_source(spec.name, model, **options)
                    if _fits(source, spec):  # a view of the model's array: sent as it lies
                        ready[i] = source
                    else:
                        decode_layout.fill_serving(buffers[spec.name], spec.name, model, **options)
                        ready[i] = buffers[spec.name]
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
                conn.sendall(_bytes_of(ready[i]))
        finally:
            worker.join()
        return seconds[0]

    def _connect(self) -> socket.socket:
        try:
            conn = socket.create_connection((self.address, self.port), timeout=self._timeout)
        except OSError as err:
            raise HostClosedError(
                f"no weight receiver at {self.address}:{self.port}: {err}"
            ) from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _handshake(self, conn: socket.socket) -> tuple[dict, list[TensorSpec], list[TensorSpec]]:
        """(layout, the host's params, its serving tensors in wire order) from its SPEC."""
        hello = _recv_exact(conn, len(MAGIC) + _NONCE_BYTES)
        if not hello.startswith(MAGIC):
            raise InferenceError(f"{self.address}:{self.port} is not a weight receiver")
        conn.sendall(_mac(self._key, hello[len(MAGIC) :]))
        spec = _parse_json(self._expect(conn, b"SPEC", raw=True), "SPEC")
        layout = spec.get("layout")
        if not (isinstance(layout, dict) and layout.get("name") == decode_layout.WIRE_LAYOUT):
            name = layout.get("name") if isinstance(layout, dict) else layout
            raise ValueError(
                f"weights not sent: the host at {self.address}:{self.port} receives layout "
                f"{name!r}, this pusher sends {decode_layout.WIRE_LAYOUT!r} (pusher and host "
                "must run the same weight layout)"
            )
        params = _specs_from({"tensors": spec.get("params")}, "SPEC's params")
        return layout, params, _specs_from(spec, "SPEC")

    def _expect(self, conn: socket.socket, kind: bytes, raw: bool = False) -> Any:
        got, payload = _recv_frame(conn)
        if got == b"ERR ":
            err = _parse_json(payload, "ERR")
            message, what = str(err.get("message")), err.get("kind")
            if what == "auth":
                raise WeightAuthError(f"weight push to {self.address}: {message}")
            if what == "closed":
                raise HostClosedError(message)
            raise ValueError(message)
        if got != kind:
            raise InferenceError(f"expected a {kind!r} frame from the host, got {got!r}")
        return payload if raw else _parse_json(payload, kind.decode().strip())


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
