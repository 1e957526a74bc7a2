"""Inference layer (engine): the pure, jitted side of the host.

* `engine_core`: `EngineCore`, prefill / insert / generate over a fixed number of slots, its
  jitted programs and shardings; `steps`: the functions those programs run.
* `decode_layout`: the engine's copy of the weights (per layer, fused, out-major, ordered
  for tensor parallelism), the decode step and prefill over it, and its shardings.
* `sampling`: per-slot temperature / top-k / top-p sampling and behaviour log-probs.
* `jetstream_engine`: `JetStreamEngine`, the engine behind JetStream's `Engine` API.

Nothing here starts a thread, opens a socket or keeps a clock: that is the host's
(`inference/host.py`) and the transports' (`inference/remote/`, `inference/transfer/`).
"""
