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

A pusher on the host's machine connects to the receiver's Unix socket instead (an abstract
name, reported as ``weight_socket``; Linux) and the same exchange moves no tensor bytes
through a socket: the host answers PUSH with GO and the file descriptor of a shared-memory
set (a memfd, freed with its last holder, so a killed process leaks nothing), the pusher lays
the serving tensors out straight into it and sends SENT, and the host serves them from
there. Only a peer of the host's own user that proved the token receives the descriptor.
A host with nothing to generate lays out a share of the layers itself (``layout_share``):
the pusher first copies those layers' weights as they are into the set's raw region, one
layer at a time, and the host transposes each while the next is copied, so both cores work
on the push (docs/performance.md has the figures)::

    host   -> pusher   GO  {"set", "size", "offsets",       + the set's descriptor
                            "host_layers": [first, L],        + the raw region's (if any)
                            "raw_set", "raw_size", "raw": [[name, offset], ...]}
    pusher -> host     RAW                                  (once per layer first..L-1)
    pusher -> host     SENT                                 (its own layers written in place)

The layout is named (`decode_layout.WIRE_LAYOUT`): a pusher and a host of different layouts
refuse each other by that name before any tensor byte moves. The host validates the layout,
names, shapes and dtypes before any byte is read, and installs the weights only once every
byte arrived: a push that fails or breaks off leaves the serving weights as they were. The
pusher casts floating-point tensors to the host's dtypes first (a host that serves bfloat16
receives half the bytes of a float32 trainer's weights). Nothing is pickled; the bind
address follows the gRPC server's (127.0.0.1 unless told).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from a3po_jax.inference.engine import decode_layout
from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import HostClosedError, InferenceError

log = logging.getLogger(__name__)

MAGIC = b"A3PW\x01"
_NONCE_BYTES = 32
_FRAME = struct.Struct("<4sQ")
_MAX_HEADER_BYTES = 64 << 20  # a manifest of a few thousand tensors is a few hundred KiB
# recv_into asks for at most this much per call (the kernel returns what it has).
_RECV_BYTES = 16 << 20
# Seconds a connection may take to prove the token: a stranger cannot hold a thread long.
AUTH_TIMEOUT_S = 10.0
# Shared-memory pushes need memfds and descriptor passing (Linux, Python >= 3.9).
SHARED_MEMORY = (
    sys.platform.startswith("linux")
    and hasattr(os, "memfd_create")
    and hasattr(socket, "send_fds")
    and hasattr(socket, "SO_PEERCRED")
)
SHARED = "shared_memory"  # the PUSH header's "transport" for a push through a shared set


def _memfd_works() -> bool:
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


