"""A trained reward model as a scorer of (prompt, completion text) pairs.

Tasks layer (host-side shell): the reward model (`a3po_jax.model.reward_model`) is core; what
turns a task's `Prompt` and a decoded completion into its input lives here, beside
`render_prompt`, because the core may not see a `Prompt`.

The one tokenization both sides use (`reward_model_tokens`): the prompt rendered with the
chat template (`render_prompt`, ending where the model speaks), then the completion encoded
with ``add_special_tokens=False``. The training command (`python -m
a3po_jax.cli.train_reward`) tokenizes its preference pairs with it and the pipeline's
reward stage scores rollouts with it, so a reward model scores what it was trained on.
A sequence longer than ``max_length`` keeps its last ``max_length`` tokens: the score is read
at the last token, and the end of the completion is what is judged.

`load_reward_scorer` reads a reward model directory (what the training command writes, or
any one-label sequence-classification checkpoint) into a `RewardScorer`: batched, jitted
scores, rows padded to a fixed batch and to power-of-two length buckets so that a call does
not compile again once its bucket has been seen.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from a3po_jax.model.checkpoint_io import CheckpointError
from a3po_jax.model.reward_model import (
    RewardModel,
    load_reward_checkpoint,
    reward_scores,
    weights_version,
)
from a3po_jax.tasks.task import Prompt, render_prompt

SMALLEST_BUCKET = 32
# What two tokenizers must encode alike to count as the same vocabulary (beside its size and
# a rendered chat prompt): words, digits and spacing, a boxed answer, a newline.
TOKENIZER_PROBES = ("Hello, world!", " 12 + 7 = 19\n", "The answer is \\boxed{42}.")
_PROBE_PROMPT = Prompt("probe/0", ({"role": "user", "content": "What is 2 + 3?"},), "5")


def reward_model_tokens(tokenizer: Any, prompt: Prompt, completion: str) -> list[int]:
    """The reward model's input for `completion` answering `prompt`: the rendered prompt's
    ids, then the completion's ids (no special tokens added). Training and scoring both
    call this, so both see the same tokens."""
    ids = render_prompt(tokenizer, prompt)
    return ids + list(tokenizer.encode(completion, add_special_tokens=False))


def length_buckets(max_length: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Padded sizes: powers of two from `smallest` below `max_length`, then it."""
    buckets, size = [], smallest
    while size < max_length:
        buckets.append(size)
        size *= 2
    return (*buckets, max_length)


