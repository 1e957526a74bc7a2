#!/usr/bin/env bash
# Regenerates a3po_jax/inference/inference_pb2{,_grpc}.py from inference.proto.
# Needs grpcio-tools (pip install grpcio-tools==1.85.1); run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m grpc_tools.protoc -I. \
  --python_out=. --grpc_python_out=. \
  a3po_jax/inference/inference.proto
echo "generated a3po_jax/inference/inference_pb2.py and inference_pb2_grpc.py"
