"""Client for an inference host in another process, with `InferenceHost`'s methods.

Inference layer (remote).

    client = GrpcInferenceClient("127.0.0.1:50051", token)   # or .from_token_file(...)
    client.submit(GenerateRequest(...))       # ValueError if the host rejects the request
    results = client.poll(timeout=1.0)        # finished samples, as they finish
    client.update_weights(params, version)    # ValueError if names/shapes/dtypes differ

Each submitted request opens one server-streaming Generate call, read by its own
background thread into a shared result queue, so `poll` behaves as on the in-process host.
Weights go over the host's weight port (`transfer.sender.WeightSender`), not over gRPC.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from a3po_jax.inference.protocol import InAnotherProcess
from a3po_jax.inference.remote import inference_pb2 as pb
from a3po_jax.inference.remote import inference_pb2_grpc as pb_grpc
from a3po_jax.inference.remote.grpc_messages import (
    GRPC_OPTIONS,
    auth_metadata,
    request_to_proto,
    result_from_proto,
    stats_from_proto,
)
from a3po_jax.inference.transfer.framing import WeightAuthError
from a3po_jax.inference.transfer.sender import WeightSender
from a3po_jax.inference.transfer.weight_sync import TensorSpec
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    HostClosedError,
    InferenceError,
    SampleResult,
    error_result,
    take_results,
)


class HostAuthenticationError(PermissionError):
    """The host refused the token (gRPC status UNAUTHENTICATED)."""


def _raise_for(error: grpc.RpcError, what: str):
    code, details = error.code(), error.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(details) from None
    if code == grpc.StatusCode.UNAUTHENTICATED:
        raise HostAuthenticationError(f"{what}: UNAUTHENTICATED: {details}") from None
    if code == grpc.StatusCode.UNAVAILABLE:
        raise HostClosedError(f"{what}: host unavailable: {details}") from None
    raise InferenceError(f"{what} failed: {code.name}: {details}") from None


class GrpcInferenceClient(InAnotherProcess):
    """The trainer's handle on a remote `InferenceHost` (same methods, same results).

    Args:
      address: "host:port" of `grpc_server`.
      token: the host's token (see `grpc_server.resolve_token`).
      timeout: seconds to wait for the server at start and for unary calls (stats,
        health): a frozen host makes them fail after this long instead of hanging.
      weight_timeout: seconds a weight push may stall (connect, or no byte moving).
      shared_memory: push through shared memory where the host is on this machine (its
        stats report a ``weight_socket``); False = always its TCP weight port.

    A stream that breaks (host killed, network gone) reports its missing samples as error
    results of kind ``ErrorKind.TRANSPORT``, which `HostPool` re-issues.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        timeout: float = 60.0,
        weight_timeout: float = 600.0,
        shared_memory: bool = True,
    ):
        self.address = address
        self._shared_memory = shared_memory
        self._token = token
        self._metadata = auth_metadata(token)
        self._timeout = timeout
        self._weight_timeout = weight_timeout
        self._sender: WeightSender | None = None
        self.last_push: dict[str, Any] = {}  # the host's report of the last weight push
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.InferenceHostStub(self._channel)
        self._results: queue.Queue[SampleResult] = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[grpc.Future, threading.Thread]] = {}
        self._counts: collections.Counter[str] = collections.Counter()  # under _lock
        self._lost_reasons: collections.Counter[str] = collections.Counter()
        self._closed = False
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise HostClosedError(f"no inference host at {address} after {timeout} s") from None

    @classmethod
    def from_token_file(cls, address: str, token_file: str | Path, **kwargs) -> GrpcInferenceClient:
        token = Path(token_file).expanduser().read_text().strip()
        return cls(address, token, **kwargs)

    # ------------------------------------------------------------------ InferenceHost API

    def submit(self, request: GenerateRequest) -> None:
        """Sends a request; returns once the host accepted it (ValueError if it did not)."""
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if self._closed:
            raise HostClosedError("client is closed")
        call = self._stub.Generate(request_to_proto(request), metadata=self._metadata)
        # The server sends ("accepted", request id) as initial metadata once the host
        # accepted the request; a rejection ends the call without it, with the host's error
        # (`call.code()` waits for that end: `done()` may not be set yet when the empty
        # metadata arrives).
        accepted = dict(call.initial_metadata() or ()).get("accepted")
        if accepted != request.request_id:
            _raise_for(call, "Generate")
        reader = threading.Thread(
            target=self._read_stream,
            args=(request, call),
            name=f"generate-{request.request_id}",
            daemon=True,
        )
        with self._lock:
            self._streams[request.request_id] = (call, reader)
            self._counts["requests"] += 1
            self._counts["samples_requested"] += request.num_samples
        reader.start()

    def poll(self, timeout: float | None = None, max_results: int | None = None):
        """Finished samples of any request, as on `InferenceHost.poll`."""
        return take_results(self._results, timeout, max_results)

    def update_weights(self, params: Any, version: int) -> None:
        """Sends the weights over the host's weight port; returns once the host installed
        them (they serve as its update policy says). Floating-point tensors are cast to the
        host's dtypes first; ValueError if a name or shape differs."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        try:
            self.last_push = self._weights().push(params, version)
        except WeightAuthError as e:
            raise HostAuthenticationError(f"weight push: UNAUTHENTICATED: {e}") from None

    def tensor_specs(self) -> list[TensorSpec]:
        """The host's serving tensors (name, dtype, shape), in the order a push sends them."""
        return self._weights().specs()

    def _weights(self) -> WeightSender:
        """The sender to the host's weight port, asked anew each time (a host restarted on
        the same address has another weight port)."""
        stats = self.stats()
        port, local = stats.get("weight_port"), str(stats.get("weight_socket", ""))
        local = local if self._shared_memory else ""
        if port is None:
            raise InferenceError(f"host {self.address} reports no weight_port")
        sender = self._sender
        if sender is None or sender.port != port or sender.offered_socket != local:
            self._sender = WeightSender(
                self.address.rsplit(":", 1)[0].strip("[]"),
                int(port),
                self._token,
                timeout=self._weight_timeout,
                local_socket=local,
            )
        return self._sender

    @property
    def version(self) -> int:
        """Version of the weights the host is serving."""
        try:
            return int(self._stub.Health(pb.HealthRequest(), timeout=self._timeout).version)
        except grpc.RpcError as e:
            _raise_for(e, "Health")

    def health(self) -> bool:
        try:
            return bool(self._stub.Health(pb.HealthRequest(), timeout=self._timeout).live)
        except grpc.RpcError:
            return False

    def counters(self) -> dict[str, Any]:
        """Sample accounting of this client, as `InferenceHost.counters` (a sample of a
        cancelled stream, at `close`, stays outstanding)."""
        with self._lock:
            c, lost = self._counts, dict(self._lost_reasons)
            return {
                "requests": c["requests"],
                "samples_requested": c["samples_requested"],
                "samples_delivered": c["samples_delivered"],
                "samples_lost": sum(lost.values()),
                "samples_outstanding": c["samples_requested"]
                - c["samples_delivered"]
                - sum(lost.values()),
                "lost_reasons": lost,
            }

    def stats(self) -> dict[str, Any]:
        try:
            response = self._stub.Stats(
                pb.StatsRequest(), metadata=self._metadata, timeout=self._timeout
            )
        except grpc.RpcError as e:
            _raise_for(e, "Stats")
        return stats_from_proto(response)

    def close(self) -> None:
        """Cancels open streams and closes the channel (the host keeps running)."""
        with self._lock:
            self._closed = True
            streams = list(self._streams.values())
        for call, _ in streams:
            call.cancel()
        for _, reader in streams:
            reader.join(timeout=5)
        self._channel.close()

    def __enter__(self) -> GrpcInferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ stream readers

    def _put(self, result: SampleResult) -> None:
        with self._lock:
            if result.error_kind is None:
                self._counts["samples_delivered"] += 1
            else:
                self._lost_reasons[result.error_kind.value] += 1
        self._results.put(result)

    def _read_stream(self, request: GenerateRequest, call) -> None:
        received: set[int] = set()
        try:
            for message in call:
                result = result_from_proto(message)
                received.add(result.sample_index)
                self._put(result)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not self._closed:
                message = f"stream failed: {e.code().name}: {e.details()}"
                for i in range(request.num_samples):
                    if i not in received:
                        self._put(error_result(request, i, ErrorKind.TRANSPORT, message))
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
        # A stream that ends early without an error (the server shut down) loses samples;
        # report them rather than let the caller wait forever.
        missing = [i for i in range(request.num_samples) if i not in received]
        if missing and not self._closed and call.code() == grpc.StatusCode.OK:
            for i in missing:
                self._put(error_result(request, i, ErrorKind.TRANSPORT, "stream ended early"))

    def wait_until_version(self, version: int, timeout: float = 60.0) -> None:
        """Blocks until the host serves `version` (after an update was swapped in)."""
        deadline = time.monotonic() + timeout
        while self.version != version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"host still serves version {self.version}, not {version}")
            time.sleep(0.01)