def pad_rows(
    rows: Sequence[Sequence[int]], length: int, batch: int | None = None, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [batch or len(rows), length] int32 tokens and [.] int32 lengths; a row
    longer than `length` keeps its last `length` tokens, filler rows have length 0."""
    batch = len(rows) if batch is None else batch
    tokens = np.full((batch, length), pad_id, np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i, row in enumerate(rows):
        row = list(row)[-length:]
        tokens[i, : len(row)] = row
        lengths[i] = len(row)
    return tokens, lengths


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` (the largest when none does: truncation)."""
    return next((b for b in buckets if b >= length), buckets[-1])


def check_same_tokenizer(ours: Any, theirs: Any, where: str) -> None:
    """Raises ValueError saying "tokenizer mismatch" when the two tokenizers differ in
    vocabulary size, in the ids of `TOKENIZER_PROBES` or in a rendered chat prompt."""
    problems = []
    if len(ours) != len(theirs):
        problems.append(f"vocabulary size {len(theirs)} vs the reward model's {len(ours)}")
    for probe in TOKENIZER_PROBES:
        a = ours.encode(probe, add_special_tokens=False)
        b = theirs.encode(probe, add_special_tokens=False)
        if list(a) != list(b):
            problems.append(f"{probe!r} encodes to {list(b)[:8]} vs {list(a)[:8]}")
            break
    if not problems and render_prompt(ours, _PROBE_PROMPT) != render_prompt(theirs, _PROBE_PROMPT):
        problems.append("the chat template renders a prompt to other ids")
    if problems:
        raise ValueError(
            f"{where}: tokenizer mismatch: the given tokenizer is not the reward model's "
            f"({'; '.join(problems)})"
        )


@dataclasses.dataclass
class RewardScorer:
    """A reward model that scores (prompt, completion text) pairs; what the pipeline holds."""

    name: str  # "model:<path>"
    version: str  # short content hash of the weights: the same files, the same version
    model: RewardModel
    max_length: int = 1024  # longer inputs keep their last max_length tokens
    batch_size: int = 16  # most rows per forward pass

    def __post_init__(self):
        if self.max_length < 1 or self.batch_size < 1:
            raise ValueError(
                f"{self.name}: max_length and batch_size must be >= 1, got "
                f"{self.max_length}, {self.batch_size}"
            )
        self.buckets = length_buckets(self.max_length)
        # A pass of fewer rows is padded to the next power of two, not to batch_size: a
        # group of G = 2 is scored in 2 rows, not 16, for a program per power of two.
        self.row_buckets = length_buckets(self.batch_size, smallest=1)
        self._scores = jax.jit(functools.partial(reward_scores, config=self.model.config))

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def param_bytes(self) -> int:
        """Bytes the weights take on the device (for a run's memory report)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.model.params))

    def tokens(self, prompt: Prompt, text: str) -> list[int]:
        return reward_model_tokens(self.model.tokenizer, prompt, text)

    def score(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> np.ndarray:
        """float32 [N] rewards of ``texts[i]`` answering ``prompts[i]``."""
        if len(prompts) != len(texts):
            raise ValueError(f"{len(prompts)} prompts but {len(texts)} texts")
        return self.score_tokens([self.tokens(p, t) for p, t in zip(prompts, texts, strict=True)])

    def score_tokens(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 [N] rewards of already tokenized rows (`reward_model_tokens`)."""
        out = np.zeros((len(rows),), np.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # like lengths together
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            length = bucket_for(max(len(rows[i]) for i in chunk), self.buckets)
            tokens, lengths = pad_rows(
                [rows[i] for i in chunk],
                length,
                bucket_for(len(chunk), self.row_buckets),
                self.model.pad_token_id,
            )
            scores = np.asarray(self._scores(self.model.params, tokens, lengths))
            out[chunk] = scores[: len(chunk)]
        return out


def load_reward_scorer(
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    max_length: int = 1024,
    batch_size: int = 16,
    param_dtype: str = "float32",
) -> RewardScorer:
    """Read a reward model directory into a `RewardScorer`.

    Args:
      path: a directory with config.json (a one-label sequence-classification
        architecture), *.safetensors and tokenizer files.
      tokenizer: the run's tokenizer, if any: it must be the reward model's own.
      max_length: longest input scored; longer ones keep their last `max_length` tokens.
      batch_size: rows per forward pass.
      param_dtype: the weights' dtype on the device.
    Raises:
      ValueError: naming `path`, for a missing or unreadable path, a checkpoint that is
        not a reward model, a reward model without tokenizer files (when none is given),
        or (saying "tokenizer mismatch") a `tokenizer` whose vocabulary differs from the
        saved one.
    """
    where = f"reward model {os.fspath(path)!r}"
    directory = pathlib.Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"{where}: no such directory")
    if not os.access(directory / "config.json", os.R_OK):
        raise ValueError(f"{where}: no readable config.json")
    try:
        model = load_reward_checkpoint(directory, param_dtype=param_dtype)
        version = weights_version(directory)
    except (CheckpointError, OSError) as err:
        raise ValueError(f"{where}: {err}") from err
    if model.tokenizer is None:
        if tokenizer is None:
            raise ValueError(f"{where}: no tokenizer files beside the weights")
        model.tokenizer = tokenizer
    elif tokenizer is not None:
        check_same_tokenizer(model.tokenizer, tokenizer, where)
    if len(model.tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"{where}: tokenizer mismatch: {len(model.tokenizer)} tokens but the model's "
            f"vocabulary holds {model.config.vocab_size}"
        )
    return RewardScorer(
        name=f"model:{os.fspath(path)}",
        version=version,
        model=model,
        max_length=max_length,
        batch_size=batch_size,
    )
