"""Fuzz the gRPC host's decoding: random, truncated and mutated messages to every RPC, with
and without the token. The server must answer each with an error status (or ignore it)
and stay alive, serving correct results afterwards."""

import random

import grpc
import pytest
from inference_reference import start_grpc_server, stop_grpc_server

from a3po_jax.inference import inference_pb2 as pb
from a3po_jax.inference.grpc_client import GrpcInferenceClient
from a3po_jax.inference.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow
SERVICE = "/a3po_jax.inference.InferenceHost/"


def valid_request_bytes() -> bytes:
    return pb.GenerateRequest(
        request_id="fuzz", prompt_tokens=[5, 6, 7], num_samples=1
    ).SerializeToString()


def mutations(rng: random.Random, n: int):
    base = valid_request_bytes()
    for i in range(n):
        kind = i % 4
        if kind == 0:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        elif kind == 1:
            yield base[: rng.randint(0, len(base) - 1)]  # truncated
        elif kind == 2:
            b = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            yield bytes(b)
        else:
            yield b"\xff" * rng.randint(1, 32)  # invalid varints


def test_server_survives_random_and_truncated_messages(tmp_path):
    token_file = tmp_path / "token"
    proc, address = start_grpc_server(
        token_file, "--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96"
    )
    token = token_file.read_text().strip()
    rng = random.Random(0)
    statuses = set()
    try:
        with grpc.insecure_channel(address) as channel:
            identity = dict(request_serializer=None, response_deserializer=None)
            unary = {m: channel.unary_unary(SERVICE + m, **identity) for m in ("Health", "Stats")}
            stream_out = channel.unary_stream(SERVICE + "Generate", **identity)
            stream_in = channel.stream_unary(SERVICE + "UpdateWeights", **identity)
            for i, payload in enumerate(mutations(rng, 80)):
                metadata = (("authorization", f"Bearer {token}"),) if i % 2 else ()
                try:
                    if i % 4 == 0:
                        unary["Health" if i % 8 else "Stats"](
                            payload, metadata=metadata, timeout=10
                        )
                    elif i % 4 == 1:
                        for _ in stream_out(payload, metadata=metadata, timeout=10):
                            pass
                    else:
                        stream_in(iter([payload, payload[::-1]]), metadata=metadata, timeout=10)
                except grpc.RpcError as err:
                    statuses.add(err.code())
                assert proc.poll() is None, f"server died on message {i}: {payload!r}"
        # Garbage was refused with error statuses, never by crashing or hanging.
        assert statuses and grpc.StatusCode.DEADLINE_EXCEEDED not in statuses
        client = GrpcInferenceClient(address, token)
        assert client.health()
        client.submit(
            GenerateRequest("after", (5, 6, 7), 1, SamplingParams(temperature=0, max_new_tokens=3))
        )
        results = []
        while not results:
            results = client.poll(timeout=5.0)
        assert results[0].finish_reason in ("stop", "length") and len(results[0].tokens) >= 1
        client.close()
    finally:
        stop_grpc_server(proc)
