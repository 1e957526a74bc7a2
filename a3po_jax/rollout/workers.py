"""The producer and collector threads between an inference host and the trainer.

Rollout layer (host-side shell; design §5).

* **producer**: admits prompts under the staleness budget
  (:class:`a3po_jax.rollout.admission.StalenessController`), renders them with the chat
  template and submits one request of G samples per prompt to the inference host;
* **collector**: polls finished samples from the host, scores them with the task's verifier
  into rewards and files them in the :class:`a3po_jax.rollout.queue.RolloutQueue`.

The trainer (the caller's thread) takes whole groups with :meth:`RolloutWorkers.get_batch`
and reports its version with :meth:`RolloutWorkers.notify_version`. Threads, the host's
sockets and the queue live here; nothing here enters jit.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.protocol import Host
from a3po_jax.inference.types import ErrorKind, GenerateRequest, SamplingParams
from a3po_jax.rollout.admission import StalenessController
from a3po_jax.rollout.queue import QueueClosed, RolloutQueue, RolloutTimeout
from a3po_jax.tasks import PromptIterator, RewardConfig, render_prompt, shaped_reward

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
      task: the task (``score``/``format_ok`` through ``shaped_reward``).
      tokenizer: renders prompts and decodes completions.
      prompts: the prompt order (one prompt per group); its state is checkpointed.
      sampling: sampling parameters of every request.
      reward_config: reward shaping.
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
    ):
        self.host = host
        self.task = task
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.sampling = sampling
        self.reward_config = reward_config
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
            on_drop=lambda group_id, reason: self.controller.release(),
            consume_order=consume_order,
            # Admitted, not yet consumed (dict.copy is atomic: no lock needed).
            admitted_ids=lambda: self._inflight.copy().keys(),
        )
        # Group id -> (prompt, admitted version, prompt iterator state before it was drawn).
        self._inflight: dict[int, tuple[Any, int, dict]] = {}
        self._inflight_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ the trainer's side

    def start(self) -> None:
        for fn in (self._producer, self._collector):
            thread = threading.Thread(
                target=self._guarded, args=(fn,), name=f"a3po-{fn.__name__[1:]}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def raise_if_failed(self) -> None:
        """Re-raises (chained) the exception that stopped a worker thread, if any."""
        if self._error is not None:
            raise RuntimeError("a rollout thread failed") from self._error

    def get_batch(
        self, num_groups: int, *, trainer_version: int, timeout: float | None
    ) -> list[RolloutGroup]:
        """``num_groups`` whole groups from the queue; a worker's failure is raised here."""
        self.raise_if_failed()
        try:
            return self.queue.get_batch(
                num_groups, trainer_version=trainer_version, timeout=timeout
            )
        except QueueClosed:
            self.raise_if_failed()
            raise

    def consumed(self, groups: list[RolloutGroup]) -> None:
        """The trainer is done with ``groups``: they no longer hold back the prompt order."""
        for group in groups:
            self._forget(group.group_id)

    def discard(self, num_groups: int) -> None:
        """The trainer threw away consumed groups (a skipped step): give their admissions
        back so the producer can refill."""
        self.controller.release(num_groups)

    def notify_version(self, version: int) -> None:
        self.controller.notify_version(version)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """JSON-able ``prompt_iterator``, ``controller`` and ``queue`` state for a checkpoint.

        Prompts admitted but not trained on are lost with the process: the prompt order
        resumes from the oldest of them (they are drawn again, under new group ids).
        """
        with self._inflight_lock:
            pending = [entry[2] for entry in self._inflight.values()]
        resume_iter = (
            min(pending, key=lambda s: (s["epoch"], s["index"]))
            if pending
            else self.prompts.state()
        )
        return {
            "prompt_iterator": resume_iter,
            "controller": self.controller.state(),
            "queue": self.queue.state(),
        }

    def restore(self, state: dict, *, version: int) -> None:
        """Restores :meth:`state` before :meth:`start`; the trainer is at ``version``."""
        self.prompts.restore(state["prompt_iterator"])
        self.queue.restore(state["queue"])
        self.controller.restore(
            state["controller"], consumed_groups=int(state["queue"]["consumed_groups"])
        )
        self.controller.notify_version(version)

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
            try:
                group_id, version = self.controller.wait_admit(timeout=0.5)
            except RolloutTimeout:
                continue
            except QueueClosed:
                return
            before = self.prompts.state()
            (prompt,) = self.prompts.next_batch()
            tokens = render_prompt(self.tokenizer, prompt)
            with self._inflight_lock:
                self._inflight[group_id] = (prompt, version, before)
            self.host.submit(
                GenerateRequest(
                    request_id=f"g{group_id}",
                    prompt_tokens=tuple(int(t) for t in tokens),
                    num_samples=self.group_size,
                    sampling=self.sampling,
                    seed=request_seed(self.seed, group_id),
                )
            )

    def _collector(self) -> None:
        while not self._stop.is_set():
            for res in self.host.poll(timeout=0.2):
                group_id = int(res.request_id[1:])
                with self._inflight_lock:
                    entry = self._inflight.get(group_id)
                if entry is None:
                    continue  # a group dropped earlier (e.g. after an error)
                prompt, version, _ = entry
                if res.finish_reason == "error":
                    log.warning("group %d failed on the host: %s", group_id, res.error)
                    lost = res.error_kind is ErrorKind.LOST
                    self.queue.drop_group(group_id, "host_lost" if lost else "host_error")
                    self._forget(group_id)
                    continue
                text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
                reward, info = shaped_reward(
                    self.task,
                    prompt,
                    text,
                    finished=res.finish_reason == "stop",
                    num_tokens=len(res.tokens),
                    config=self.reward_config,
                )
                info = {**info, "num_tokens": len(res.tokens)}
                self.queue.put(
                    res.to_rollout(
                        prompt_id=prompt.prompt_id,
                        group_id=group_id,
                        reward=float(reward),
                        info=info,
                        admitted_at_version=version,
                    )
                )

    def _forget(self, group_id: int) -> None:
        with self._inflight_lock:
            self._inflight.pop(group_id, None)

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
