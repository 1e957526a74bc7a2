"""The weight port's frames, the token handshake, and the exchange they make up.

Inference layer (transfer).

A gRPC message costs several copies of its bytes on each side (serialisation, the
transport's buffers, parsing), which held pushes to a fraction of what the link carries. Here
the sender (`sender.py`) writes each tensor's bytes straight from a host buffer into the
socket and the receiver (`receiver.py`) reads them straight into the buffers the host then
serves from (`recv_into`), so each side copies a byte once more than the kernel does
(docs/performance.md has the figures).

The tensors travel in the host's serving layout (`decode_layout.DecodeParams`: q/k/v and
gate/up fused, the layer matrices out-major where the host's decode step wants them), laid
out by the pusher (`layout.fill_serving`, tensor by tensor while the previous one is
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

The layout is named (`layout.WIRE_LAYOUT`): a pusher and a host of different layouts
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
import os
import secrets
import socket
import struct
from typing import Any

import numpy as np

from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import InferenceError

MAGIC = b"A3PW\x01"
NONCE_BYTES = 32
FRAME = struct.Struct("<4sQ")
MAX_HEADER_BYTES = 64 << 20  # a manifest of a few thousand tensors is a few hundred KiB
# recv_into asks for at most this much per call (the kernel returns what it has).
_RECV_BYTES = 16 << 20
# Seconds a connection may take to prove the token: a stranger cannot hold a thread long.
AUTH_TIMEOUT_S = 10.0


class WeightAuthError(InferenceError):
    """The host refused the token."""


def mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def send_frame(conn: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    conn.sendall(frame(kind, payload))


def send_json(conn: socket.socket, kind: bytes, value: Any) -> None:
    send_frame(conn, kind, json.dumps(value).encode())


def recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    recv_into(conn, memoryview(out))
    return bytes(out)


def recv_into(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, _RECV_BYTES))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    kind, length = FRAME.unpack(recv_exact(conn, FRAME.size))
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"frame {kind!r} of {length} bytes exceeds {MAX_HEADER_BYTES}")
    return kind, recv_exact(conn, length)


def bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def parse_json(payload: bytes, what: str) -> dict:
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def specs_from(value: dict, what: str) -> list[TensorSpec]:
    tensors = value.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError(f"{what} needs a 'tensors' list")
    return [TensorSpec.from_json(item) for item in tensors]


def peer_uid(conn: socket.socket) -> int:
    """The user id of a Unix socket's peer (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def expect_frame(conn: socket.socket, kind: bytes) -> bytes:
    got, payload = recv_frame(conn)
    if got != kind:
        raise ValueError(f"expected a {kind.decode().strip()} frame, got {got!r}")
    return payload


def try_send_error(conn: socket.socket, kind: str, message: str) -> None:
    try:
        send_json(conn, b"ERR ", {"kind": kind, "message": message})
    except OSError:
        pass


def recv_frame_with_fds(conn: socket.socket) -> tuple[tuple[bytes, bytes], list[int]]:
    """A frame and the descriptors that came with its first bytes (SCM_RIGHTS)."""
    head, fds, _, _ = socket.recv_fds(conn, FRAME.size, 2)
    try:
        if not head:
            raise ConnectionError("connection closed before the host's GO")
        if len(head) < FRAME.size:
            head += recv_exact(conn, FRAME.size - len(head))
        kind, length = FRAME.unpack(head)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"frame {kind!r} of {length} bytes exceeds {MAX_HEADER_BYTES}")
        return (kind, recv_exact(conn, length)), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def challenge(conn: socket.socket, key: bytes) -> None:
    """The host's half of the handshake: a fresh nonce out, its HMAC under the token back
    (the token never travels); WeightAuthError when the answer is wrong."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(MAGIC + nonce)
    if not hmac.compare_digest(recv_exact(conn, 32), mac(key, nonce)):
        raise WeightAuthError("missing or wrong host token")


def answer(conn: socket.socket, key: bytes, where: str) -> None:
    """The pusher's half of the handshake: the host's nonce in, its HMAC under the token out."""
    hello = recv_exact(conn, len(MAGIC) + NONCE_BYTES)
    if not hello.startswith(MAGIC):
        raise InferenceError(f"{where} is not a weight receiver")
    conn.sendall(mac(key, hello[len(MAGIC) :]))
