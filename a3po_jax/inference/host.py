"""In-process continuous-batching inference host: a serving thread over `EngineCore`.

Inference layer (host-side shell).

The trainer talks to it through `submit` / `poll` / `update_weights` / `stats` (the gRPC
client in `grpc_client.py` offers the same methods for a host in another process). One
thread owns the engine and runs the serving loop (`serving_loop.py`).

Weight updates (`update_weights`) are validated in the caller's thread (names, shapes and
dtypes must match the serving params, else ValueError and the old weights keep serving),
then staged; the serving thread swaps them in at a decode-step boundary, when the host's
update policy allows (`update_policy.py`: "in_flight", the default, recomputes the running
samples' caches at the swap; "in_flight_keep_cache" does not; "drain" first finishes the
requests submitted before the update).

A decode step always runs with one params object, so versions never mix inside a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model as model_lib
from a3po_jax.inference import update_policy as update_policy_lib
from a3po_jax.inference.engine import decode_layout, engine_core
from a3po_jax.inference.host_metrics import THROUGHPUT_WINDOW_S
from a3po_jax.inference.serving_loop import ServingLoop
from a3po_jax.inference.transfer import weight_sync
from a3po_jax.inference.transfer.layout import WIRE_LAYOUT
from a3po_jax.inference.types import (
    GenerateRequest,
    HostClosedError,
    SampleResult,
)

log = logging.getLogger(__name__)

DEFAULT_PREFILL_BUCKETS = (32, 64, 128, 256)
# Default decode room past the largest prompt bucket (the cache is read at every step, so a
# much larger default would slow every decode step for nothing).
DEFAULT_DECODE_ROOM = 512


class InferenceHost(ServingLoop):
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
      update_policy: "in_flight", "in_flight_keep_cache" or "drain" (`update_policy.py`).
      seed: host seed mixed into every request seed (0 = request seeds used as they are).
      cache_dtype: KV cache dtype (default: the model's compute dtype).
      mesh: the devices it serves on (`EngineCore`: slots over ``data``, weights and cache
        heads over ``tensor``); default this process's first device.
      batch_invariant: a sample's tokens and log-probs depend only on its prompt, seed and
        weights, never on the samples beside it (`EngineCore`; its cost is in
        docs/performance.md).
    """

    # Its weights live in this process: the trainer's initial params serve as they are, and
    # a push's replaced copy is this process's memory to give back (training/heap.py).
    in_process = True

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
        policy = update_policy_lib.update_policy(update_policy)  # ValueError if unknown
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
        super().__init__(self._core, policy, seed, self._serving_split(params), int(version))
        self._thread: threading.Thread | None = None

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
            self._metrics.requests += 1
            self._metrics.samples_requested += request.num_samples
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
        """The layout `install_serving` takes: ``{"name": WIRE_LAYOUT,
        "out_major", "shards"}`` (`decode_layout.DecodeParams`)."""
        split = self._decode_params
        return {
            "name": WIRE_LAYOUT,
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
        metrics = self._metrics
        with self._lock:
            recent = [(t, n) for t, n in metrics.recent if now - t <= THROUGHPUT_WINDOW_S]
            unreturned = sum(self._in_flight.values())  # waiting or running samples
            staged = self._staged is not None
        busy = sum(s is not None for s in self._slots)
        return {
            "slots_busy": busy,
            "num_slots": self.num_slots,
            # Samples submitted and not yet started (waiting for a slot).
            "queue_depth": max(0, unreturned - busy),
            "version": self._version,
            "update_pending": staged,
            "update_policy": self.update_policy,
            "batch_invariant": self._core.batch_invariant,
            "tokens_per_s": metrics.tokens_per_s(recent, now),
            **metrics.totals(),
            "live": self._thread is not None and self._thread.is_alive(),
        }

    def counters(self) -> dict[str, Any]:
        """Sample accounting, as `HostPool.counters` (lost = came back as an error)::

        samples_requested = samples_delivered + samples_lost + samples_outstanding
        """
        with self._lock:
            return self._metrics.counters(sum(self._in_flight.values()))

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
        split = self._core.place_and_split(params)

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
