"""Inference layer (shell): engine, continuous batching, weight updates, gRPC and JetStream.

In layers: the pure, jitted engine (`engine/`), the host around it (`host`, its serving
loop and update policies), hosts in other processes (`remote/`), and weight pushes to them
(`transfer/`).

* `protocol`: `Host`, the interface every host below implements (the trainer types on it).
* `types`: `SamplingParams`, `GenerateRequest`, `SampleResult` (what goes in and out; one
  conversion to the core's `Rollout`), `ErrorKind` (why a sample failed).
* `engine/`: `steps` (pure-JAX prefill / insert / generate over a fixed number of slots),
  `engine_core` (`EngineCore`, those jitted), `decode_layout` (the engine's copy of the
  weights and the decode step over it), `sampling`, `jetstream_engine` (`JetStreamEngine`,
  the engine behind JetStream's `Engine` API).
* `host`: `InferenceHost`, the in-process serving thread (the embedded default), with
  `serving_loop`, `update_policy`, `host_records` and `host_metrics`.
* `remote/`: the same host in another process over gRPC (`GrpcInferenceClient`; the
  command line is `a3po_jax.cli.serve`), `HostPool` (several hosts behind one `Host`, with
  health checks and failover), `LocalHostProcess`.
* `transfer/`: weight pushes to a host outside gRPC (`WeightSender`, `WeightReceiver`).

Importing this package does not import JetStream (hence TensorFlow) or gRPC: those load on
first use of `JetStreamEngine` / `GrpcInferenceClient`.
"""

from a3po_jax.inference.engine.engine_core import EngineCore
from a3po_jax.inference.engine.steps import DecodeState, Prefix, SlotSampling
from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.protocol import Host
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    HostClosedError,
    InferenceError,
    SampleResult,
    SamplingParams,
)

_LAZY = {
    "GrpcInferenceClient": ("a3po_jax.inference.remote.grpc_client", "GrpcInferenceClient"),
    "JetStreamEngine": ("a3po_jax.inference.engine.jetstream_engine", "JetStreamEngine"),
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
    "ErrorKind",
    "GenerateRequest",
    "GrpcInferenceClient",
    "Host",
    "HostClosedError",
    "InferenceError",
    "InferenceHost",
    "JetStreamEngine",
    "Prefix",
    "SampleResult",
    "SamplingParams",
    "SlotSampling",
]
