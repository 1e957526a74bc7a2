"""Conversions between the host's types and the `inference.proto` messages, and gRPC limits.

Inference layer (remote).

Shared by `grpc_server.py` and `grpc_client.py` so both sides agree on every field.

An error result's `ErrorKind` travels in the wire field `finish_reason`, as the kind's value
name ("sample_failed", "transport", ...) in place of "error": the proto has no field of its
own for it, and a whole-field value is read back by an exact lookup, never by parsing text.
"""

from __future__ import annotations

import hmac
from typing import Any

import numpy as np

from a3po_jax.inference.remote import inference_pb2 as pb
from a3po_jax.inference.types import ErrorKind, GenerateRequest, SampleResult, SamplingParams

# Caps on one message: room for a long result (weights travel outside gRPC).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
AUTH_HEADER = "authorization"
TOKEN_ENV = "A3PO_HOST_TOKEN"


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),)


def token_matches(metadata: Any, token: str) -> bool:
    """Constant-time check of the `authorization: Bearer <token>` metadata."""
    sent = ""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            sent = value if isinstance(value, str) else value.decode("utf-8", "replace")
    return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())


# Fields that cross the wire as they are, by the same name on both sides (the token tuples
# become repeated fields and back).
_REQUEST_FIELDS = ("request_id", "num_samples", "seed")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")


def _fields(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


def request_to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    s = request.sampling
    return pb.GenerateRequest(
        **_fields(request, _REQUEST_FIELDS),
        prompt_tokens=list(request.prompt_tokens),
        sampling=pb.SamplingParams(**_fields(s, _SAMPLING_FIELDS), stop_tokens=list(s.stop_tokens)),
    )


def request_from_proto(message: pb.GenerateRequest) -> GenerateRequest:
    """ValueError (naming the field) for a bad request, as the in-process host raises."""
    if not message.HasField("sampling"):
        raise ValueError("sampling is missing from the request")
    s = message.sampling
    return GenerateRequest(
        **_fields(message, _REQUEST_FIELDS),
        prompt_tokens=tuple(message.prompt_tokens),
        sampling=SamplingParams(**_fields(s, _SAMPLING_FIELDS), stop_tokens=tuple(s.stop_tokens)),
    )


def result_to_proto(result: SampleResult) -> pb.SampleResult:
    kind = result.error_kind
    return pb.SampleResult(
        request_id=result.request_id,
        sample_index=result.sample_index,
        prompt_tokens=result.prompt_tokens.tolist(),
        tokens=result.tokens.tolist(),
        logprobs=result.logprobs.tolist(),
        versions=result.versions.tolist(),
        finish_reason=result.finish_reason if kind is None else kind.value,
        error=result.error or "",
        timing={k: float(v) for k, v in result.timing.items()},
    )


def result_from_proto(message: pb.SampleResult) -> SampleResult:
    if message.finish_reason in ("stop", "length"):
        finish_reason, error_kind = message.finish_reason, None
    else:  # an ErrorKind value (ValueError on anything else: a host speaking another protocol)
        finish_reason, error_kind = "error", ErrorKind(message.finish_reason)
    return SampleResult(
        request_id=message.request_id,
        sample_index=message.sample_index,
        prompt_tokens=np.asarray(message.prompt_tokens, np.int32),
        tokens=np.asarray(message.tokens, np.int32),
        # float32 on the wire, so the host's float32 log-probs arrive bit for bit.
        logprobs=np.asarray(message.logprobs, np.float32),
        versions=np.asarray(message.versions, np.int32),
        finish_reason=finish_reason,
        error=message.error or None,
        timing=dict(message.timing),
        error_kind=error_kind,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, bool | int | float | np.integer | np.floating)


def stats_to_proto(stats: dict[str, Any]) -> pb.StatsResponse:
    """Numbers as values, other stats as text; a table of numbers (``loop_s``) travels as
    ``key/entry`` values, which `stats_from_proto` puts back together."""
    values, labels = {}, {}
    for key, value in stats.items():
        if _is_number(value):
            values[key] = float(value)
        elif isinstance(value, dict) and all(_is_number(v) for v in value.values()):
            values.update({f"{key}/{k}": float(v) for k, v in value.items()})
        else:
            labels[key] = str(value)
    return pb.StatsResponse(values=values, labels=labels)


# Stats that are counts or flags in InferenceHost.stats(); everything else stays a float.
_INT_STATS = (
    "slots_busy",
    "num_slots",
    "queue_depth",
    "version",
    "samples_done",
    "tokens_generated",
    "decode_steps",
    "weight_updates",
    "kv_recomputes",
    "kv_recompute_tokens",
    "weight_port",
)
_BOOL_STATS = ("update_pending", "live", "batch_invariant")


def stats_from_proto(message: pb.StatsResponse) -> dict[str, Any]:
    out: dict[str, Any] = dict(message.labels)
    for key, value in message.values.items():
        if "/" in key:  # an entry of a table of numbers
            table, entry = key.split("/", 1)
            out.setdefault(table, {})[entry] = value
        elif key in _INT_STATS:
            out[key] = int(value)
        elif key in _BOOL_STATS:
            out[key] = bool(value)
        else:
            out[key] = value
    return out
