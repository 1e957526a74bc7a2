"""Fuzz the gRPC host's decoding: random, truncated and mutated messages to every RPC, with
and without the token, and the same bytes to its weight port (as they come, and after a
correct token proof). The server must answer each with an error status (or ignore it)
and stay alive, serving correct results afterwards."""

import random
import socket

import grpc
import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server

from a3po_jax.inference.remote import inference_pb2 as pb
from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.inference.transfer import framing
from a3po_jax.inference.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.soak
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
    statuses, refusals = set(), []
    try:
        weight_port = GrpcInferenceClient(address, token).stats()["weight_port"]
        with grpc.insecure_channel(address) as channel:
            identity = dict(request_serializer=None, response_deserializer=None)
            unary = {m: channel.unary_unary(SERVICE + m, **identity) for m in ("Health", "Stats")}
            stream_out = channel.unary_stream(SERVICE + "Generate", **identity)
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
                        refusals.append(send_to_weight_port(weight_port, token, payload, i % 8 > 3))
                except grpc.RpcError as err:
                    statuses.add(err.code())
                assert proc.poll() is None, f"server died on message {i}: {payload!r}"
        # Garbage was refused with error statuses, never by crashing or hanging.
        assert statuses and grpc.StatusCode.DEADLINE_EXCEEDED not in statuses
        assert any(r.startswith(b"ERR ") for r in refusals)  # refused by name, not dropped
        client = GrpcInferenceClient(address, token)
        assert client.health() and client.version == 0  # no garbage was installed
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


def send_to_weight_port(port: int, token: str, payload: bytes, prove_token: bool) -> bytes:
    """Sends `payload` to the weight receiver, first proving the token if asked (so the bytes
    reach the manifest parser); returns what the receiver answered before it hung up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        hello = conn.recv(len(framing.MAGIC) + 32, socket.MSG_WAITALL)
        if prove_token:
            conn.sendall(framing.mac(token.encode(), hello[len(framing.MAGIC) :]))
            kind, length = framing.FRAME.unpack(conn.recv(framing.FRAME.size, socket.MSG_WAITALL))
            assert kind == b"SPEC"
            conn.recv(length, socket.MSG_WAITALL)
        out = b""
        try:
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                out += chunk
        except OSError:  # it hung up (reset, broken pipe) with our bytes unread: a refusal too
            pass
        return out
