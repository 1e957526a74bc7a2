"""What scores a completion before reward shaping: the task's verifier or a learned reward
model, behind one interface, chosen by ``task.reward``.

Tasks layer (host-side shell).

A :class:`Scorer` has a ``name`` (``"verifier:<task>"``, ``"model:<path>"``), a ``version``
(what a recorded score is reproducible from: ``"1"`` for a verifier, the content hash of a
reward model's weights) and ``score(prompts, texts)``, one float per completion, batched.
``task.reward`` names one through :data:`REWARD_SOURCES`:

==================  ==================================================  =================
``task.reward``     the scorer                                          scored
==================  ==================================================  =================
``verifier``        :class:`VerifierScorer`: the task's ``score``       each sample as it
                    (correctness in [0, 1]; the default)                 finishes
``model:PATH``      :func:`load_model_scorer`: the reward model at       each group, in one
                    ``PATH`` (``a3po_jax.tasks.reward_model_scorer``)    call, once whole
==================  ==================================================  =================

:func:`resolve_scorer` builds the scorer a spec names (before a run starts anything: a bad
path or a tokenizer the reward model was not trained with is refused there), and
:func:`parse_reward` is the one check of a spec's form (the config's ``task.reward``).
Reward shaping (:mod:`a3po_jax.tasks.rewards`) applies on top of whichever scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from a3po_jax.tasks.task import Prompt

DEFAULT_REWARD = "verifier"


@runtime_checkable
class Scorer(Protocol):
    """Scores completions of prompts: one float per completion (higher is better).

    A scorer with weights (a reward model) may also say how many bytes they take
    (``param_bytes``); the run then records it (``mem/reward_model_gb``)."""

    name: str  # what scored: "verifier:<task>", "model:<path>"
    version: str  # what the scores are reproducible from (a weights hash for a model)

    def score(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> np.ndarray:
        """[N] scores of ``texts[i]`` answering ``prompts[i]`` (decoded, special tokens
        removed), computed together."""
        ...


class VerifierScorer:
    """The task's own verifier (``task.score``) as a :class:`Scorer`: name
    ``verifier:<task>``, version ``"1"``. Its scores are float64, exactly the floats
    ``task.score`` returns, so rewards are the same as from ``shaped_reward``."""

    version = "1"

    def __init__(self, task: Any):
        self.task = task
        self.name = f"verifier:{getattr(task, 'name', type(task).__name__)}"

    def score(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> np.ndarray:
        if len(prompts) != len(texts):
            raise ValueError(f"{len(prompts)} prompts for {len(texts)} texts")
        return np.array(
            [float(self.task.score(p, t)) for p, t in zip(prompts, texts, strict=True)],
            np.float64,
        )


def load_model_scorer(path: str, *, tokenizer: Any) -> Scorer:
    """The reward model at ``path`` (``task.reward=model:PATH``), for completions the
    policy's ``tokenizer`` wrote; ValueError for a path with nothing there, a checkpoint
    that is not a reward model, or a tokenizer other than the reward model's.

    The one place a run reaches the reward model's code
    (``a3po_jax.tasks.reward_model_scorer.load_reward_scorer``, imported here, when a run
    asks for it); tests put a scorer of their own in its place.
    """
    if not Path(path).exists():
        raise ValueError(f"no reward model at {path} (nothing is there)")
    from a3po_jax.tasks.reward_model_scorer import load_reward_scorer

    return load_reward_scorer(path, tokenizer=tokenizer)


@dataclasses.dataclass(frozen=True)
class RewardSource:
    """One kind of ``task.reward``.

    Attributes:
      make: ``make(argument, task=..., tokenizer=...)`` -> the :class:`Scorer`
        (``argument``: what follows ``kind:``, None for a kind without one).
      takes_argument: whether the spec is ``kind:ARGUMENT`` (else ``kind`` alone).
      per_group: score a group's G samples in one call once the group is whole (a model's
        forward pass); otherwise each sample as it finishes (a verifier's string check).
      what: the argument, in error messages.
    """

    make: Callable[..., Scorer]
    takes_argument: bool
    per_group: bool
    what: str = ""


def _verifier(argument: str | None, *, task: Any, tokenizer: Any) -> Scorer:
    return VerifierScorer(task)


def _model(argument: str | None, *, task: Any, tokenizer: Any) -> Scorer:
    # Looked up when called, so that a test's replacement of load_model_scorer is seen.
    return load_model_scorer(str(argument), tokenizer=tokenizer)


# task.reward's kinds: "verifier", "model:PATH".
REWARD_SOURCES: dict[str, RewardSource] = {
    "verifier": RewardSource(make=_verifier, takes_argument=False, per_group=False),
    "model": RewardSource(make=_model, takes_argument=True, per_group=True, what="PATH"),
}


def _forms() -> str:
    return ", ".join(
        f"{kind}:{source.what}" if source.takes_argument else kind
        for kind, source in REWARD_SOURCES.items()
    )


def parse_reward(spec: str) -> tuple[RewardSource, str | None]:
    """The source a ``task.reward`` spec names, and its argument (None without one).

    Raises:
      ValueError: an unknown kind, a kind that takes an argument without one (or with an
        empty one), or an argument given to one that takes none.
    """
    if not isinstance(spec, str):
        raise ValueError(f"must be a string ({_forms()}), got {spec!r}")
    kind, colon, argument = spec.partition(":")
    source = REWARD_SOURCES.get(kind.strip())
    if source is None:
        raise ValueError(f"must be one of {_forms()}, got {spec!r}")
    if source.takes_argument:
        if not argument.strip():
            what = source.what
            raise ValueError(f"must be {kind}:{what} with a non-empty {what}, got {spec!r}")
        return source, argument.strip()
    if colon:
        raise ValueError(f"{kind!r} takes no argument, got {spec!r}")
    return source, None


def resolve_scorer(spec: str, *, task: Any, tokenizer: Any) -> tuple[Scorer, bool]:
    """The scorer ``spec`` names (``task.reward``) and whether it scores per group.

    Raises:
      ValueError: a malformed spec, or what the scorer's loader refuses (a path with no
        reward model, a tokenizer mismatch); ImportError where its code is missing.
    """
    source, argument = parse_reward(spec)
    scorer = source.make(argument, task=task, tokenizer=tokenizer)
    for attribute in ("name", "version"):
        if not isinstance(getattr(scorer, attribute, None), str):
            raise ValueError(f"the scorer for {spec!r} has no string {attribute!r}")
    if not callable(getattr(scorer, "score", None)):
        raise ValueError(f"the scorer for {spec!r} has no score(prompts, texts)")
    return scorer, source.per_group


def scorer_label(scorer: Scorer) -> str:
    """``name@version``, how a run's records name the scorer."""
    return f"{scorer.name}@{scorer.version}"
