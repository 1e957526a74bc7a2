"""Inference layer (remote): an `InferenceHost` served over gRPC (`inference.proto`).

The command line that starts one is `a3po_jax.cli.serve`:

    python -m a3po_jax.cli.serve --model tiny --port 50051 \\
        --host 127.0.0.1 --token-file ~/.a3po_host_token

`--model` names a model as the trainer's `model.name` does (`a3po_jax.model.loader.load_model`:
`tiny` with params from `--init-seed`, `smollm2`, a Hugging Face checkpoint directory or a
`.gguf` file), so the two build the same config for the same name. The trainer connects with
`GrpcInferenceClient(address, token)`, which offers the `InferenceHost` methods.

Security: binds 127.0.0.1 unless told otherwise, and every call but Health needs the
metadata `authorization: Bearer <token>` (compared in constant time). The token is read from
`--token-file` if that file exists, else from `$A3PO_HOST_TOKEN`, else generated and written
to `--token-file` (default `~/.cache/a3po_jax/host_token`) with mode 0600. Weights arrive on
a TCP port of their own (`receiver.WeightReceiver`, reported by Stats as
``weight_port``) as raw bytes with dtype and shape, never pickled, from a pusher that proves
it holds the token, and are rejected whole on any mismatch.

A request whose Generate stream ends before its last sample (the trainer was killed, or
cancelled the call) is cancelled on the host: its waiting samples never start and its
running ones leave their slots, so a dead run's work does not occupy the host.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.remote import inference_pb2 as pb
from a3po_jax.inference.remote import inference_pb2_grpc as pb_grpc
from a3po_jax.inference.remote.grpc_messages import (
    GRPC_OPTIONS,
    TOKEN_ENV,
    request_from_proto,
    result_to_proto,
    stats_to_proto,
    token_matches,
)
from a3po_jax.inference.transfer.receiver import WeightReceiver
from a3po_jax.inference.types import HostClosedError

log = logging.getLogger(__name__)

DEFAULT_TOKEN_FILE = Path("~/.cache/a3po_jax/host_token")
READY_LINE = "A3PO_HOST_READY"


class InferenceServicer(pb_grpc.InferenceHostServicer):
    """Routes gRPC calls to an `InferenceHost` (which must be started); `weights` is the
    host's `WeightReceiver`, whose port Stats reports."""

    def __init__(self, host: InferenceHost, token: str, weights: WeightReceiver | None = None):
        if not token:
            raise ValueError("token must be a non-empty string")
        self._host = host
        self._token = token
        self._weights = weights
        self._routes: dict[str, queue.Queue] = {}
        self._routes_lock = threading.Lock()
        self._stop = threading.Event()
        self._dispatcher = threading.Thread(target=self._dispatch, name="dispatch", daemon=True)
        self._dispatcher.start()

    def close(self) -> None:
        self._stop.set()
        self._dispatcher.join(timeout=5)
        if self._weights is not None:
            self._weights.close()

    def _dispatch(self) -> None:
        """Hands each finished sample to the stream of its request."""
        while not self._stop.is_set():
            try:
                results = self._host.poll(timeout=0.2)
            except HostClosedError:
                return
            for r in results:
                with self._routes_lock:
                    route = self._routes.get(r.request_id)
                if route is not None:  # else the client went away; drop the sample
                    route.put(r)

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if not token_matches(context.invocation_metadata(), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong host token")

    def Generate(self, request, context):
        self._authorize(context)
        try:
            req = request_from_proto(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        route: queue.Queue = queue.Queue()
        with self._routes_lock:
            if req.request_id in self._routes:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request_id {req.request_id!r} is already in flight",
                )
            self._routes[req.request_id] = route
        try:
            try:
                self._host.submit(req)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except HostClosedError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            # Tells the client the request was accepted (its submit returns now).
            context.send_initial_metadata((("accepted", req.request_id),))
            remaining = req.num_samples
            while remaining and context.is_active():
                try:
                    result = route.get(timeout=0.5)
                except queue.Empty:
                    continue
                remaining -= 1
                if not remaining:
                    # The request leaves flight before its last sample reaches the client,
                    # as on the in-process host: a client may reuse the id at once.
                    self._drop_route(req.request_id, route)
                yield result_to_proto(result)
        finally:
            if self._drop_route(req.request_id, route):
                # The stream ended with samples owed: nobody will read them.
                self._host.cancel(req.request_id)

    def _drop_route(self, request_id: str, route: queue.Queue) -> bool:
        """Removes this call's route (a later request may already reuse the id); True if
        it was still there."""
        with self._routes_lock:
            if self._routes.get(request_id) is route:
                del self._routes[request_id]
                return True
            return False

    def Health(self, request, context):
        return pb.HealthResponse(live=bool(self._host.stats()["live"]), version=self._host.version)

    def Stats(self, request, context):
        self._authorize(context)
        stats = self._host.stats()
        if self._weights is not None:
            stats["weight_port"] = self._weights.port
            if self._weights.local_socket:  # pushes from this machine: shared memory
                stats["weight_socket"] = self._weights.local_socket
        return stats_to_proto(stats)


def serve(
    host: InferenceHost,
    token: str,
    *,
    port: int = 0,
    bind: str = "127.0.0.1",
    max_streams: int = 512,
    weight_port: int = 0,
) -> tuple[grpc.Server, InferenceServicer, int]:
    """Starts a gRPC server for a started host, and its weight receiver on `weight_port` (0:
    any free port) at the same address; returns (server, servicer, bound port).

    Each open Generate stream holds a worker thread while it waits, so `max_streams` bounds
    the requests in flight at once.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_streams + 8),
        options=GRPC_OPTIONS,
        maximum_concurrent_rpcs=max_streams,
    )
    bound = server.add_insecure_port(f"{bind}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {bind}:{port}")
    weights = WeightReceiver(host, token, bind=bind, port=weight_port)
    servicer = InferenceServicer(host, token, weights)
    pb_grpc.add_InferenceHostServicer_to_server(servicer, server)
    server.start()
    return server, servicer, bound


def resolve_token(token_file: str | None) -> tuple[str, Path | None]:
    """The host token and the file it lives in (None when it came from the environment)."""
    path = Path(token_file).expanduser() if token_file else None
    if path is not None and path.exists():
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token, path
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], None
    path = path or DEFAULT_TOKEN_FILE.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + 0600 at creation: the token is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def load_model(
    spec: str,
    *,
    init_seed: int = 0,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
) -> tuple[Any, Any]:
    """(config, params) for `--model`, built by the one model loader
    (`a3po_jax.model.loader.load_model`): "tiny", "smollm2", a Hugging Face checkpoint
    directory or a .gguf file, in the given dtypes; `init_seed` seeds "tiny"."""
    from a3po_jax.model.loader import load_model as load

    loaded = load(spec, param_dtype=param_dtype, compute_dtype=compute_dtype, seed=init_seed)
    return loaded.config, loaded.params
