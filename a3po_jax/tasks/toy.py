"""`letters`: a procedural toy task a random tiny model can learn in tens of steps on a CPU.

Tasks layer (host-side shell).

Each prompt asks for text made of one target letter; the reward is the fraction of the
completion's characters that equal it::

    score = #{characters == target} / max(#characters, 1)        (0 for an empty completion)

Why this task: staleness effects (naive PPO vs decoupled PPO vs A-3PO as η grows) need a
reward that *moves* within minutes on 2 CPU cores. A randomly initialised 2-layer model
with the character tokenizer (`a3po_jax.model.char_tokenizer`) samples near-uniformly over ~99
characters, so its first rewards are small but spread out within a group (non-zero GRPO
advantages), and the reward is dense (every character counts), so a few dozen optimizer
steps lift it visibly. No download, no verifier library: prompts and scores are pure
functions of the options below.

Prompts are deterministic: prompt `i` of a split is built from `random.Random(seed_of_split
+ i)`, where the test split's seed is offset by `TEST_SEED_OFFSET` (as in
`reasoning_gym_tasks`), so the two splits never share a generator seed. With the default
single target letter both splits ask for the same thing in differently-numbered words; with
several letters (``letters="abc"``) the model must also read the prompt to know which letter
is wanted (slower to learn, a conditional task).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence

from a3po_jax.tasks.task import Prompt

TEST_SEED_OFFSET = 1_000_000_000
SPLITS = ("train", "test")


class LetterTask:
    """Reward = fraction of completion characters equal to the prompt's target letter.

    Args:
      letters: the candidate target letters (lowercase ASCII, no repeats); prompt `i`'s
        target is drawn from them. Default "a": one fixed target, the easiest setting.
      seed: the train split's seed; the test split uses `seed + TEST_SEED_OFFSET`.
      train_size, test_size: number of prompts per split.
    """

    def __init__(
        self,
        *,
        letters: str = "a",
        seed: int = 0,
        train_size: int = 256,
        test_size: int = 64,
    ):
        if not isinstance(letters, str) or not letters:
            raise ValueError(f"letters: letters must be a non-empty string, got {letters!r}")
        if any(c not in string.ascii_lowercase for c in letters) or len(set(letters)) != len(
            letters
        ):
            raise ValueError(
                f"letters: letters must be distinct lowercase ASCII letters, got {letters!r}"
            )
        for field, value in (("train_size", train_size), ("test_size", test_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"letters: {field} must be an int >= 1, got {value!r}")
        if train_size > TEST_SEED_OFFSET:
            raise ValueError(f"letters: train_size must be <= {TEST_SEED_OFFSET}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"letters: seed must be an int >= 0, got {seed!r}")
        self.name = "letters"
        self.splits = SPLITS
        self.letters = letters
        self.seed = seed
        self.sizes = {"train": train_size, "test": test_size}
        self._cache: dict[str, tuple[Prompt, ...]] = {}

    def prompts(self, split: str) -> Sequence[Prompt]:
        """The prompts of `split` ("train" / "test"), in a fixed, deterministic order."""
        if split not in SPLITS:
            raise ValueError(f"letters: unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if split not in self._cache:
            self._cache[split] = tuple(self.make_prompt(split, i) for i in range(self.sizes[split]))
        return self._cache[split]

    def make_prompt(self, split: str, index: int) -> Prompt:
        """Prompt `index` of `split`: a pure function of (seed, split, index)."""
        base = self.seed + (TEST_SEED_OFFSET if split == "test" else 0)
        rng = random.Random(base + index)
        target = rng.choice(self.letters)
        count = rng.randint(3, 12)
        # The number only varies the prompt text; the reward ignores length.
        content = f"Write the letter {target} {count} times."
        return Prompt(
            prompt_id=f"letters/{split}/{index}",
            messages=({"role": "user", "content": content},),
            answer=target,
            metadata={"target": target},
        )

    def score(self, prompt: Prompt, completion_text: str) -> float:
        """Fraction of the completion's characters equal to the target (0 if empty)."""
        target = prompt.metadata["target"]
        if not completion_text:
            return 0.0
        return completion_text.count(target) / len(completion_text)

    def format_ok(self, completion_text: str) -> bool:
        """Non-empty and made of lowercase letters and spaces only."""
        stripped = completion_text.strip()
        return bool(stripped) and all(c in string.ascii_lowercase + " " for c in stripped)

    def extract_answer(self, prompt: Prompt, completion_text: str) -> str | None:
        """The letter the completion uses most (None if it has no letters)."""
        counts = {c: completion_text.count(c) for c in set(completion_text) if c.isalpha()}
        if not counts:
            return None
        # Ties go to the alphabetically first letter, so the answer is deterministic.
        return min(counts, key=lambda c: (-counts[c], c))
