"""A deterministic stand-in for a learned reward model, and the one seam it goes in by.

``task.reward=model:PATH`` loads its scorer through
:func:`a3po_jax.tasks.scorers.load_model_scorer`; :func:`use_test_reward_model` puts
:class:`VowelScorer` in its place (with pytest's ``monkeypatch``), so the pipeline's tests
need no trained reward model. A test of a real checkpoint leaves the seam alone and points
``task.reward`` at one (:func:`save_tiny_reward_model`).
"""

from __future__ import annotations

import threading

import numpy as np

VERSION = "test-1"


class VowelScorer:
    """Scores a completion by the fraction of its characters that are vowels (not what the
    letters task's verifier rewards, so proxy and gold differ), float32, batched; keeps the
    size of every call (``calls``)."""

    version = VERSION
    param_bytes = 3 * 2**20  # as a reward model says what its weights take

    def __init__(self, path: str = "test"):
        self.name = f"model:{path}"
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def score(self, prompts, texts) -> np.ndarray:
        assert len(prompts) == len(texts)
        with self._lock:
            self.calls.append(len(texts))
        return np.array([sum(c in "aeiou" for c in t) / max(len(t), 1) for t in texts], np.float32)


def use_test_reward_model(monkeypatch, *, refuse: str | None = None) -> list[VowelScorer]:
    """Makes ``task.reward=model:PATH`` load a :class:`VowelScorer` (PATH need not exist),
    or raise ValueError(``refuse``); returns the list the loaded scorers are appended to."""
    from a3po_jax.tasks import scorers

    loaded: list[VowelScorer] = []

    def load(path, *, tokenizer):
        if refuse is not None:
            raise ValueError(refuse)
        loaded.append(VowelScorer(path))
        return loaded[-1]

    monkeypatch.setattr(scorers, "load_model_scorer", load)
    return loaded


def save_tiny_reward_model(directory, *, seed: int = 0, head_std: float = 0.3):
    """A real reward model on disk: the tiny policy's trunk with a random score head and
    the character tokenizer, saved as the training command saves one; returns its path."""
    from a3po_jax.model.reward_model import init_reward_model, save_reward_checkpoint

    return save_reward_checkpoint(
        init_reward_model("tiny", seed=seed, head_std=head_std), directory
    )
