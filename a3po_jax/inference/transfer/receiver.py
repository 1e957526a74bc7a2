"""The host's side of a weight push: `WeightReceiver`, on a TCP port and a local socket.

Inference layer (transfer). The exchange is described in `framing.py`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import numpy as np

from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.transfer.framing import (
    AUTH_TIMEOUT_S,
    WeightAuthError,
    bytes_of,
    challenge,
    expect_frame,
    frame,
    parse_json,
    peer_uid,
    recv_frame,
    recv_into,
    send_frame,
    send_json,
    specs_from,
    try_send_error,
)
from a3po_jax.inference.transfer.shared_memory import (
    SHARED,
    SHARED_MEMORY,
    RawRegion,
    SharedSet,
    free_set,
    memfd_works,
)
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import HostClosedError

log = logging.getLogger(__name__)


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
        # set is filled again only once nothing but this list holds it (`free_set`):
        # reused, a set costs no page faults per push, which for fresh memory cost as much
        # as the receive itself (docs/performance.md). Shared sets are kept apart.
        self._sets: list[dict[str, np.ndarray]] = []
        self._shared_sets: list[SharedSet] = []
        self._raw: RawRegion | None = None
        self._closed = threading.Event()
        self._counts = {"pushes": 0, "bytes": 0, "receive_s": 0.0, "install_s": 0.0}
        self._listeners = [self._sock]
        self.local_socket = ""  # the abstract Unix socket's name ("" = none)
        if memfd_works() if shared_memory is None else shared_memory:
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
                if local and peer_uid(conn) != os.getuid():
                    raise WeightAuthError("a local pusher must run as the host's user")
                self._exchange(conn, local)
            except (ValueError, HostClosedError) as err:
                kind = "closed" if isinstance(err, HostClosedError) else "invalid"
                log.warning("weight push refused: %s", err)
                try_send_error(conn, kind, str(err))
            except WeightAuthError as err:
                log.warning("weight push refused: %s", err)
                try_send_error(conn, "auth", str(err))
            except (OSError, ConnectionError) as err:
                log.warning("weight push broke off (serving weights unchanged): %s", err)

    def _exchange(self, conn: socket.socket, local: bool) -> None:
        challenge(conn, self._key)
        conn.settimeout(self._timeout)
        layout = self._host.serving_layout()
        specs = self._host.serving_specs()
        params = weight_sync.tensor_specs(self._host.params_spec)
        send_json(
            conn,
            b"SPEC",
            {
                "layout": layout,
                "tensors": [s.to_json() for s in specs],
                "params": [s.to_json() for s in params],
                "shared_memory": local,
            },
        )
        kind, payload = recv_frame(conn)
        if kind == b"BYE ":
            return
        if kind != b"PUSH":
            raise ValueError(f"expected a PUSH frame, got {kind!r}")
        version, transport = _check_push(payload, layout, specs, local)
        with self._install_lock:
            t0 = time.perf_counter()
            host_layout_s = 0.0
            if transport == SHARED:
                buffers, host_layout_s = self._receive_shared(conn, specs, params, layout)
            else:
                send_frame(conn, b"GO  ")
                buffers = self._free_buffers(specs)
                for spec in specs:
                    recv_into(conn, bytes_of(buffers[spec.name]))
            t1 = time.perf_counter()
            # Every byte is here: only now does anything reach the host.
            self._host.install_serving(buffers, version)
            t2 = time.perf_counter()
            nbytes = sum(s.nbytes for s in specs)
            self._counts["pushes"] += 1
            self._counts["bytes"] += nbytes
            self._counts["receive_s"] += t1 - t0
            self._counts["install_s"] += t2 - t1
        send_json(
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

    def _receive_shared(
        self, conn: socket.socket, specs: list[TensorSpec], params: list[TensorSpec], layout: dict
    ) -> tuple[dict[str, np.ndarray], float]:
        """GO with a free shared set (and the raw region, when the host is idle and lays out
        its share of the layers), then the pusher's RAW frames and SENT; returns the set's
        arrays and the seconds the host spent laying out."""
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
        socket.send_fds(conn, [frame(b"GO  ", json.dumps(go).encode())], fds)
        host_layout_s = 0.0
        for layer in range(first, raw.num_layers):  # each as its raw weights land
            expect_frame(conn, b"RAW ")
            t_raw = time.perf_counter()
            raw.lay_out(shared.arrays, specs, layout, layer)
            host_layout_s += time.perf_counter() - t_raw
        expect_frame(conn, b"SENT")
        return shared.arrays, host_layout_s

    def _idle(self) -> bool:
        """Whether the host has no sample running or waiting (its core is free to help)."""
        stats = self._host.stats()
        return stats["slots_busy"] == 0 and stats["queue_depth"] == 0

    def _free_buffers(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        """A set of receive buffers for `specs` that no one else holds, else a new one."""
        found = free_set(self._sets, specs, lambda buffers: buffers)
        if found is None:
            found = {s.name: weight_sync.aligned_empty(s.shape, s.dtype) for s in specs}
            self._sets = [*self._sets[-2:], found]
        return found

    def _raw_region(self, params: list[TensorSpec]) -> RawRegion:
        """The receiver's raw region, made anew when the params differ from its own."""
        if self._raw is None or self._raw.params != params:
            if self._raw is not None:
                self._raw.close()
            self._raw = RawRegion(params, self._layout_share)
        return self._raw

    def _free_shared_set(self, specs: list[TensorSpec]) -> SharedSet:
        """`_free_buffers` for shared sets (a set dropped from the list is closed once its
        last array is gone: the memfd lives while anything maps it)."""
        found = free_set(self._shared_sets, specs, lambda shared: shared.arrays)
        if found is None:
            found = SharedSet(specs)
            for old in self._shared_sets[:-2]:
                old.close()
            self._shared_sets = [*self._shared_sets[-2:], found]
        return found


def _check_push(
    payload: bytes, layout: dict, specs: list[TensorSpec], local: bool
) -> tuple[int, str]:
    """The PUSH header's version and transport, once its layout and tensors match the host's
    (ValueError naming what differs)."""
    header = parse_json(payload, "the PUSH header")
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
    weight_sync.check_specs_match(specs, specs_from(header, "the PUSH header"))
    return version, transport
