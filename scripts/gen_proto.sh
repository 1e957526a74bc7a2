#!/usr/bin/env bash
# Regenerates a3po_jax/inference/remote/inference_pb2{,_grpc}.py from inference.proto.
# Needs grpcio-tools 1.66.2 (pip install grpcio-tools==1.66.2, e.g. in a throwaway venv:
#   python -m venv /tmp/gen && /tmp/gen/bin/pip install grpcio-tools==1.66.2 &&
#   PYTHON=/tmp/gen/bin/python bash scripts/gen_proto.sh); run from anywhere.
# The generated code checks at import that grpcio >= the grpcio-tools version and protobuf >=
# the protoc version it bundles (5.27.2): pyproject.toml's floors are exactly those, so a newer
# grpcio-tools raises the floors (older environments cannot install the package).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m grpc_tools.protoc -I. \
  --python_out=. --grpc_python_out=. \
  a3po_jax/inference/remote/inference.proto
echo "generated a3po_jax/inference/remote/inference_pb2.py and inference_pb2_grpc.py"
