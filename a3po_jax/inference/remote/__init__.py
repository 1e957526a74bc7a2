"""Inference layer (remote): the host in another process, and several hosts behind one.

* `grpc_server` / `grpc_client`: the host over gRPC (`inference.proto`; the generated
  `inference_pb2` / `inference_pb2_grpc`, rebuilt by scripts/gen_proto.sh), with
  `grpc_messages` converting between the wire messages and `inference.types`.
* `pool`: `HostPool`, several hosts behind one `Host`, with health checks and failover;
  `pool_members`: what it keeps per host and per request, and its push to each host.
* `local_process`: `LocalHostProcess`, a host process on cores of its own.

Importing this package imports nothing of gRPC: each module loads it on its own import.
"""
