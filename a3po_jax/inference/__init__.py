"""Inference host: engine, continuous batching, weight updates, gRPC and JetStream serving.

* `types`: `SamplingParams`, `GenerateRequest`, `SampleResult` (what goes in and out).
* `sampling`: per-slot temperature / top-k / top-p sampling and behaviour log-probs.
* `engine_core`: pure-JAX prefill / insert / generate over a fixed number of slots.
* `host`: `InferenceHost`, the in-process serving thread (the embedded default).
* `grpc_server` / `grpc_client`: the same host in another process (`GrpcInferenceClient`).
* `jetstream_engine`: `JetStreamEngine`, the engine behind JetStream's `Engine` API.

Importing this package does not import JetStream (hence TensorFlow) or gRPC: those load on
first use of `JetStreamEngine` / `GrpcInferenceClient`.
"""

from a3po_jax.inference.engine_core import DecodeState, EngineCore, Prefix, SlotSampling
from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.types import (
    GenerateRequest,
    HostClosedError,
    InferenceError,
    SampleResult,
    SamplingParams,
)

_LAZY = {
    "GrpcInferenceClient": ("a3po_jax.inference.grpc_client", "GrpcInferenceClient"),
    "JetStreamEngine": ("a3po_jax.inference.jetstream_engine", "JetStreamEngine"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DecodeState",
    "EngineCore",
    "GenerateRequest",
    "GrpcInferenceClient",
    "HostClosedError",
    "InferenceError",
    "InferenceHost",
    "JetStreamEngine",
    "Prefix",
    "SampleResult",
    "SamplingParams",
    "SlotSampling",
]
