"""Synthetic rollout groups for tests and benchmarks: random tokens, chosen shapes.

One factory for every test and benchmark that needs `RolloutGroup`s without running a model
(train step, packing, `scripts/bench_*.py`). It lives with the tests, not in the library:
users never build random rollouts, and the package should not ship test support. The
benchmarks import it too (`scripts/bench_common.py` puts `tests/` on `sys.path`); both run
from a checkout of the repository, never from an installed wheel.

Token ids are drawn from ``[3, vocab)`` so they never collide with the pad / BOS / EOS ids
0-2 of the character tokenizer and SmolLM2.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from a3po_jax.core.types import Rollout, RolloutGroup

# A length: fixed (int), drawn uniformly from an inclusive range (lo, hi), or computed.
PromptLength = int | tuple[int, int] | Callable[[np.random.Generator, int], int]
ResponseLength = int | tuple[int, int] | Callable[[np.random.Generator, int, int], int]

FIRST_TOKEN = 3  # ids 0-2 are special tokens


def _draw(length, rng: np.random.Generator, *index: int) -> int:
    if callable(length):
        return int(length(rng, *index))
    if isinstance(length, tuple):
        lo, hi = length
        return int(rng.integers(lo, hi + 1))
    return int(length)


def synthetic_groups(
    num_groups: int,
    group_size: int,
    prompt_len: PromptLength,
    response_len: ResponseLength,
    vocab: int,
    *,
    versions: int | Callable[[int, int], int] = 0,
    behav_range: tuple[float, float] = (0.5, 3.0),
    admitted_at_version: int = 0,
    seed: int = 0,
) -> list[RolloutGroup]:
    """Complete groups of random prompts and completions, finished with "stop".

    Args:
      num_groups, group_size: G samples of one prompt per group; group g is prompt `p{g}`.
      prompt_len: per group: an int, an inclusive range ``(lo, hi)``, or ``f(rng, g)``.
      response_len: per sample: an int, an inclusive range, or ``f(rng, g, i)`` (0 allowed:
        an empty completion).
      vocab: token ids are drawn from ``[3, vocab)``.
      versions: the policy version stamped on every token of sample i of group g: an int for
        all, or ``f(g, i)`` (e.g. ``lambda g, i: g % 3`` for staleness 0-2 across groups).
      behav_range: behaviour log-probs are ``-uniform(lo, hi)`` per token.
      admitted_at_version: each group's admission version.
      seed: the only source of randomness; equal arguments give equal groups.

    Returns:
      ``num_groups`` groups; rewards are 0 or 1 at random, so GRPO advantages are non-zero
      in most groups.
    """
    rng = np.random.default_rng(seed)
    lo, hi = behav_range
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(FIRST_TOKEN, vocab, size=_draw(prompt_len, rng, g))
        rollouts = []
        for i in range(group_size):
            n = _draw(response_len, rng, g, i)
            version = versions(g, i) if callable(versions) else versions
            rollouts.append(
                Rollout(
                    prompt_id=f"p{g}",
                    group_id=g,
                    sample_index=i,
                    prompt_tokens=prompt,
                    completion_tokens=rng.integers(FIRST_TOKEN, vocab, size=n),
                    behav_logprobs=-rng.uniform(lo, hi, size=n),
                    versions=np.full(n, version, np.int32),
                    finish_reason="stop",
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(RolloutGroup(f"p{g}", g, rollouts, admitted_at_version=admitted_at_version))
    return groups
