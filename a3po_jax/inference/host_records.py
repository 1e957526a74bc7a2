"""What the host's serving loop keeps per sample: a sample in a slot, a kept prefill row, a
dispatched step not read yet, and the result a finished sample becomes.

Inference layer (host-side shell).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from a3po_jax.inference.engine import steps
from a3po_jax.inference.types import ErrorKind, GenerateRequest, SampleResult


@dataclasses.dataclass
class SampleRun:
    """Host-side record of one sample occupying a slot."""

    request: GenerateRequest
    sample_index: int
    submitted_at: float
    started_at: float
    # Tokens in the slot's KV cache once every step dispatched so far has run (the serving
    # loop dispatches a step before it reads the previous one's tokens).
    length: int
    prefill_s: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def add(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def finish_reason(self, capacity: int) -> str | None:
        sampling = self.request.sampling
        if self.tokens[-1] in sampling.stop_tokens:
            return "stop"
        if len(self.tokens) >= sampling.max_new_tokens:
            return "length"
        # The last token is fed at the cache length (prompt + tokens but the last); a full
        # cache cannot take it.
        if len(self.request.prompt_tokens) + len(self.tokens) - 1 >= capacity:
            return "length"
        return None

    def needs_step(self, capacity: int) -> bool:
        """Whether a step dispatched now may produce a token this sample keeps: not when the
        tokens already dispatched reach max_new_tokens or fill the cache (a stop token is
        only seen when the tokens are read, one step later)."""
        dispatched = self.length - len(self.request.prompt_tokens) + 1  # insert + steps
        return dispatched < self.request.sampling.max_new_tokens and self.length < capacity


@dataclasses.dataclass
class PrefixEntry:
    """A prefilled prompt (row `row` of a batched prefill) kept until every sample of its
    request has a slot."""

    prefixes: steps.PrefixBatch
    row: int
    version: int
    dispatched_at: float


@dataclasses.dataclass
class Pending:
    """A dispatched step or batch of inserts whose outputs have not been read yet."""

    packed: jax.Array  # [2, N] tokens and log-prob bits (steps.pack_outputs)
    runs: list[SampleRun | None]  # the run each slot's output belongs to (None: unused)
    version: int
    dispatched_at: float


def sample_result(
    run: SampleRun,
    reason: str,
    error_kind: ErrorKind | None = None,
    error: str | None = None,
) -> SampleResult:
    """What a run that ends now (finished or failed) hands to `poll`, with its timings."""
    now = time.monotonic()
    return SampleResult(
        request_id=run.request.request_id,
        sample_index=run.sample_index,
        prompt_tokens=np.asarray(run.request.prompt_tokens, np.int32),
        tokens=np.asarray(run.tokens, np.int32),
        logprobs=np.asarray(run.logprobs, np.float32),
        versions=np.asarray(run.versions, np.int32),
        finish_reason=reason,
        error=error,
        error_kind=error_kind,
        timing={
            "queue_s": run.started_at - run.submitted_at,
            "prefill_s": run.prefill_s,
            "decode_s": now - run.started_at,
            "total_s": now - run.submitted_at,
        },
    )


def is_deleted(state: steps.DecodeState) -> bool:
    """Whether a decode state's buffers are gone (donated to a call that then failed)."""
    return any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
