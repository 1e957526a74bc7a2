"""A seeded, resumable iterator over a task's prompts, in fixed-size batches.

Tasks layer (host-side shell).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from a3po_jax.tasks.task import Prompt


class PromptIterator:
    """Yields batches of prompts, epoch after epoch, in a seeded order that resumes exactly.

    Epoch `e` visits every prompt once, in the order of a permutation drawn from
    `numpy.random.default_rng([seed, e])` (identity order when `shuffle=False`), so the
    order depends only on (seed, epoch), never on how many batches were drawn before.
    A batch that runs past the end of an epoch continues into the next one: every batch
    has exactly `batch_size` prompts, and no prompt repeats within an epoch.

    The position (`state()`: seed, epoch, index into the epoch's order) is JSON and is
    saved in the trainer's checkpoint; `restore(state)` resumes at the same prompt, even
    mid-epoch.
    """

    def __init__(
        self, prompts: Sequence[Prompt], *, batch_size: int, seed: int, shuffle: bool = True
    ):
        if len(prompts) == 0:
            raise ValueError("PromptIterator.prompts is empty: the task split has no prompts")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"PromptIterator.batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(seed, int):
            raise ValueError(f"PromptIterator.seed must be an int, got {seed!r}")
        self._prompts = prompts
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._index = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices into the prompts, in the order epoch `epoch` visits them."""
        if not self._shuffle:
            return np.arange(len(self._prompts))
        # Seeding with the pair (seed, epoch) makes each epoch's order independent of the
        # others and reproducible from the checkpointed state alone.
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._prompts))

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        return self._order

    def next_batch(self) -> list[Prompt]:
        """The next `batch_size` prompts."""
        batch = []
        while len(batch) < self._batch_size:
            batch.append(self._prompts[int(self._current_order()[self._index])])
            self._index += 1
            if self._index == len(self._prompts):
                self._epoch += 1
                self._index = 0
        return batch

    def state(self) -> dict[str, int]:
        """The position, JSON-serialisable: {"epoch", "index", "seed"}."""
        return {"epoch": self._epoch, "index": self._index, "seed": self._seed}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resume at the position `state()` returned; the next batch continues from there.

        Raises ValueError if the state was saved with another seed or does not fit these
        prompts: resuming a different order silently would repeat or skip prompts.
        """
        for key in ("epoch", "index", "seed"):
            if key not in state or not isinstance(state[key], int):
                raise ValueError(f"PromptIterator.restore: state[{key!r}] must be an int")
        if state["seed"] != self._seed:
            raise ValueError(
                f"PromptIterator.restore: state['seed'] = {state['seed']} but this iterator "
                f"was built with seed {self._seed}"
            )
        if state["epoch"] < 0:
            raise ValueError(f"PromptIterator.restore: state['epoch'] = {state['epoch']} < 0")
        if not 0 <= state["index"] < len(self._prompts):
            raise ValueError(
                f"PromptIterator.restore: state['index'] = {state['index']} is outside "
                f"[0, {len(self._prompts)}) for these {len(self._prompts)} prompts"
            )
        self._epoch = state["epoch"]
        self._index = state["index"]
