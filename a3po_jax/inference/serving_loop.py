"""The host's serving loop: the thread that owns the engine.

Inference layer (host-side shell).

One thread owns the engine and runs this loop:

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

Threads, queues and clocks live here; everything jitted is in `engine/`.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
import traceback

import jax
import numpy as np

from a3po_jax.inference.engine import decode_layout, engine_core, steps
from a3po_jax.inference.engine.steps import SlotSampling
from a3po_jax.inference.host_metrics import HostMetrics, LoopClock
from a3po_jax.inference.host_records import (
    Pending,
    PrefixEntry,
    SampleRun,
    is_deleted,
    sample_result,
)
from a3po_jax.inference.types import (
    ErrorKind,
    GenerateRequest,
    SampleResult,
    error_result,
)
from a3po_jax.inference.update_policy import UpdatePolicy

log = logging.getLogger(__name__)


class ServingLoop:
    """The serving thread's half of `InferenceHost`: the slots, the waiting samples, the kept
    prefixes, and one iteration of the loop over them. `InferenceHost` adds the interface
    callers use from any thread; the fields under `_lock` are shared by both halves."""

    def __init__(
        self,
        core: engine_core.EngineCore,
        policy: UpdatePolicy,
        seed: int,
        decode_params: decode_layout.DecodeParams,
        version: int,
    ):
        self.seed = seed
        self._core = core
        self._policy = policy
        self._decode_params = decode_params
        self._version = version
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
        self._prefixes: dict[str, PrefixEntry] = {}
        self._slots: list[SampleRun | None] = [None] * core.num_slots
        self._state: steps.DecodeState | None = None
        self._pending: Pending | None = None  # the dispatched step not read yet

        self._metrics = HostMetrics()  # counters for `stats` and `counters`
        self._clock = LoopClock(self._metrics.loop_s)  # the loop's time by part

    @property
    def num_slots(self) -> int:
        return self._core.num_slots

    def _emit(self, result: SampleResult) -> None:
        with self._lock:
            left = self._in_flight.get(result.request_id, 0) - 1
            if left <= 0:
                self._in_flight.pop(result.request_id, None)
            else:
                self._in_flight[result.request_id] = left
            if result.error_kind is not None:
                self._metrics.lost_reasons[result.error_kind.value] += 1
            else:
                self._metrics.samples_delivered += 1
        if result.finish_reason != "error":
            self._metrics.samples_done += 1
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
        clock = self._clock
        clock.start()
        self._take_inbox()
        self._drop_cancelled()
        self._maybe_swap_weights()
        clock.lap("inbox_and_swap")
        inserted = self._admit()
        clock.lap("admit")
        step = self._dispatch_step()
        clock.lap("dispatch")
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
        clock.lap("collect")  # less its waits, which `_collect` charged to their own parts
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
                self._emit(sample_result(run, "error", ErrorKind.CANCELLED, message))
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
            if self._policy.drains and (
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
        self._metrics.weight_updates += 1
        # Prefixes were computed with the old weights; a sample started from one would
        # carry old-weight KV (and, under "drain", span two versions). Recompute instead.
        self._prefixes.clear()
        if self._policy.recomputes_cache:
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
        tokens_recomputed = sum(run.length for _, run in running)
        self._metrics.record_recompute(time.monotonic() - t0, tokens_recomputed)

    def _drain_waiting(self) -> bool:
        """Under "drain" with an update staged: does a sample submitted before it wait?
        (Call with the lock held.) Submit order is kept, so the oldest waiting one decides."""
        return bool(self._waiting) and self._waiting[0][3] < self._staged_seq

    def _admit(self) -> Pending | None:
        """Starts waiting samples in the free slots: the prompts that need a prefill are
        prefilled together (one call per bucket), and every sample starts in one insert
        call per prefill batch; a request's G samples share its prefill row. Nothing is
        read back here (the first tokens are read with the step dispatched after)."""
        free = [slot for slot, run in enumerate(self._slots) if run is None]
        chosen: list[tuple[int, GenerateRequest, int, float]] = []
        while free and self._waiting:
            if self._policy.drains:
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
            if self._state is None or is_deleted(self._state):
                self._state = self._core.init_decode_state()
                self._pending = None
                self._fail_running(ErrorKind.SAMPLE_FAILED, "decode state was lost after an error")
            return None

    def _start_samples(self, chosen: list[tuple[int, GenerateRequest, int, float]]) -> Pending:
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
                    entry = PrefixEntry(prefixes, row, self._version, now)
                    self._prefixes[request.request_id] = entry
        # One insert per prefill batch (usually one), every sample of it at once.
        by_batch: dict[int, list[tuple[int, PrefixEntry, SlotSampling]]] = {}
        runs: list[SampleRun | None] = [None] * self.num_slots
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
            run = SampleRun(
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
        return Pending(out, runs, version, now)

    def _dispatch_step(self) -> Pending | None:
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
        return Pending(packed, runs, self._version, t0)

    def _collect(self, pending: Pending, finished: np.ndarray, *, is_step: bool) -> None:
        """Reads a dispatched step's (or insert's) tokens in one transfer and hands on the
        samples that finished; their slots are marked in `finished` (released by the
        caller). Outputs of a slot whose run has finished meanwhile are dropped."""
        t0 = time.perf_counter()
        tokens, logprobs = steps.unpack_outputs(pending.packed)  # waits for it
        self._clock.waited("decode_wait" if is_step else "prefill_wait", time.perf_counter() - t0)
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
                self._emit(sample_result(run, reason))
        self._metrics.tokens_generated += produced
        if is_step:
            self._metrics.last_step_s = now - pending.dispatched_at
            self._metrics.steps += 1
            with self._lock:
                self._metrics.record_recent(now, produced)

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
                self._emit(sample_result(run, "error", kind, message))

    def _fail_everything(self, message: str) -> None:
        """Fails every running and waiting sample: the host is closing or dead."""
        self._pending = None
        self._take_inbox()
        self._fail_running(ErrorKind.HOST_CLOSED, message)
        while self._waiting:
            request, index, _, _ = self._waiting.popleft()
            self._emit(error_result(request, index, ErrorKind.HOST_CLOSED, message))
        self._prefixes.clear()
