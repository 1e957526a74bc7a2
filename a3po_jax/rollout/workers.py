"""The producer and collector threads between an inference host and the trainer.

Rollout layer (host-side shell; design §5).

* **producer**: admits prompts under the staleness budget
  (:class:`a3po_jax.rollout.admission.StalenessController`), renders them with the chat
  template and submits one request of G samples per prompt to the inference host;
* **collector**: polls finished samples from the host, scores them into rewards through
  the reward stage (:class:`a3po_jax.rollout.scoring.RewardStage`: the task's verifier per
  sample, or a reward model per whole group) and files them in the
  :class:`a3po_jax.rollout.queue.RolloutQueue`.

The trainer (the caller's thread) takes whole groups with :meth:`RolloutWorkers.get_batch`
and reports its version with :meth:`RolloutWorkers.notify_version`. Threads, the host's
sockets and the queue live here; nothing here enters jit.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.protocol import Host
from a3po_jax.inference.types import ErrorKind, GenerateRequest, SampleResult, SamplingParams
from a3po_jax.rollout.admission import StalenessController
from a3po_jax.rollout.queue import ZERO_VARIANCE, RolloutQueue
from a3po_jax.rollout.resume import consumed_admissions, pending_entries, resume_plan
from a3po_jax.rollout.scoring import RewardStage
from a3po_jax.rollout.side_channel import SideChannel
from a3po_jax.rollout.waiting import QueueClosed, RolloutTimeout, WaitInterrupted
from a3po_jax.tasks import PromptIterator, RewardConfig, render_prompt
from a3po_jax.tasks.scorers import Scorer

log = logging.getLogger(__name__)


def request_seed(run_seed: int, group_id: int) -> int:
    """Sampling seed of a group: a pure function of (run seed, group id), so a resumed run
    draws the same samples as an uninterrupted one."""
    digest = hashlib.sha256(f"{run_seed}:{group_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RolloutWorkers:
    """Producer and collector threads feeding a :class:`RolloutQueue` from a host.

    Args:
      host: the inference host (``submit``, ``poll``).
      task: the task (``score``/``format_ok``: the verifier and the format bonus).
      tokenizer: renders prompts and decodes completions.
      prompts: the prompt order (one prompt per group); its state is checkpointed.
      sampling: sampling parameters of every request.
      reward_config: reward shaping.
      scorer: what scores the completions (``task.reward``,
        :func:`a3po_jax.tasks.scorers.resolve_scorer`); None: the task's verifier.
      score_per_group: score a group's G samples in one call once the group is whole (a
        reward model); else each sample as it finishes.
      group_size: G, samples per prompt.
      batch_groups: B, groups per trainer batch.
      max_staleness: η in optimizer versions
        (:func:`a3po_jax.training.config.staleness_bound`).
      versions_per_batch: k, optimizer steps per batch (``algo.num_minibatches``).
      seed: the run seed (request seeds derive from it and the group id).
      ledger: a :class:`a3po_jax.rollout.ledger.Ledger` (or None): admissions, drops,
        trained groups, checkpoints and re-issues are logged to it (may also be set as the
        ``ledger`` attribute before :meth:`start`/:meth:`restore`).
      consume_order: ``"completion"`` or ``"admission"`` (``system.consume_order``; see
        :class:`RolloutQueue`); in admission order groups admitted but without a sample yet
        hold back newer ones too.
      dynamic_sampling: filter groups whose samples all got the same reward
        (``rollout.dynamic_sampling``; DAPO, arXiv 2503.14476): each is logged to the ledger
        (``filter``, reason ``zero_variance``) and never trained or re-issued; up to
        ``max_extra_groups`` per training step give their admission back so a fresh
        prompt is drawn in their place, the others leave their batch's slot empty (see
        :class:`RolloutQueue`).
      max_extra_groups: that budget (``rollout.extra_groups_budget``).
      lockstep: no threads: the caller drives an unstarted host itself (:meth:`drive`,
        ``system.lockstep_decode_steps``), so every admission, decode step and result
        lands at a point its own logic fixes and the run is a function of its seed.
    """

    def __init__(
        self,
        *,
        host: Host,
        task: Any,
        tokenizer: Any,
        prompts: PromptIterator,
        sampling: SamplingParams,
        reward_config: RewardConfig,
        group_size: int,
        batch_groups: int,
        max_staleness: int,
        versions_per_batch: int,
        seed: int,
        consume_order: str = "completion",
        ledger: Any = None,
        dynamic_sampling: bool = False,
        max_extra_groups: int = 0,
        lockstep: bool = False,
        scorer: Scorer | None = None,
        score_per_group: bool = False,
    ):
        self.host = host
        self.lockstep = lockstep
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.sampling = sampling
        self.rewards = RewardStage(  # the task and the shaping live in the reward stage
            scorer,
            task=task,
            config=reward_config,
            group_size=group_size,
            per_group=score_per_group,
        )
        self.group_size = group_size
        self.seed = seed
        self.controller = StalenessController(
            batch_groups=batch_groups,
            max_staleness=max_staleness,
            versions_per_batch=versions_per_batch,
        )
        self.queue = RolloutQueue(
            group_size=group_size,
            capacity_groups=self.controller.max_in_flight,
            max_staleness=max_staleness,
            versions_per_batch=versions_per_batch,
            on_drop=self._on_drop,
            consume_order=consume_order,
            # Admitted, not yet consumed (dict.copy is atomic: no lock needed).
            admitted_ids=lambda: self._inflight.copy().keys(),
            filter_zero_variance=dynamic_sampling,
            max_refills=max_extra_groups,
            on_filter=self._on_filter,
        )
        # Group id -> (prompt, admitted version, prompt iterator state before it was drawn).
        self._inflight: dict[int, tuple[Any, int, dict]] = {}
        self._inflight_lock = threading.Lock()
        # Notified whenever a re-issued group leaves `_to_submit` (`wait_submitted`).
        self._reissued = threading.Condition(self._inflight_lock)
        self.ledger = ledger
        # Pending groups of a restored checkpoint, submitted again before any new admission:
        # (group id, prompt, admitted version).
        self._to_submit: list[tuple[int, Any, int]] = []
        # The wire id each pending group was submitted under, and back: a result is filed by
        # looking its request id up, never by parsing it; an id not here (a group dropped
        # earlier, or one a host that outlived an old process still sends) is ignored.
        self._request_ids: dict[int, str] = {}  # group id -> request id
        self._group_of: dict[str, int] = {}  # request id -> group id
        # Groups the trainer consumed and threw away (skipped steps): their admissions were
        # given back, so they do not count against the budget after a resume.
        self._discarded_groups = 0
        # The step of the last consumed(step=...): a checkpoint's state() is that step's.
        self._ledger_step: int | None = None
        # Request id -> the side channel whose request it is (held-out evaluation on this
        # host): the collector hands those results over instead of ignoring them.
        self._side_routes: dict[str, SideChannel] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._started = False

    # ------------------------------------------------------------------ the trainer's side

    def start(self) -> None:
        if self.lockstep:
            self._started = True  # (no threads: drive() does their work)
            return
        for fn in (self._producer, self._collector):
            thread = threading.Thread(
                target=self._guarded, args=(fn,), name=f"a3po-{fn.__name__[1:]}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def drive(self) -> bool:
        """Lockstep: one iteration of the (unstarted) host's serving loop, between the
        producer's and the collector's work done in this thread: every group the staleness
        budget admits now is submitted first, and every sample the host finished is filed
        after. True if the host ran a decode step."""
        self._pump()
        stepped = self.host.serve_once()
        self._pump()
        return stepped

    def _pump(self, *, admit: bool = True) -> None:
        while self._submit_next(timeout=0, admit=admit):
            pass
        for res in self.host.poll(timeout=0):
            self._file(res)

    def raise_if_failed(self) -> None:
        """Re-raises (chained) the exception that stopped a worker thread, if any."""
        if self._error is not None:
            raise RuntimeError("a rollout thread failed") from self._error

    def get_batch(self, num_groups: int, **wait: Any) -> list[RolloutGroup]:
        """``num_groups`` whole groups from the queue (`RolloutQueue.get_batch`, which
        ``wait`` goes to: ``trainer_version``, ``timeout``, ``interrupted``); a worker's
        failure is raised here."""
        self.raise_if_failed()
        try:
            return self.queue.get_batch(num_groups, **wait)
        except QueueClosed:
            self.raise_if_failed()
            raise

    def consumed(
        self,
        groups: list[RolloutGroup],
        *,
        step: int | None = None,
        version: int | None = None,
        skipped: bool = False,
    ) -> None:
        """The trainer is done with ``groups``: they are no longer pending.

        Args:
          groups: the groups the step took.
          step: the training step that consumed them (1-based, the checkpoint's step); with
            a ledger, logged as ``train`` (or ``drop``/``nonfinite_step`` when ``skipped``),
            and the next :meth:`state` is taken as that step's checkpoint.
          version: the version the step started from (logged).
          skipped: the step was skipped (non-finite); the trainer also calls :meth:`discard`.
        """
        with self._inflight_lock:
            for group in groups:
                self._inflight.pop(group.group_id, None)
                self._unroute(group.group_id)
                if self.ledger is not None and step is not None:
                    if skipped:
                        self.ledger.drop(group.group_id, "nonfinite_step", step=step)
                    else:
                        self.ledger.train(group.group_id, step=step, version=version)
            if step is not None:
                self._ledger_step = int(step)

    def discard(self, num_groups: int) -> None:
        """The trainer threw away consumed groups (a skipped step): give their admissions
        back so the producer can refill."""
        self.controller.release(num_groups)
        with self._inflight_lock:
            self._discarded_groups += num_groups

    def wait_submitted(self, timeout: float | None) -> None:
        """Blocks until every group the staleness budget admits at the notified version,
        and every re-issued group, has been submitted to the host (`RolloutTimeout` after
        ``timeout`` seconds; a failed worker is raised). Threads only: ``drive`` submits
        in the caller's thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._reissued:
            while self._to_submit and not self._stop.is_set():
                if self._error is not None:
                    break  # raised below, outside the lock
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RolloutTimeout(
                        f"{len(self._to_submit)} re-issued groups not submitted in {timeout}s"
                    )
                # Bounded wait: a failing worker or `close` does not notify.
                self._reissued.wait(timeout=0.1 if left is None else min(left, 0.1))
        self.raise_if_failed()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.controller.wait_submitted(timeout=left)
        self.raise_if_failed()

    def notify_version(self, version: int) -> None:
        self.queue.new_refill_window()  # the step is done: fresh refills (dynamic sampling)
        self.controller.notify_version(version)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """JSON-able state for a checkpoint: exactly which groups are pending.

        ``pending_groups`` lists every group admitted and not yet consumed or dropped (group
        id, prompt id, the prompt iterator position it was drawn at, admitted version);
        ``prompt_iterator`` is the position after the newest admitted prompt; plus the
        ``controller`` and ``queue`` counters and ``discarded_groups``. Taken atomically
        with respect to the producer (which draws and records a prompt under the same lock),
        so every prompt drawn is either pending here or consumed/dropped before. With a
        ledger, the snapshot is logged as the ``checkpoint`` of the last consumed step.
        """
        return self.snapshot(hold=False)[0]

    def snapshot(self, *, hold: bool) -> tuple[dict, list[RolloutGroup]]:
        """:meth:`state`, and with ``hold`` the pending groups that are complete in the
        queue (in hand-out order), to be saved beside the checkpoint: the state then lists
        their ids as ``held_groups`` and :meth:`restore` puts them back as they are instead
        of re-issuing them."""
        with self._inflight_lock:
            queue_state, ready = self.queue.snapshot()  # with the pending set: one moment
            held = [g for g in ready if g.group_id in self._inflight] if hold else []
            pending = pending_entries(self._inflight)
            state = {
                "prompt_iterator": self.prompts.state(),
                "pending_groups": pending,
                "discarded_groups": self._discarded_groups,
                "controller": self.controller.state(),
                "queue": queue_state,
            }
            held_ids = [int(g.group_id) for g in held]
            if hold:
                state["held_groups"] = held_ids
            if self.ledger is not None and self._ledger_step is not None:
                self.ledger.checkpoint(
                    self._ledger_step,
                    [p["group_id"] for p in pending],
                    held=held_ids if hold else None,
                )
        return state, held

    def settle(
        self,
        *,
        older_than: int | None,
        timeout: float | None,
        interrupted: Callable[[], bool] | None = None,
    ) -> bool:
        """Before a checkpoint: lets the pending groups that a resume could not regenerate
        exactly become complete, so they are saved (:meth:`snapshot`) instead.

        Threads (``older_than`` = the trainer's version): waits, up to ``timeout`` seconds
        (`RolloutTimeout`), until every pending group admitted at an older version is
        complete in the queue (the resumed weights would generate them one version fresher).
        Lockstep (``older_than`` None): drives the host, admitting nothing, until every
        pending group is complete (their tokens may mix versions). False, with the rest left
        pending, when ``interrupted()`` says stop first.
        """

        def waiting() -> list[int]:
            inflight = self._inflight.copy()  # (atomic: no lock needed)
            return [
                gid
                for gid, (_, version, _) in inflight.items()
                if older_than is None or version < older_than
            ]

        if not self.lockstep:
            try:
                self.queue.wait_complete(waiting, timeout=timeout, interrupted=interrupted)
            except WaitInterrupted:
                return False
            except QueueClosed:
                self.raise_if_failed()  # a worker thread's failure, if that closed it
                raise
            return True
        while True:
            ready = self.queue.ready_ids()
            if all(gid in ready for gid in waiting()):
                return True
            if interrupted is not None and interrupted():
                return False
            self._pump(admit=False)
            stepped = self.host.serve_once()
            self._pump(admit=False)
            if not stepped:
                ready = self.queue.ready_ids()
                left = [gid for gid in waiting() if gid not in ready]
                if left:
                    raise RuntimeError(
                        f"lockstep: the host has nothing left to generate and groups {left} "
                        "are not complete (groups lost?)"
                    )

    def restore(self, state: dict, *, version: int, held: list[RolloutGroup] | None = None) -> None:
        """Restores :meth:`state` before :meth:`start`; the trainer is at ``version``.

        The checkpoint's ``held_groups`` come back as ``held`` (the groups saved beside it,
        read by the caller): they are put into the queue as they were, complete, with their
        admitted versions. The other pending groups are re-issued first (same group ids,
        hence the same request seeds; stamped admitted at ``version``, since the resumed
        weights generate them; still counted against the admission budget), then the prompt
        order continues after the newest admitted prompt: no prompt is drawn twice or
        skipped.

        A checkpoint from before ``pending_groups`` existed resumes the old way (from the
        oldest pending prompt, which may train some prompts a second time), with a warning.
        """
        if "pending_groups" not in state:
            log.warning(
                "checkpoint without pending_groups (written before exactly-once resume): the "
                "prompt order restarts at the oldest pending prompt; prompts admitted after it "
                "and already trained are trained again"
            )
            self.prompts.restore(state["prompt_iterator"])
            self.queue.restore(state["queue"])
            self.controller.restore(
                state["controller"], consumed_groups=int(state["queue"]["consumed_groups"])
            )
            self.controller.notify_version(version)
            return
        held = list(held or ())
        plan = resume_plan(state, held=held, prompts=self.prompts, version=version)
        self.queue.restore(state["queue"], regenerated=True, held=held)
        self._discarded_groups = int(state.get("discarded_groups", 0))
        self.controller.restore(
            state["controller"],
            consumed_groups=consumed_admissions(state),
            in_flight_groups=len(plan),
        )
        self.controller.notify_version(version)
        with self._inflight_lock:
            for group in plan:
                gid, prompt, admitted = group.group_id, group.prompt, group.admitted_at_version
                self._inflight[gid] = (prompt, admitted, {**group.position})
                if group.held:  # complete, as generated before the save
                    if self.ledger is not None:
                        self.ledger.restore_held(gid, prompt.prompt_id, group.position, admitted)
                    continue
                self._to_submit.append((gid, prompt, admitted))
                if self.ledger is not None:
                    self.ledger.reissue(gid, prompt.prompt_id, group.position, admitted)
        held_ids = [g.group_id for g in plan if g.held]
        reissued = [g.group_id for g in plan if not g.held]
        if held_ids:
            log.info("restored %d complete groups saved with the checkpoint", len(held_ids))
        if reissued:
            log.info("re-issuing %d groups pending at the checkpoint: %s", len(reissued), reissued)

    def side_channel(self) -> SideChannel:
        """Requests of the trainer's own on the rollout host, beside the groups (the held-out
        evaluation): no second host, no second copy of the weights. Use it while the threads
        run, as a context manager (:class:`SideChannel`)."""
        return SideChannel(self)

    def close(self, reason: str = "trainer finished") -> None:
        """Stops both threads (waking any blocked one) and waits for them."""
        self._stop.set()
        self.controller.close(reason)
        self.queue.close(reason)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    # ------------------------------------------------------------------ threads

    def _producer(self) -> None:
        while not self._stop.is_set():
            self._submit_next(timeout=0.5)

    def _submit_next(self, timeout: float, *, admit: bool = True) -> bool:
        """Submits one group: a re-issued one first, else (``admit``) one newly admitted
        under the staleness budget (waiting up to ``timeout`` seconds for room). False if
        there was none; raises `QueueClosed` once the controller is closed."""
        with self._inflight_lock:
            # Left in the list until submitted, so that `wait_submitted` sees it.
            reissue = self._to_submit[0] if self._to_submit else None
        if reissue is None and not admit:
            return False
        if reissue is not None:  # pending at the resumed checkpoint: already counted
            group_id, prompt, version = reissue
            # A wire id of its own: a host that outlived the old process may still hold
            # (or deliver) the old "g<id>" request, which must not mix into this one.
            self._submit(group_id, prompt, f"g{group_id}.re{version}")
            with self._reissued:
                self._to_submit.pop(0)
                self._reissued.notify_all()
            return True
        try:
            group_id, version = self.controller.wait_admit(timeout=timeout)
        except RolloutTimeout:
            return False
        try:
            # Drawn and recorded under the lock state() takes: a checkpoint sees every
            # drawn prompt as pending, or the iterator from before it was drawn.
            with self._inflight_lock:
                before = self.prompts.state()
                (prompt,) = self.prompts.next_batch()
                self._inflight[group_id] = (prompt, version, before)
                if self.ledger is not None:
                    self.ledger.admit(group_id, prompt.prompt_id, before, version)
            self._submit(group_id, prompt, f"g{group_id}")
        finally:
            self.controller.submitted()
        return True

    def _submit(self, group_id: int, prompt: Any, request_id: str) -> None:
        """One group's request to the host, under its wire id."""
        with self._inflight_lock:
            self._request_ids[group_id] = request_id
            self._group_of[request_id] = group_id
        tokens = render_prompt(self.tokenizer, prompt)
        self.host.submit(
            GenerateRequest(
                request_id=request_id,
                prompt_tokens=tuple(int(t) for t in tokens),
                num_samples=self.group_size,
                sampling=self.sampling,
                seed=request_seed(self.seed, group_id),
            )
        )

    def _collector(self) -> None:
        while not self._stop.is_set():
            for res in self.host.poll(timeout=0.2):
                self._file(res)

    def _file(self, res: SampleResult) -> None:
        """Files one finished sample: into the queue (scored), to its side channel, or away
        (a group dropped earlier, an old wire id)."""
        with self._inflight_lock:
            side = self._side_routes.get(res.request_id)
            group_id = self._group_of.get(res.request_id)
            entry = None if group_id is None else self._inflight.get(group_id)
        if side is not None:
            side.results.put(res)
            return
        if entry is None:
            return  # a group dropped earlier (e.g. after an error), or an old wire id
        prompt, version, _ = entry
        if res.finish_reason == "error":
            log.warning("group %d failed on the host: %s", group_id, res.error)
            lost = res.error_kind is ErrorKind.LOST
            self.queue.drop_group(group_id, "host_lost" if lost else "host_error")
            self._forget(group_id)
            return
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
        for rollout in self.rewards.add(
            res, text, prompt=prompt, group_id=group_id, version=version
        ):
            self.queue.put(rollout)

    def reward_stats(self) -> dict[str, float]:
        """The reward stage's seconds spent scoring, in total (``time/reward_s``), and the
        bytes of the scorer's weights where it has any (``mem/reward_model_gb``)."""
        return self.rewards.stats()

    @property
    def scorer(self) -> str:
        """What scores this run's completions, ``name@version``."""
        return self.rewards.label

    def _forget(self, group_id: int) -> None:
        self.rewards.forget(group_id)
        with self._inflight_lock:
            self._inflight.pop(group_id, None)
            self._unroute(group_id)

    def _unroute(self, group_id: int) -> None:
        """Forgets a group's wire id (call with the lock held)."""
        request_id = self._request_ids.pop(group_id, None)
        if request_id is not None:
            self._group_of.pop(request_id, None)

    def _on_drop(self, group_id: int, reason: str) -> None:
        """The queue dropped a group (stale, host error, aborted): its admission is given
        back, it is no longer pending, and the ledger says why (atomically with forgetting
        it, so a checkpoint sees it either pending or dropped)."""
        self.controller.release()
        self.rewards.forget(group_id)
        with self._inflight_lock:
            self._unroute(group_id)
            if self._inflight.pop(group_id, None) is not None and self.ledger is not None:
                self.ledger.drop(group_id, reason)

    def _on_filter(self, group_id: int, refilled: bool) -> None:
        """The queue filtered a group (zero reward variance): it is finished, never trained
        nor re-issued, and the ledger says why (atomically with forgetting it, as for a
        drop). Refilled, its admission is given back and the producer draws a fresh prompt;
        otherwise the admission is spent on the empty batch slot the group leaves."""
        if refilled:
            self.controller.release()
        with self._inflight_lock:
            self._unroute(group_id)
            if self._inflight.pop(group_id, None) is not None and self.ledger is not None:
                self.ledger.filter(group_id, ZERO_VARIANCE, refilled=refilled)

    def _guarded(self, fn) -> None:
        try:
            fn()
        except QueueClosed:
            pass
        except BaseException as err:  # surfaced in the trainer thread by raise_if_failed
            log.exception("%s thread failed", fn.__name__)
            self._error = err
            self._stop.set()
            self.queue.close(f"{fn.__name__} thread failed: {err!r}")
            self.controller.close(f"{fn.__name__} thread failed: {err!r}")
