"""In-process continuous-batching inference host: a serving thread over `EngineCore`.

Inference layer (host-side shell).

The trainer talks to it through `submit` / `poll` / `update_weights` / `stats` (the gRPC
client in `grpc_client.py` offers the same methods for a host in another process). One
thread owns the engine and runs this loop:

    apply a staged weight update if the policy allows it now
    admit queued samples into free slots: the waiting prompts prefilled together (one call
      per bucket; a request's G samples share its row), every sample inserted in one call
    dispatch decode step n + 1 for all slots (JAX runs it asynchronously)
    read step n's tokens (one [2, N] device -> host copy) and the new samples' first
      tokens; stamp each with the version its step ran with; hand finished samples to `poll`

The host's work on step n thus overlaps step n + 1 on the device, and nothing waits per
request. A sample that stopped at step n computes one more token in step n + 1, which is
dropped (the batch shape is fixed, so its slot costs nothing extra); samples that end by
length are left out of the step they no longer need.

Threads, queues and clocks live here; everything jitted is in `engine_core.py`.

Weight updates (`update_weights`) are validated in the caller's thread (names, shapes and
dtypes must match the serving params, else ValueError and the old weights keep serving),
then staged; the serving thread swaps them in at a decode-step boundary:

* ``"in_flight"`` (AReaL, the default): at the next boundary. Every running sample's KV
  cache is first recomputed under the new weights (one batched prefill of prompt + tokens so
  far, `EngineCore.recompute_cache`), as AReaL's interruptible rollout does, then decoding
  continues. Each token's behaviour log-prob is therefore its probability under the version
  stamped on it, given the whole sequence before it: tokens stamped v equal a cache-free
  recomputation under v, tokens stamped v+1 one under v+1. A sample's version array steps up
  at the swap. The cost (seconds and tokens recomputed per swap) is in `stats()`.
* ``"in_flight_keep_cache"``: the cheaper variant without the recompute. Running samples
  decode on from the cache the old weights computed, so their tokens after the swap come
  from *neither* policy: stamped with the new version, their log-probs are the true sampling
  probabilities but differ from the new weights' probabilities of the same sequence (by
  nats on a random model). Staleness, A-3PO's alpha = 1/d and AReaL's d = 0 rule read the
  stamp as the token's policy, which it then is not; use it only where that is acceptable.
* ``"drain"`` (Periodic Asynchrony): the samples of requests submitted before the update are
  finished with the old weights (those still waiting for a slot are started with them too);
  samples of later requests wait. The swap happens once none of the earlier ones is left, so
  no sample spans two versions and a request's samples share one version. This is what makes
  ``one_step_off`` exactly one step stale: a group submitted while batch t trains is generated
  by version t, even if it only reaches a slot after version t+1 was pushed (the trainer
  pushes t+1 once t serves and every such group was submitted: `Trainer._keep_one_step_off`).

A decode step always runs with one params object, so versions never mix inside a step.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import queue
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model as model_lib
from a3po_jax.inference.engine import decode_layout, engine_core
from a3po_jax.inference.engine.engine_core import SlotSampling
from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    HostClosedError,
    SampleResult,
    error_result,
)

log = logging.getLogger(__name__)

UPDATE_POLICIES = ("in_flight", "in_flight_keep_cache", "drain")
DEFAULT_PREFILL_BUCKETS = (32, 64, 128, 256)
# Default decode room past the largest prompt bucket (the cache is read at every step, so a
# much larger default would slow every decode step for nothing).
DEFAULT_DECODE_ROOM = 512
_THROUGHPUT_WINDOW_S = 10.0


@dataclasses.dataclass
class _SampleRun:
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
class _PrefixEntry:
    """A prefilled prompt (row `row` of a batched prefill) kept until every sample of its
    request has a slot."""

    prefixes: engine_core.PrefixBatch
    row: int
    version: int
    dispatched_at: float


@dataclasses.dataclass
class _Pending:
    """A dispatched step or batch of inserts whose outputs have not been read yet."""

    packed: jax.Array  # [2, N] tokens and log-prob bits (engine_core.pack_outputs)
    runs: list[_SampleRun | None]  # the run each slot's output belongs to (None: unused)
    version: int
    dispatched_at: float


class InferenceHost:
    """Serves `GenerateRequest`s from one model on this process's first device, or on a mesh
    of devices of its own.

    Args:
      config: the model's config.
      params: the model's params (copied: the caller may donate or overwrite its own).
      num_slots: samples decoded concurrently (the decode batch size).
      prefill_buckets: prompt lengths compiled for prefill; the largest bounds prompts.
      max_cache_len: KV cache positions per slot (prompt + generated tokens);
        default min(max bucket + 512, config.max_seq_len).
      version: version number of `params`.
      update_policy: "in_flight", "in_flight_keep_cache" or "drain" (see the module
        docstring).
      seed: host seed mixed into every request seed (0 = request seeds used as they are).
      cache_dtype: KV cache dtype (default: the model's compute dtype).
      mesh: the devices it serves on (`EngineCore`: slots over ``data``, weights and cache
        heads over ``tensor``); default this process's first device.
      batch_invariant: a sample's tokens and log-probs depend only on its prompt, seed and
        weights, never on the samples beside it (`EngineCore`; its cost is in
        docs/performance.md).
    """

    def __init__(
        self,
        config: model_lib.ModelConfig,
        params: Any,
        *,
        num_slots: int = 8,
        prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS,
        max_cache_len: int | None = None,
        version: int = 0,
        update_policy: str = "in_flight",
        seed: int = 0,
        cache_dtype=None,
        mesh=None,
        batch_invariant: bool = False,
    ):
        if update_policy not in UPDATE_POLICIES:
            raise ValueError(
                f"update_policy must be one of {UPDATE_POLICIES}, got {update_policy!r}"
            )
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be an int > 0, got {num_slots!r}")
        if not prefill_buckets or any(int(b) <= 0 for b in prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive lengths, got {prefill_buckets}")
        if not isinstance(version, int | np.integer):
            raise ValueError(f"version must be an int, got {version!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        max_bucket = max(int(b) for b in prefill_buckets)
        if max_cache_len is None:
            max_cache_len = min(max_bucket + DEFAULT_DECODE_ROOM, config.max_seq_len)
        if max_cache_len < max_bucket:
            raise ValueError(
                f"max_cache_len={max_cache_len} is smaller than the largest prefill bucket "
                f"{max_bucket}"
            )
        self.config = config
        self.update_policy = update_policy
        self.seed = seed
        self._core = engine_core.EngineCore(
            config,
            num_slots=num_slots,
            capacity=max_cache_len,
            prefill_buckets=tuple(prefill_buckets),
            cache_dtype=cache_dtype,
            mesh=mesh,
            batch_invariant=batch_invariant,
        )
        self.mesh = self._core.mesh
        # Names, shapes and dtypes an update must match.
        self._params_spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
        )
        # The serving weights: one copy, split per layer (`_serving_split`), made with each
        # update in the caller's thread, so the serving thread never pauses to make it.
        self._decode_params = self._serving_split(params)
        self._version = int(version)

        self._inbox: queue.Queue[tuple[GenerateRequest, int]] = queue.Queue()
        self._results: queue.Queue[SampleResult] = queue.Queue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the fields below
        # Notified when new weights start serving, and when the host closes or dies.
        self._swapped = threading.Condition(self._lock)
        self._staged: tuple[decode_layout.DecodeParams, int] | None = None
        # Submit order: every request gets the next number; a staged update records the
        # number the next request would get ("drain" finishes all requests below it first).
        self._submit_seq = 0
        self._staged_seq = 0
        self._in_flight: dict[str, int] = {}  # request_id -> samples not yet returned
        self._cancelled: set[str] = set()  # request ids to drop at the next iteration
        self._closing = False
        self._dead: str | None = None

        # Owned by the serving thread. Waiting samples: (request, sample index, submit time,
        # submit sequence number).
        self._waiting: collections.deque[tuple[GenerateRequest, int, float, int]] = (
            collections.deque()
        )
        self._prefixes: dict[str, _PrefixEntry] = {}
        self._slots: list[_SampleRun | None] = [None] * num_slots
        self._state: engine_core.DecodeState | None = None
        self._thread: threading.Thread | None = None
        self._pending: _Pending | None = None  # the dispatched step not read yet

        # Counters for `counters` (written under the lock).
        self._requests = 0
        self._samples_requested = 0
        self._samples_delivered = 0
        self._lost_reasons: collections.Counter[str] = collections.Counter()
        # Counters for `stats` (written by the serving thread, read anywhere).
        self._samples_done = 0
        self._tokens_generated = 0
        self._steps = 0
        self._weight_updates = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._last_step_s = 0.0
        # In-flight swaps that recomputed running samples' caches, and what that cost.
        self._kv_recomputes = 0
        self._kv_recompute_tokens = 0
        self._kv_recompute_s = 0.0
        self._last_kv_recompute_s = 0.0
        # Seconds the serving loop spent in each of its parts (totals): where the host loses
        # time between decode steps. "wait" is the part of "collect" blocked on the device;
        # the rest is host work, which the pipelined loop overlaps with the next step.
        self._loop_s: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ public interface

    @property
    def version(self) -> int:
        """Version of the weights currently serving."""
        return self._version

    @property
    def params_spec(self) -> Any:
        """The params' tree with `jax.ShapeDtypeStruct` leaves: the names, shapes and dtypes
        every weight update must have. (The host serves from its per-layer split, not from a
        copy of this tree.)"""
        return self._params_spec

    @property
    def num_slots(self) -> int:
        return self._core.num_slots

    @property
    def max_prompt_length(self) -> int:
        return self._core.max_prompt_length

    @property
    def max_cache_len(self) -> int:
        return self._core.capacity

    def start(self) -> InferenceHost:
        if self._thread is not None:
            raise RuntimeError("InferenceHost.start() called twice")
        if self._state is None:
            self._state = self._core.init_decode_state()
        self._thread = threading.Thread(target=self._serve, name="inference-host", daemon=True)
        self._thread.start()
        return self

    def serve_once(self) -> bool:
        """Runs one iteration of the serving loop in the calling thread.

        For a host that was not started: lets a test or a debugger place a weight update
        between two exact decode steps. Returns True if a decode step ran.
        """
        if self._thread is not None:
            raise RuntimeError("serve_once() is for a host that was not started")
        with self._lock:
            self._check_alive()
        if self._state is None:
            self._state = self._core.init_decode_state()
        return self._iteration(pipelined=False)

    def warmup(self) -> None:
        """Compiles the batched prefill and insert for every (rows, bucket) and the decode
        step for every window, now."""
        self._core.warmup_batched(self._decode_params)

    def close(self) -> None:
        """Stops the serving thread; unfinished samples come back as error results."""
        with self._lock:
            self._closing = True
            self._swapped.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        else:
            self._fail_everything("host closed")

    def __enter__(self) -> InferenceHost:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, request: GenerateRequest) -> None:
        """Queues a request (non-blocking). Bad requests raise ValueError naming the field."""
        if not isinstance(request, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
        self._core.bucket_for(len(request.prompt_tokens))  # ValueError if too long
        bad = [t for t in request.prompt_tokens if t >= self.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_tokens has ids {bad[:4]} outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        with self._lock:
            self._check_alive()
            if request.request_id in self._in_flight:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._in_flight[request.request_id] = request.num_samples
            self._requests += 1
            self._samples_requested += request.num_samples
            self._inbox.put((request, self._submit_seq))
            self._submit_seq += 1
        self._wake.set()

    def poll(self, timeout: float | None = None, max_results: int | None = None):
        """Finished samples, as soon as each finishes (any request, in finishing order).

        Blocks up to `timeout` seconds (None: until at least one result) for the first
        result, then takes whatever else is ready, up to `max_results`. Returns [] on
        timeout; raises HostClosedError if the host is dead and nothing is left.
        """
        if max_results is not None and max_results <= 0:
            raise ValueError(f"max_results must be > 0 or None, got {max_results}")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        out: list[SampleResult] = []
        while True:
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            try:
                out.append(self._results.get(timeout=max(0.0, wait)))
                break
            except queue.Empty:
                if self._results.empty() and (self._closing or self._dead) and not self._busy():
                    if self._dead:
                        raise HostClosedError(f"inference host died: {self._dead}") from None
                    return out
                if deadline is not None and time.monotonic() >= deadline:
                    return out
        while max_results is None or len(out) < max_results:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        return out

    def cancel(self, request_id: str) -> bool:
        """Drops a request's unfinished samples: waiting ones never start, running ones leave
        their slots at the next decode-step boundary; each comes back from `poll` as an error
        result of kind ``CANCELLED``. Returns whether the request was in flight."""
        with self._lock:
            if request_id not in self._in_flight:
                return False
            self._cancelled.add(request_id)
        self._wake.set()
        return True

    def tensor_specs(self) -> list[weight_sync.TensorSpec]:
        """`params_spec` as the ordered (name, dtype, shape) list a weight push sends."""
        return weight_sync.tensor_specs(self._params_spec)

    def update_weights(self, params: Any, version: int) -> None:
        """Stages new weights (validated whole; the old ones serve until the swap).

        Returns once accepted; the swap happens at the next decode-step boundary
        ("in_flight", which then recomputes the running samples' caches, and
        "in_flight_keep_cache") or, under "drain", once every sample of the requests
        submitted before this call has finished with the old weights. A later update staged
        before the swap replaces this one (it never served); the requests to finish first
        stay those submitted before the first of them, so replacing never makes a sample
        staler.
        """
        if not isinstance(version, int | np.integer) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        weight_sync.check_params_match(self._params_spec, params)
        self._stage_split(self._serving_split(params), version)

    def serving_layout(self) -> dict[str, Any]:
        """The layout `install_serving` takes: ``{"name": decode_layout.WIRE_LAYOUT,
        "out_major", "shards"}`` (`decode_layout.DecodeParams`)."""
        split = self._decode_params
        return {
            "name": decode_layout.WIRE_LAYOUT,
            "out_major": split.out_major,
            "shards": split.shards,
        }

    def serving_specs(self) -> list[weight_sync.TensorSpec]:
        """The serving split's tensors (`serving_layout`) as the ordered (name, dtype, shape)
        list a weight push in that layout sends."""
        return weight_sync.tensor_specs(self._decode_params)

    def install_serving(self, arrays: dict[str, np.ndarray], version: int) -> None:
        """`update_weights` of weights already in the serving layout: ``{name: array}`` with
        `serving_specs`' names, shapes and dtypes (ValueError naming the first that differs).
        They are placed on the host's devices as they are, no transform: on a CPU an aligned
        numpy buffer is aliased, so the caller hands its buffers over (never writes them
        again)."""
        if not isinstance(version, int | np.integer) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        current = self._decode_params
        names = weight_sync.flatten_params(current)
        weight_sync.check_names(names, arrays)
        leaves = [arrays[n] for n in names]
        given = [
            weight_sync.TensorSpec(n, np.dtype(a.dtype), np.shape(a))
            for n, a in zip(names, leaves, strict=True)
        ]
        weight_sync.check_specs_match(weight_sync.tensor_specs(current), given)
        split = jax.tree_util.tree_unflatten(jax.tree.structure(current), leaves)
        placed = jax.device_put(split, jax.tree.map(lambda x: x.sharding, current))
        self._stage_split(placed, version)

    def _stage_split(self, split: decode_layout.DecodeParams, version: int) -> None:
        """Stages `split` (the serving layout, on the host's devices) to serve as `version`."""
        jax.block_until_ready(split)  # made here, not on the serving thread's first step
        with self._lock:
            self._check_alive()
            if self._staged is None:
                self._staged_seq = self._submit_seq
            self._staged = (split, int(version))
        self._wake.set()

    def wait_serving(self, version: int, timeout: float) -> bool:
        """Blocks until weights stamped `version` or newer serve, the host closes or dies, or
        `timeout` seconds pass; returns whether they serve.

        When it returns True the weights they replaced are released: an embedded host's
        caller can hand their memory back (`training.heap.trim`) before it allocates more.
        Under "in_flight" the swap comes at the next decode-step boundary (milliseconds, or
        a prefill); under "drain" only once the older requests have finished.
        """
        with self._lock:
            self._swapped.wait_for(
                lambda: self._version >= version or self._closing or bool(self._dead),
                timeout=max(0.0, timeout),
            )
            return self._version >= version

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if now - t <= _THROUGHPUT_WINDOW_S]
            unreturned = sum(self._in_flight.values())  # waiting or running samples
            staged = self._staged is not None
        busy = sum(s is not None for s in self._slots)
        span = (now - recent[0][0]) if len(recent) > 1 else 0.0
        tokens = sum(n for _, n in recent[1:]) if len(recent) > 1 else 0
        return {
            "slots_busy": busy,
            "num_slots": self.num_slots,
            # Samples submitted and not yet started (waiting for a slot).
            "queue_depth": max(0, unreturned - busy),
            "version": self._version,
            "update_pending": staged,
            "update_policy": self.update_policy,
            "batch_invariant": self._core.batch_invariant,
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "samples_done": self._samples_done,
            "tokens_generated": self._tokens_generated,
            "decode_steps": self._steps,
            "weight_updates": self._weight_updates,
            "last_step_s": self._last_step_s,
            # Cost of the in-flight cache recompute: swaps that recomputed, tokens
            # recomputed and seconds spent (totals), and the last swap's seconds.
            "kv_recomputes": self._kv_recomputes,
            "kv_recompute_tokens": self._kv_recompute_tokens,
            "kv_recompute_s": self._kv_recompute_s,
            "last_kv_recompute_s": self._last_kv_recompute_s,
            "loop_s": dict(self._loop_s),
            # Seconds the serving loop has spent working (not idle, waiting for requests).
            "busy_s": sum(self._loop_s.values()) - self._loop_s.get("wait", 0.0),
            "live": self._thread is not None and self._thread.is_alive(),
        }

    def counters(self) -> dict[str, Any]:
        """Sample accounting, as `HostPool.counters` (lost = came back as an error)::

        samples_requested = samples_delivered + samples_lost + samples_outstanding
        """
        with self._lock:
            lost = dict(self._lost_reasons)
            return {
                "requests": self._requests,
                "samples_requested": self._samples_requested,
                "samples_delivered": self._samples_delivered,
                "samples_lost": sum(lost.values()),
                "samples_outstanding": sum(self._in_flight.values()),
                "lost_reasons": lost,
            }

    # ------------------------------------------------------------------ helpers (any thread)

    def _serving_split(self, params: Any) -> decode_layout.DecodeParams:
        """`params` as this host serves them: split per layer (`decode_layout.decode_params`, which
        prefill, the cache recompute and the decode step all run on) on the host's device,
        sharing no buffer with `params` (the trainer may donate or overwrite its own).

        The split's layer arrays are new (made by a jitted copy); the embedding, final norm
        and untied head, which the split would share with `params`, are copied. No stacked
        copy is kept: for SmolLM2 in float32 that is 0.43 GB less per serving version, and a
        staged update beside the serving one holds two copies of the weights, not four.
        """
        # On the host's devices first: an alias where `params` already live there as they
        # would be placed (the shared trainer's one-device mesh), so every split compiles to
        # the same program whatever sharding the caller's arrays carry; a device-to-device
        # copy from another device or mesh (split devices).
        split = self._core.split_params(self._core.place_params(params))

        def copy(x):
            return None if x is None else jax.device_put(x, x.sharding, may_alias=False)

        return split.replace(
            embed=copy(split.embed), final_norm=copy(split.final_norm), lm_head=copy(split.lm_head)
        )

    def _check_alive(self) -> None:
        if self._dead:
            raise HostClosedError(f"inference host died: {self._dead}")
        if self._closing:
            raise HostClosedError("inference host is closed")

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._in_flight)

    def _emit(self, result: SampleResult) -> None:
        with self._lock:
            left = self._in_flight.get(result.request_id, 0) - 1
            if left <= 0:
                self._in_flight.pop(result.request_id, None)
            else:
                self._in_flight[result.request_id] = left
            if result.error_kind is not None:
                self._lost_reasons[result.error_kind.value] += 1
            else:
                self._samples_delivered += 1
        if result.finish_reason != "error":
            self._samples_done += 1
        self._results.put(result)

    def _request_seed(self, request: GenerateRequest) -> int:
        if self.seed == 0:
            return request.seed
        digest = hashlib.blake2b(f"{self.seed}:{request.seed}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    # ------------------------------------------------------------------ serving thread

    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    closing = self._closing
                if closing:
                    break
                if not self._iteration(pipelined=True):
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
            self._fail_everything("host closed")
        except Exception as e:  # noqa: BLE001 - the host must report, not vanish
            log.error("inference host died:\n%s", traceback.format_exc())
            with self._lock:
                self._dead = f"{type(e).__name__}: {e}"
                self._swapped.notify_all()
            self._fail_everything(f"inference host died: {type(e).__name__}: {e}")

    def _iteration(self, pipelined: bool = False) -> bool:
        """One pass of the serving loop; True if a decode step was dispatched (pipelined:
        or one was read).

        Pipelined (the serving thread), step n + 1 is dispatched before step n's tokens are
        read: JAX dispatches asynchronously, so the host's work on step n (reading its one
        [2, N] output, stop checks, results) overlaps step n + 1 on the device. A sample
        that stopped at step n computes one more token in step n + 1, which is dropped (the
        batch shape is fixed, so the slot costs nothing extra). Not pipelined
        (`serve_once`), each step's tokens are read before the call returns.
        """
        t0 = time.perf_counter()
        self._take_inbox()
        self._drop_cancelled()
        self._maybe_swap_weights()
        t1 = time.perf_counter()
        inserted = self._admit()
        t2 = time.perf_counter()
        step = self._dispatch_step()
        t3 = time.perf_counter()
        previous, self._pending = self._pending, None
        finished = np.zeros((self.num_slots,), bool)
        if previous is not None:
            self._collect(previous, finished, is_step=True)
        if inserted is not None:
            self._collect(inserted, finished, is_step=False)
        if step is not None:
            if pipelined:
                self._pending = step
            else:
                self._collect(step, finished, is_step=True)
        if finished.any():
            self._state = self._core.release(self._state, finished)
        t4 = time.perf_counter()
        loop = self._loop_s
        loop["inbox_and_swap"] += t1 - t0
        loop["admit"] += t2 - t1
        loop["dispatch"] += t3 - t2
        loop["collect"] += t4 - t3  # includes "wait" (blocked on the device)
        # Pipelined, reading a step may free slots or allow a swap: go on without sleeping.
        return step is not None or (pipelined and previous is not None)

    def _flush(self) -> None:
        """Reads the pending step, so every run's tokens are up to date (before a swap)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        finished = np.zeros((self.num_slots,), bool)
        self._collect(pending, finished, is_step=True)
        if finished.any():
            self._state = self._core.release(self._state, finished)

    def _take_inbox(self) -> None:
        while True:
            try:
                request, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            now = time.monotonic()
            for i in range(request.num_samples):
                self._waiting.append((request, i, now, seq))

    def _drop_cancelled(self) -> None:
        """Ends the samples of cancelled requests (waiting and running)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        if not cancelled:
            return
        message = "request cancelled"
        keep: collections.deque = collections.deque()
        for item in self._waiting:
            if item[0].request_id in cancelled:
                self._emit(error_result(item[0], item[1], ErrorKind.CANCELLED, message))
            else:
                keep.append(item)
        self._waiting = keep
        finished = np.zeros((self.num_slots,), bool)
        for slot, run in enumerate(self._slots):
            if run is not None and run.request.request_id in cancelled:
                finished[slot] = True
                self._slots[slot] = None  # a pending step's token for it is dropped
                self._emit(self._result(run, "error", ErrorKind.CANCELLED, message))
        for request_id in cancelled:
            self._prefixes.pop(request_id, None)
        if finished.any():
            self._state = self._core.release(self._state, finished)

    def _maybe_swap_weights(self) -> None:
        with self._lock:
            staged = self._staged
            if staged is None:
                return
            # Under the lock every request submitted before the update is in the inbox or
            # already waiting: take them so "drain" sees them all.
            self._take_inbox()
            # (A run whose last step is pending still holds its slot: "drain" waits for it.)
            if self.update_policy == "drain" and (
                any(s is not None for s in self._slots) or self._drain_waiting()
            ):
                return
            self._staged = None
        # The pending step ran on the old weights: read it (its tokens carry the old
        # version) so that the recompute sees every running sample's tokens.
        self._flush()
        with self._lock:
            # Rebinding releases the old copy: the step that ran on it was just read, and
            # nothing else here refers to it. So `wait_serving` wakes with it released.
            self._decode_params, self._version = staged
            self._swapped.notify_all()
        self._weight_updates += 1
        # Prefixes were computed with the old weights; a sample started from one would
        # carry old-weight KV (and, under "drain", span two versions). Recompute instead.
        self._prefixes.clear()
        if self.update_policy == "in_flight":
            self._recompute_running()

    def _recompute_running(self) -> None:
        """Rewrites every running sample's KV cache under the serving (new) weights."""
        running = [(slot, run) for slot, run in enumerate(self._slots) if run is not None]
        if not running:
            return
        t0 = time.monotonic()
        longest = max(run.length for _, run in running)
        window = self._core.window_for(longest)
        tokens = np.zeros((self.num_slots, window), np.int32)
        for slot, run in running:
            # The cache holds the prompt and every token but the last (fed at the next step).
            history = (*run.request.prompt_tokens, *run.tokens[:-1])
            assert len(history) == run.length, (len(history), run.length)
            tokens[slot, : run.length] = history
        self._state = self._core.recompute_cache(self._decode_params, self._state, tokens)
        jax.block_until_ready(self._state)
        self._last_kv_recompute_s = time.monotonic() - t0
        self._kv_recompute_s += self._last_kv_recompute_s
        self._kv_recompute_tokens += sum(run.length for _, run in running)
        self._kv_recomputes += 1

    def _drain_waiting(self) -> bool:
        """Under "drain" with an update staged: does a sample submitted before it wait?
        (Call with the lock held.) Submit order is kept, so the oldest waiting one decides."""
        return bool(self._waiting) and self._waiting[0][3] < self._staged_seq

    def _admit(self) -> _Pending | None:
        """Starts waiting samples in the free slots: the prompts that need a prefill are
        prefilled together (one call per bucket), and every sample starts in one insert
        call per prefill batch; a request's G samples share its prefill row. Nothing is
        read back here (the first tokens are read with the step dispatched after)."""
        free = [slot for slot, run in enumerate(self._slots) if run is None]
        chosen: list[tuple[int, GenerateRequest, int, float]] = []
        while free and self._waiting:
            if self.update_policy == "drain":
                with self._lock:
                    if self._staged is not None and not self._drain_waiting():
                        break  # drain: later requests start once the staged weights serve
            request, sample_index, submitted_at, _ = self._waiting.popleft()
            chosen.append((free.pop(0), request, sample_index, submitted_at))
        if not chosen:
            return None
        try:
            return self._start_samples(chosen)
        except Exception as e:  # noqa: BLE001 - one bad batch must not stop the host
            log.error("samples failed to start:\n%s", traceback.format_exc())
            for slot, request, sample_index, _ in chosen:
                self._slots[slot] = None
                if request.request_id in self._in_flight:
                    self._fail_request(request, sample_index, f"{type(e).__name__}: {e}")
            if self._state is None or _is_deleted(self._state):
                self._state = self._core.init_decode_state()
                self._pending = None
                self._fail_running(ErrorKind.SAMPLE_FAILED, "decode state was lost after an error")
            return None

    def _start_samples(self, chosen: list[tuple[int, GenerateRequest, int, float]]) -> _Pending:
        now = time.monotonic()
        # One prefill per bucket for the requests not prefilled yet, in submit order.
        to_prefill: dict[int, dict[str, GenerateRequest]] = {}
        for _, request, _, _ in chosen:
            if request.request_id not in self._prefixes:
                bucket = self._core.bucket_for(len(request.prompt_tokens))
                to_prefill.setdefault(bucket, {})[request.request_id] = request
        rows = self._core.prefill_rows[-1]  # 1 when batch-invariant: each prompt alone
        for requests in to_prefill.values():
            waiting = list(requests.values())
            for group in (waiting[i : i + rows] for i in range(0, len(waiting), rows)):
                prefixes = self._core.prefill_batch(
                    self._decode_params, [r.prompt_tokens for r in group]
                )
                for row, request in enumerate(group):
                    entry = _PrefixEntry(prefixes, row, self._version, now)
                    self._prefixes[request.request_id] = entry
        # One insert per prefill batch (usually one), every sample of it at once.
        by_batch: dict[int, list[tuple[int, _PrefixEntry, SlotSampling]]] = {}
        runs: list[_SampleRun | None] = [None] * self.num_slots
        for slot, request, sample_index, submitted_at in chosen:
            entry = self._prefixes[request.request_id]
            if sample_index == request.num_samples - 1:
                self._prefixes.pop(request.request_id, None)
            s = request.sampling
            slot_sampling = SlotSampling(
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=self._request_seed(request),
                sample_index=sample_index,
            )
            by_batch.setdefault(id(entry.prefixes), []).append((slot, entry, slot_sampling))
            run = _SampleRun(
                request=request,
                sample_index=sample_index,
                submitted_at=submitted_at,
                started_at=now,
                length=len(request.prompt_tokens),
                prefill_s=now - entry.dispatched_at,
            )
            runs[slot] = run
        packed = []
        for items in by_batch.values():
            prefixes = items[0][1].prefixes
            entries = [(entry.row, slot, ss) for slot, entry, ss in items]
            self._state, out = self._core.insert_batch(prefixes, self._state, entries)
            packed.append(out)
        for slot, run in enumerate(runs):
            if run is not None:
                self._slots[slot] = run
        # Each slot's column comes from the one insert that wrote it (the others hold 0).
        out = packed[0] if len(packed) == 1 else sum(packed[1:], packed[0])
        version = self._version
        return _Pending(out, runs, version, now)

    def _dispatch_step(self) -> _Pending | None:
        """Dispatches one decode step for the runs that need one (does not wait for it)."""
        runs = [
            run if run is not None and run.needs_step(self._core.capacity) else None
            for run in self._slots
        ]
        stepping = [run for run in runs if run is not None]
        if not stepping:
            return None
        # Attend only as far as the longest running sample needs (its fed token goes at
        # `length`): a step costs what its samples use, not the whole cache capacity.
        window = self._core.window_for(max(run.length for run in stepping))
        t0 = time.monotonic()
        self._state, packed = self._core.generate_packed(self._decode_params, self._state, window)
        for run in stepping:
            run.length += 1  # the fed token is in the cache once the step has run
        return _Pending(packed, runs, self._version, t0)

    def _collect(self, pending: _Pending, finished: np.ndarray, *, is_step: bool) -> None:
        """Reads a dispatched step's (or insert's) tokens in one transfer and hands on the
        samples that finished; their slots are marked in `finished` (released by the
        caller). Outputs of a slot whose run has finished meanwhile are dropped."""
        t0 = time.perf_counter()
        tokens, logprobs = engine_core.unpack_outputs(pending.packed)  # waits for it
        self._loop_s["wait"] += time.perf_counter() - t0
        now = time.monotonic()
        produced = 0
        for slot, run in enumerate(pending.runs):
            if run is None or self._slots[slot] is not run:
                continue
            if not run.tokens:
                run.prefill_s = now - run.started_at + run.prefill_s
            run.add(int(tokens[slot]), float(logprobs[slot]), pending.version)
            produced += 1
            reason = run.finish_reason(self._core.capacity)
            if reason is not None:
                finished[slot] = True
                self._slots[slot] = None
                self._emit(self._result(run, reason))
        self._tokens_generated += produced
        if is_step:
            self._last_step_s = now - pending.dispatched_at
            self._steps += 1
            with self._lock:
                self._recent.append((now, produced))
                while self._recent and now - self._recent[0][0] > _THROUGHPUT_WINDOW_S:
                    self._recent.popleft()

    def _result(
        self,
        run: _SampleRun,
        reason: str,
        error_kind: ErrorKind | None = None,
        error: str | None = None,
    ) -> SampleResult:
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

    def _fail_request(self, request: GenerateRequest, sample_index: int, message: str) -> None:
        """Fails this sample and the request's samples still waiting (same cause)."""
        self._prefixes.pop(request.request_id, None)
        self._emit(error_result(request, sample_index, ErrorKind.SAMPLE_FAILED, message))
        keep = collections.deque()
        for item in self._waiting:
            if item[0] is request:
                self._emit(error_result(request, item[1], ErrorKind.SAMPLE_FAILED, message))
            else:
                keep.append(item)
        self._waiting = keep

    def _fail_running(self, kind: ErrorKind, message: str) -> None:
        for slot, run in enumerate(self._slots):
            if run is not None:
                self._slots[slot] = None
                self._emit(self._result(run, "error", kind, message))

    def _fail_everything(self, message: str) -> None:
        """Fails every running and waiting sample: the host is closing or dead."""
        self._pending = None
        self._take_inbox()
        self._fail_running(ErrorKind.HOST_CLOSED, message)
        while self._waiting:
            request, index, _, _ = self._waiting.popleft()
            self._emit(error_result(request, index, ErrorKind.HOST_CLOSED, message))
        self._prefixes.clear()


def _is_deleted(state: engine_core.DecodeState) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
