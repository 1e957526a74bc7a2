"""Requests, sampling settings and results exchanged with an inference host.

Inference layer (host-side shell).

These are plain host-side values (no JAX arrays): the in-process `InferenceHost` and the gRPC
client accept and return exactly these, so a trainer is written once for both.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import queue
from typing import Any

import numpy as np

from a3po_jax.core import types as core_types

# "stop" and "length" mean what they mean in `core.types.FINISH_REASONS`; an "error" sample
# never becomes a Rollout (its `error_kind` says why it failed, and its group is dropped).
FINISH_REASONS = ("stop", "length", "error")
# Seeds become two 32-bit PRNG words (see sampling.sample_keys), so any non-negative int64 works.
MAX_SEED = 2**63 - 1


class ErrorKind(enum.Enum):
    """Why a sample came back with ``finish_reason == "error"``.

    The values are stable names: they travel over gRPC as they are (see `grpc_messages`).
    """

    # The host could not serve this sample (it failed to start or the decode state was
    # lost); the request itself was accepted.
    SAMPLE_FAILED = "sample_failed"
    # The host was closed or its serving thread died with the sample unfinished.
    HOST_CLOSED = "host_closed"
    # The host could not be reached (a broken stream, a host gone): not a problem with the
    # request, so `HostPool` re-issues it to another host.
    TRANSPORT = "transport"
    # `HostPool` gave up on the sample (re-issued `max_reissues` times, or refused by the
    # host it was re-issued to); the trainer drops its group as "host_lost".
    LOST = "lost"
    # The request was cancelled (`cancel`, or its gRPC stream ended early: the client is
    # gone) before the sample finished.
    CANCELLED = "cancelled"


class InferenceError(RuntimeError):
    """The host failed while serving (not a problem with the request itself)."""


class HostClosedError(InferenceError):
    """The host was closed or its serving thread died; it accepts no more work."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one sample.

    The behaviour log-prob reported for every sampled token is `log_softmax(logits / T)[token]`
    in float32, taken *before* top-k / top-p truncation (with T == 0, greedy, it is
    `log_softmax(logits)[token]`). That is what a trainer recomputes with
    `token_logprobs(logits / T, targets)`; truncation only changes which tokens can be drawn.
    """

    temperature: float = 1.0  # softmax temperature; 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_new_tokens: int = 64  # generated tokens per sample, the first (from prefill) included
    stop_tokens: tuple[int, ...] = ()  # a sample ends after emitting any of these (kept in tokens)

    def __post_init__(self):
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be an int > 0, got {self.max_new_tokens!r}")
        stop = self.stop_tokens
        if isinstance(stop, int | np.integer) or not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_tokens must be a tuple of token ids >= 0, got {stop!r}")
        # Normalise lists / numpy ints so equal settings compare and hash equal.
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stop))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> SamplingParams:
        """Builds from a dict, rejecting unknown keys by name (a typo must not be ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling setting(s) {unknown}; allowed settings are {sorted(known)}"
            )
        return cls(**settings)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A prompt to complete `num_samples` times (e.g. one GRPO group)."""

    request_id: str  # unique among the requests in flight on one host
    prompt_tokens: tuple[int, ...]  # token ids, at least one
    num_samples: int = 1  # independent samples of this prompt
    sampling: SamplingParams = SamplingParams()
    seed: int = 0  # sample i's token at step t uses key(seed, i, t): batch-independent

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        prompt = self.prompt_tokens
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(
                    f"prompt_tokens must be a 1-D sequence of ints, got array {prompt.dtype}"
                    f"{list(prompt.shape)}"
                )
            prompt = prompt.tolist()
        if isinstance(prompt, str | bytes) or not all(_is_int(t) and t >= 0 for t in prompt):
            raise ValueError(f"prompt_tokens must be a sequence of token ids >= 0, got {prompt!r}")
        if len(prompt) == 0:
            raise ValueError("prompt_tokens is empty: a prompt needs at least one token")
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in prompt))
        if not _is_int(self.num_samples) or self.num_samples <= 0:
            raise ValueError(f"num_samples must be an int > 0, got {self.num_samples!r}")
        if isinstance(self.sampling, dict):
            object.__setattr__(self, "sampling", SamplingParams.from_dict(self.sampling))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams or a dict, got {self.sampling!r}")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "num_samples", int(self.num_samples))
        object.__setattr__(self, "seed", int(self.seed))


@dataclasses.dataclass
class SampleResult:
    """One finished sample: tokens with their behaviour log-probs and policy versions.

    `tokens[r]` was sampled with log-prob `logprobs[r]` (see `SamplingParams` for what that
    log-prob is) while the host served version `versions[r]`. Under the host's "drain" and
    "in_flight" update policies that log-prob is also version `versions[r]`'s probability of
    the token given the whole sequence before it (under "in_flight" the running samples'
    caches are recomputed at a swap). Under "in_flight_keep_cache" tokens after a swap come
    from neither version: stamped with the new one, but decoded on the old weights' cache.
    On `finish_reason == "error"` the arrays hold what was produced before the failure
    (possibly nothing), `error_kind` says what failed and `error` says why in words.
    """

    request_id: str
    sample_index: int
    prompt_tokens: np.ndarray  # [P] int32
    tokens: np.ndarray  # [R] int32
    logprobs: np.ndarray  # [R] float32
    versions: np.ndarray  # [R] int32
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None  # set when finish_reason == "error": what went wrong, in words
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    error_kind: ErrorKind | None = None  # set exactly when finish_reason == "error"

    def __post_init__(self):
        self.prompt_tokens = np.asarray(self.prompt_tokens, dtype=np.int32).reshape(-1)
        self.tokens = np.asarray(self.tokens, dtype=np.int32).reshape(-1)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, dtype=np.int32).reshape(-1)
        if not self.tokens.shape == self.logprobs.shape == self.versions.shape:
            raise ValueError(
                f"tokens {self.tokens.shape}, logprobs {self.logprobs.shape} and versions "
                f"{self.versions.shape} must have the same shape [R]"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if self.error_kind is not None:
            self.error_kind = ErrorKind(self.error_kind)  # also accepts the value name
        if (self.finish_reason == "error") != (self.error_kind is not None):
            raise ValueError(
                f"error_kind must be set exactly when finish_reason is 'error', got "
                f"finish_reason={self.finish_reason!r}, error_kind={self.error_kind!r}"
            )

    def to_rollout(
        self,
        *,
        prompt_id: str,
        group_id: int,
        reward: float | None = None,
        info: dict | None = None,
        admitted_at_version: int | None = None,
    ) -> core_types.Rollout:
        """This sample as the core's `Rollout` (the one conversion from a host sample).

        Completion tokens, behaviour log-probs and versions are taken as they are; the
        finish reason keeps its meaning. An error sample cannot be trained on: ValueError
        (drop its group instead, see `error_kind`).
        """
        if self.finish_reason == "error":
            raise ValueError(
                f"sample {self.sample_index} of {self.request_id!r} failed "
                f"({self.error_kind.value}: {self.error}); it has no Rollout"
            )
        return core_types.Rollout(
            prompt_id=prompt_id,
            group_id=group_id,
            sample_index=self.sample_index,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.tokens,
            behav_logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
            reward=reward,
            info={} if info is None else info,
            admitted_at_version=admitted_at_version,
        )


def error_result(
    request: GenerateRequest, sample_index: int, kind: ErrorKind, message: str
) -> SampleResult:
    """A result that reports a failure of one sample, with no tokens."""
    empty = np.zeros((0,), np.int32)
    return SampleResult(
        request_id=request.request_id,
        sample_index=sample_index,
        prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
        tokens=empty,
        logprobs=np.zeros((0,), np.float32),
        versions=empty,
        finish_reason="error",
        error=message,
        error_kind=kind,
    )


def take_results(results: queue.Queue, timeout: float | None, max_results: int | None) -> list:
    """`poll` over a queue of results: wait up to `timeout` (None: forever) for the first,
    then take whatever else is ready, up to `max_results`. [] on timeout."""
    if max_results is not None and max_results <= 0:
        raise ValueError(f"max_results must be > 0 or None, got {max_results}")
    out = []
    try:
        out.append(results.get(timeout=timeout))
    except queue.Empty:
        return out
    while max_results is None or len(out) < max_results:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            break
    return out
