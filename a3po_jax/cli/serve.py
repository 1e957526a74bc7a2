"""Serve an inference host over gRPC: `python -m a3po_jax.cli.serve --model tiny --port 50051`."""

import sys

from a3po_jax.inference.grpc_server import main

if __name__ == "__main__":
    sys.exit(main())