class WeightAuthError(InferenceError):
    """The host refused the token."""


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def _send_frame(conn: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    conn.sendall(_frame(kind, payload))


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
      shared_memory: also listen on a Unix socket (`local_socket`) for pushes through shared
        memory from this machine; None = where the platform has it and a memfd can be made.
      layout_share: the fraction of the layers whose serving tensors the host lays out
        itself in a shared-memory push that finds it idle (no sample running or waiting),
        from the raw weights the pusher copies beside them: the two cores split the
        transposes (docs/performance.md). 0 = the pusher lays out everything.
    """

    def __init__(
        self,
        host: Any,
        token: str,
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        timeout=600.0,
        shared_memory: bool | None = None,
        layout_share: float = 0.6,
    ):
        if not token:
            raise ValueError("token must be a non-empty string")
        if not 0.0 <= layout_share <= 1.0:
            raise ValueError(f"layout_share must be within [0, 1], got {layout_share!r}")
        self._layout_share = float(layout_share)
        if shared_memory and not SHARED_MEMORY:
            raise ValueError("shared-memory weight pushes need Linux (memfd, SCM_RIGHTS)")
        self._host = host
        self._key = token.encode()
        self._timeout = timeout
        self._sock = socket.create_server((bind, port))
        self.port = self._sock.getsockname()[1]
        self._install_lock = threading.Lock()
        # Sets of receive buffers. The host serves from a set as it is (a CPU aliases it), so a
        # set is filled again only once nothing but this list holds it (`_free_set`):
        # reused, a set costs no page faults per push, which for fresh memory cost as much
        # as the receive itself (docs/performance.md). Shared sets are kept apart.
        self._sets: list[dict[str, np.ndarray]] = []
        self._shared_sets: list[_SharedSet] = []
        self._raw: _RawRegion | None = None
        self._closed = threading.Event()
        self._counts = {"pushes": 0, "bytes": 0, "receive_s": 0.0, "install_s": 0.0}
        self._listeners = [self._sock]
        self.local_socket = ""  # the abstract Unix socket's name ("" = none)
        if _memfd_works() if shared_memory is None else shared_memory:
            self.local_socket = f"a3po-weights-{secrets.token_hex(12)}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind("\0" + self.local_socket)  # abstract: no file to leave behind
            unix.listen()
            self._listeners.append(unix)
        self._threads = [
            threading.Thread(target=self._accept, args=(sock,), name="weight-receiver", daemon=True)
            for sock in self._listeners
        ]
        for thread in self._threads:
            thread.start()

    def stats(self) -> dict[str, float]:
        """Pushes installed, their bytes, and seconds spent receiving and installing (totals)."""
        return dict(self._counts)

    def close(self) -> None:
        self._closed.set()
        for sock in self._listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)
        for shared in [*self._shared_sets, self._raw]:
            if shared is not None:
                shared.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="weight-push", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        local = conn.family == socket.AF_UNIX
        with conn:
            conn.settimeout(min(self._timeout, AUTH_TIMEOUT_S))  # the long one once proven
            if not local:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if local and _peer_uid(conn) != os.getuid():
                    raise WeightAuthError("a local pusher must run as the host's user")
                self._exchange(conn, local)
            except (ValueError, HostClosedError) as err:
                kind = "closed" if isinstance(err, HostClosedError) else "invalid"
                log.warning("weight push refused: %s", err)
                _try_send_error(conn, kind, str(err))
            except WeightAuthError as err:
                log.warning("weight push refused: %s", err)
                _try_send_error(conn, "auth", str(err))
            except (OSError, ConnectionError) as err:
                log.warning("weight push broke off (serving weights unchanged): %s", err)

    def _exchange(self, conn: socket.socket, local: bool) -> None:
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
                "shared_memory": local,
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
        transport = header.get("transport", "tcp")
        if transport not in ("tcp", SHARED) or (transport == SHARED and not local):
            raise ValueError(
                f"transport {transport!r} is not offered on this connection (tcp; "
                f"{SHARED!r} only over the host's local socket)"
            )
        weight_sync.check_specs_match(specs, _specs_from(header, "the PUSH header"))
        with self._install_lock:
            t0 = time.perf_counter()
            host_layout_s = 0.0
            if transport == SHARED:
                shared = self._free_shared_set(specs)
                raw = self._raw_region(params)
                first = raw.first_layer if self._idle() else raw.num_layers
                go = {"set": shared.key, "size": shared.size, "offsets": shared.offsets}
                fds = [shared.fd]
                if first < raw.num_layers:
                    go.update(
                        host_layers=[first, raw.num_layers],
                        raw_set=raw.key,
                        raw_size=raw.size,
                        raw=[[name, at] for name, at in raw.offsets.items()],
                    )
                    fds.append(raw.fd)
                socket.send_fds(conn, [_frame(b"GO  ", json.dumps(go).encode())], fds)
                for layer in range(first, raw.num_layers):  # each as its raw weights land
                    _expect_frame(conn, b"RAW ")
                    t_raw = time.perf_counter()
                    raw.lay_out(shared.arrays, specs, layout, layer)
                    host_layout_s += time.perf_counter() - t_raw
                _expect_frame(conn, b"SENT")
                buffers = shared.arrays
            else:
                _send_frame(conn, b"GO  ")
                buffers = self._free_buffers(specs)
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
            {
                "version": version,
                "bytes": nbytes,
                "receive_s": t1 - t0,
                "install_s": t2 - t1,
                "transport": transport,
                "host_layout_s": host_layout_s,
            },
        )

    def _idle(self) -> bool:
        """Whether the host has no sample running or waiting (its core is free to help)."""
        stats = self._host.stats()
        return stats["slots_busy"] == 0 and stats["queue_depth"] == 0

    def _free_buffers(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        """A set of receive buffers for `specs` that no one else holds, else a new one."""
        found = _free_set(self._sets, specs, lambda buffers: buffers)
        if found is None:
            found = {s.name: weight_sync.aligned_empty(s.shape, s.dtype) for s in specs}
            self._sets = [*self._sets[-2:], found]
        return found

    def _raw_region(self, params: list[TensorSpec]) -> _RawRegion:
        """The receiver's raw region, made anew when the params differ from its own."""
        if self._raw is None or self._raw.params != params:
            if self._raw is not None:
                self._raw.close()
            self._raw = _RawRegion(params, self._layout_share)
        return self._raw

    def _free_shared_set(self, specs: list[TensorSpec]) -> _SharedSet:
        """`_free_buffers` for shared sets (a set dropped from the list is closed once its
        last array is gone: the memfd lives while anything maps it)."""
        found = _free_set(self._shared_sets, specs, lambda shared: shared.arrays)
        if found is None:
            found = _SharedSet(specs)
            for old in self._shared_sets[:-2]:
                old.close()
            self._shared_sets = [*self._shared_sets[-2:], found]
        return found


def _free_set(sets: list, specs: list[TensorSpec], arrays_of) -> Any:
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
            if isinstance(old, _SharedSet):
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


class _SharedSet(_Memfd):
    """One set of receive buffers in a memfd: every serving tensor at an aligned offset, each
    a numpy array over its own slice of the mapping (so its `base` is its own, as
    `_free_set` needs)."""

    def __init__(self, specs: list[TensorSpec]):
        self.offsets = _aligned_offsets(specs)
        super().__init__(_end(specs, self.offsets))
        self.arrays = _views(self._map, specs, self.offsets)


class _RawRegion(_Memfd):
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
        offsets = _aligned_offsets(raw)
        super().__init__(_end(raw, offsets))
        self.offsets = {p.name: at for p, at in zip(raw, offsets, strict=True)}
        self.arrays = _views(self._map, raw, offsets)

    def lay_out(
        self, out: dict[str, np.ndarray], specs: list[TensorSpec], layout: dict, layer: int
    ) -> None:
        """Writes the serving tensors of `layer` (``first_layer`` or later) into `out` from
        what the pusher copied here, as the pusher writes the other layers."""
        model = _LayerWindow(self.arrays, self.first_layer)
        options = _fill_options(layout)
        for spec in specs:
            if _layer_of(spec.name) == layer:
                decode_layout.fill_serving(out[spec.name], spec.name, model, **options)


def _fill_options(layout: Mapping[str, Any]) -> dict[str, Any]:
    """`decode_layout.fill_serving`'s layout arguments from a SPEC's layout."""
    return {"out_major": bool(layout["out_major"]), "shards": int(layout["shards"])}


def _end(specs: list[TensorSpec], offsets: list[int]) -> int:
    return offsets[-1] + specs[-1].nbytes if specs else 0


class _LayerWindow(Mapping):
    """Stacked layer params of layers ``first`` and up, read by absolute layer index
    (``window[name][layer]``), as `decode_layout.fill_serving` reads the whole stack."""

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


def _layer_of(name: str) -> int:
    """The layer index of a serving tensor "layers/<i>/...", or -1 for the others."""
    try:
        return decode_layout.layer_key(name)[0]
    except ValueError:
        return -1


def _aligned_offsets(specs: list[TensorSpec]) -> list[int]:
    """Offsets of `specs` packed one after another, each at a multiple of `ALIGNMENT`."""
    offsets, at = [], 0
    for spec in specs:
        at += -at % weight_sync.ALIGNMENT
        offsets.append(at)
        at += spec.nbytes
    return offsets


def _views(buffer: Any, specs: list[TensorSpec], offsets: list[int]) -> dict[str, np.ndarray]:
    """numpy arrays of `specs` at `offsets` of `buffer` (a writable mapping), each over a
    memoryview slice of its own."""
    whole = memoryview(buffer)
    return {
        s.name: np.frombuffer(whole[at : at + s.nbytes], np.uint8).view(s.dtype).reshape(s.shape)
        for s, at in zip(specs, offsets, strict=True)
    }


def _peer_uid(conn: socket.socket) -> int:
    """The user id of a Unix socket's peer (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _expect_frame(conn: socket.socket, kind: bytes) -> bytes:
    got, payload = _recv_frame(conn)
    if got != kind:
        raise ValueError(f"expected a {kind.decode().strip()} frame, got {got!r}")
    return payload


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
                _send_frame(conn, b"BYE ")
        return self._specs

    def push(self, params: Any, version: int) -> dict[str, Any]:
        """Sends `params` (a tree or flat dict; jax or numpy arrays) stamped `version`; returns
        once the host has installed them, with the host's report plus ``send_s`` and
        ``layout_s``.

        The tensors go in the host's serving layout (`decode_layout.fill_serving`: q/k/v and
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
                _send_json(conn, b"PUSH", header)
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
                    source = decode_layout.serving_source(tensor.name, model, **spec.options)
                    if _fits(source, tensor):  # a view of the model's array: sent as it lies
                        ready[i] = source
                    else:
                        out = buffers[tensor.name]
                        decode_layout.fill_serving(out, tensor.name, model, **spec.options)
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
                conn.sendall(_bytes_of(ready[i]))
        finally:
            worker.join()
        return seconds[0]

    def _write_shared(self, conn: socket.socket, spec: _Spec, model: Mapping) -> float:
        """Waits for the host's GO and shared set, lays every serving tensor out straight
        into it (first copying the raw weights of the layers the host lays out itself, if
        it said so), and says SENT; returns the seconds spent."""
        (kind, payload), fds = _recv_frame_with_fds(conn)
        try:
            if kind != b"GO  ":
                self._raise_for(kind, payload, b"GO  ")
            where = _parse_json(payload, "GO")
            first, last = _host_layers(where.get("host_layers"))
            if len(fds) != (2 if first < last else 1):
                raise InferenceError(f"host {self.address} sent {len(fds)} descriptors")
            offsets = where.get("offsets")
            _check_offsets(offsets, spec.wire, where.get("size"))
            mapped = self._map(where.get("set"), where.get("size"), fds[0])
            if first < last:
                raw = self._map(where.get("raw_set"), where.get("raw_size"), fds[1])
        finally:
            for fd in fds:
                os.close(fd)
        t0 = time.perf_counter()
        if first < last:  # the host lays out these layers itself: their raw weights first
            self._write_raw(conn, raw, where.get("raw"), model, first, last)
        views = _views(mapped, spec.wire, offsets)
        for tensor in spec.wire:
            if not first <= _layer_of(tensor.name) < last:
                decode_layout.fill_serving(views[tensor.name], tensor.name, model, **spec.options)
        seconds = time.perf_counter() - t0
        del views
        _send_frame(conn, b"SENT")
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
        _check_offsets(offsets, specs, len(mapped), ordered=False)
        views = _views(mapped, specs, offsets)
        for layer in range(first, last):
            for name, view in views.items():
                np.copyto(view[layer - first], model[name][layer], casting="no")
            _send_frame(conn, b"RAW ")

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
        return _Spec(
            layout=layout,
            params=_specs_from({"tensors": spec.get("params")}, "SPEC's params"),
            wire=_specs_from(spec, "SPEC"),
            shared_memory=spec.get("shared_memory") is True and conn.family == socket.AF_UNIX,
        )

    def _expect(self, conn: socket.socket, kind: bytes, raw: bool = False) -> Any:
        got, payload = _recv_frame(conn)
        if got != kind:
            self._raise_for(got, payload, kind)
        return payload if raw else _parse_json(payload, kind.decode().strip())

    def _raise_for(self, got: bytes, payload: bytes, expected: bytes) -> None:
        """Raises the host's ERR as its kind of error, or says what frame came instead."""
        if got == b"ERR ":
            err = _parse_json(payload, "ERR")
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
        """`decode_layout.fill_serving`'s layout arguments."""
        return _fill_options(self.layout)


def _recv_frame_with_fds(conn: socket.socket) -> tuple[tuple[bytes, bytes], list[int]]:
    """A frame and the descriptors that came with its first bytes (SCM_RIGHTS)."""
    head, fds, _, _ = socket.recv_fds(conn, _FRAME.size, 2)
    try:
        if not head:
            raise ConnectionError("connection closed before the host's GO")
        if len(head) < _FRAME.size:
            head += _recv_exact(conn, _FRAME.size - len(head))
        kind, length = _FRAME.unpack(head)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"frame {kind!r} of {length} bytes exceeds {_MAX_HEADER_BYTES}")
        return (kind, _recv_exact(conn, length)), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _check_offsets(
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
