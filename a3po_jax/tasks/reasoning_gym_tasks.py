"""Procedural tasks from reasoning-gym, scored by reasoning-gym's own verifiers.

Tasks layer (host-side shell).

`reasoning_gym.create_dataset(name, size=N, seed=S, **config)` makes item `i` from
`random.Random(S + i)`. So the test split must not start at `S + 1` — its item `i` would
be train item `i + 1` — and is drawn from seed `S + TEST_SEED_OFFSET` instead: the two
splits never share a generator seed while `train_size <= TEST_SEED_OFFSET`. Easy settings
have few distinct problems (2-term 1-digit `chain_sum` has 200), so there the same
*question* still appears in both splits; the splits are independent draws, not disjoint
sets. With `holdout=h` they are: the problem space is partitioned by a hash of each
problem's key (its expression where the generator records one, else its question), the
test split draws only from the share h whose hash falls below h, each question once, and
the train split only from the rest (`holdout_bucket`).

The completion's final answer is extracted first (``\\boxed{}``, "answer is", else the last
number; see `answers.py`), rewritten in plain form ("1,000" → "1000"), and only then
passed to `dataset.score_answer`. reasoning-gym's scorers give partial credit (countdown
0.05 for a well-formed wrong expression, chain_sum `len(gold)/len(answer)` when the gold
answer is a substring); by default the reward is binary (1 only when the scorer says 1),
since a format reward is a separate, explicit option (`rewards.RewardConfig`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from a3po_jax.tasks import answers
from a3po_jax.tasks.task import (
    BOXED_INSTRUCTION,
    MATH_INSTRUCTION,
    Prompt,
    json_safe,
    make_messages,
)

TEST_SEED_OFFSET = 1_000_000_000
SPLITS = ("train", "test")
# With a holdout, a split gives up after this many draws per prompt it needs (over its
# share of the space): a space too small for the split's size is refused, not looped on.
_DRAWS_PER_PROMPT = 50


def problem_key(entry: dict[str, Any]) -> str:
    """What identifies a problem: the expression the generator records (its operands and
    operators), else the question text."""
    metadata = entry.get("metadata") or {}
    return str(metadata.get("expression", entry["question"]))


def holdout_bucket(key: str) -> float:
    """A problem's place in [0, 1), from SHA-256 of its key: the same on every machine and
    Python, so the partition never moves."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


# How the answer is read from a completion: a number ("number"), an arithmetic expression
# ("expression", countdown), or free text ("text", any other reasoning-gym dataset).
ANSWER_KINDS = {
    "chain_sum": "number",
    "basic_arithmetic": "number",
    "gsm_symbolic": "number",
    "countdown": "expression",
}
_DEFAULT_INSTRUCTIONS = {"gsm_symbolic": MATH_INSTRUCTION}


def _reasoning_gym():
    # reasoning-gym imports its ~100 generators on first use; import it only when a task is
    # built, so importing a3po_jax.tasks stays cheap.
    import reasoning_gym
    import reasoning_gym.factory

    return reasoning_gym


def dataset_options(dataset_name: str) -> tuple[str, ...]:
    """The difficulty options reasoning-gym's config for `dataset_name` takes."""
    rg = _reasoning_gym()
    if dataset_name not in rg.factory.DATASETS:
        known = ", ".join(sorted(rg.factory.DATASETS))
        raise ValueError(f"unknown reasoning-gym dataset {dataset_name!r}; known: {known}")
    _, config_cls = rg.factory.DATASETS[dataset_name]
    return tuple(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))


class _LazyPrompts(Sequence):
    """The prompts of one split, generated on first access and then cached.

    Some generators are slow (countdown), so building a 10 000-item train split up front
    would take minutes; the iterator touches items as it uses them.
    """

    def __init__(self, task: ReasoningGymTask, split: str, dataset: Any, size: int):
        self._task, self._split, self._dataset, self._size = task, split, dataset, size
        self._cache: dict[int, Prompt] = {}
        # With a holdout: the dataset indices this split keeps, found by drawing in order.
        self._kept: list[int] = []
        self._seen: set[str] = set()
        self._draws = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        if not -self._size <= index < self._size:
            raise IndexError(f"prompt index {index} out of range for {self._size} prompts")
        index %= self._size
        if index not in self._cache:
            entry = self._dataset[self._source(index) if self._task.holdout else index]
            self._cache[index] = self._task.make_prompt(self._split, index, entry)
        return self._cache[index]

    def _source(self, index: int) -> int:
        """The dataset index of this split's `index`-th problem: the next draw whose problem
        lies in the split's side of the holdout (and, in the test split, is new)."""
        task, test = self._task, self._split == "test"
        while len(self._kept) <= index:
            if self._draws >= len(self._dataset):
                raise ValueError(
                    f"{task.name}: {len(self._dataset)} draws gave only {len(self._kept)} "
                    f"{'distinct ' if test else ''}{self._split} problems with "
                    f"holdout={task.holdout}, {self._size} needed: widen the problem space "
                    f"(more digits or terms), change the holdout or ask for fewer"
                )
            key = problem_key(self._dataset[self._draws])
            if (holdout_bucket(key) < task.holdout) == test and not (test and key in self._seen):
                self._kept.append(self._draws)
                self._seen.add(key)
            self._draws += 1
        return self._kept[index]


class ReasoningGymTask:
    """A reasoning-gym dataset as a task with "train" and "test" splits.

    Args:
      dataset_name: a reasoning-gym dataset, e.g. "chain_sum", "basic_arithmetic",
        "countdown", "gsm_symbolic".
      seed: the train split's seed; the test split uses `seed + TEST_SEED_OFFSET`.
      train_size, test_size: number of prompts per split.
      instruction: appended to each question on its own line; defaults to asking for a
        ``\\boxed{}`` answer (step by step for gsm_symbolic).
      system_prompt: optional system message (None: the chat template's default).
      partial_credit: keep reasoning-gym's partial scores instead of a 0/1 reward.
      holdout: the share of the problem space kept for the test split alone (0 < h < 1),
        which then holds distinct problems the train split never draws; 0 (the default)
        draws both splits from the whole space.
      **dataset_config: difficulty options of the reasoning-gym config, e.g. for chain_sum
        `min_terms`, `max_terms`, `min_digits`, `max_digits`, `allow_negation`.
    """

    def __init__(
        self,
        dataset_name: str,
        *,
        seed: int = 0,
        train_size: int = 10_000,
        test_size: int = 500,
        instruction: str | None = None,
        system_prompt: str | None = None,
        partial_credit: bool = False,
        holdout: float = 0.0,
        **dataset_config: Any,
    ):
        options = dataset_options(dataset_name)
        for key in dataset_config:
            if key not in options:
                raise ValueError(
                    f"{dataset_name}: unknown option {key!r}; its options are "
                    f"{', '.join(options)} (seed and size are set by the task)"
                )
        for field, value in (("train_size", train_size), ("test_size", test_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{dataset_name}: {field} must be an int >= 1, got {value!r}")
        if train_size > TEST_SEED_OFFSET:
            raise ValueError(
                f"{dataset_name}: train_size must be <= {TEST_SEED_OFFSET} so the test seeds "
                f"do not overlap the train seeds, got {train_size}"
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{dataset_name}: seed must be an int >= 0, got {seed!r}")
        if isinstance(holdout, bool) or not isinstance(holdout, int | float):
            raise ValueError(f"{dataset_name}: holdout must be a number, got {holdout!r}")
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"{dataset_name}: holdout must be in [0, 1), got {holdout!r}")
        self.holdout = float(holdout)
        self.name = dataset_name
        self.splits = SPLITS
        self.dataset_name = dataset_name
        self.seed = seed
        self.sizes = {"train": train_size, "test": test_size}
        self.dataset_config = dict(dataset_config)
        self.instruction = (
            _DEFAULT_INSTRUCTIONS.get(dataset_name, BOXED_INSTRUCTION)
            if instruction is None
            else instruction
        )
        self.system_prompt = system_prompt
        self.partial_credit = partial_credit
        self.answer_kind = ANSWER_KINDS.get(dataset_name, "text")
        self._datasets = {split: self._create(split) for split in SPLITS}
        self._prompts: dict[str, _LazyPrompts] = {}

    def _create(self, split: str) -> Any:
        seed = self.seed if split == "train" else self.seed + TEST_SEED_OFFSET
        size = self.sizes[split]
        if self.holdout:  # draws to filter from: the split's share of the space is smaller
            share = self.holdout if split == "test" else 1.0 - self.holdout
            size = min(TEST_SEED_OFFSET, int(_DRAWS_PER_PROMPT * size / share) + 1)
        try:
            return _reasoning_gym().create_dataset(
                self.dataset_name, size=size, seed=seed, **self.dataset_config
            )
        except AssertionError as err:
            # reasoning-gym validates its configs with bare asserts; say which task failed.
            raise ValueError(
                f"{self.dataset_name}: invalid options {self.dataset_config}: {err}"
            ) from err

    def make_prompt(self, split: str, index: int, entry: dict[str, Any]) -> Prompt:
        return Prompt(
            prompt_id=f"{self.name}/{split}/{index}",
            messages=make_messages(
                entry["question"], instruction=self.instruction, system_prompt=self.system_prompt
            ),
            answer=str(entry["answer"]),
            # Scored from the JSON form, so a prompt restored from a checkpoint scores the same.
            metadata={"entry": json_safe(entry)},
        )

    def prompts(self, split: str) -> Sequence[Prompt]:
        if split not in SPLITS:
            raise ValueError(f"{self.name}: split must be one of {SPLITS}, got {split!r}")
        if split not in self._prompts:
            self._prompts[split] = _LazyPrompts(
                self, split, self._datasets[split], self.sizes[split]
            )
        return self._prompts[split]

    def extract_answer(self, prompt: Prompt, completion_text: str) -> str | None:
        if self.answer_kind == "number":
            found = answers.extract_answer(completion_text)
            if found is None:
                return None
            return answers.canonical_number(found.text) or found.text
        if self.answer_kind == "expression":
            return _clean_expression(answers.extract_final_text(completion_text))
        return answers.extract_final_text(completion_text)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        raw = float(
            self._datasets["train"].score_answer(
                self.extract_answer(prompt, completion_text), prompt.metadata["entry"]
            )
        )
        if self.partial_credit:
            return min(max(raw, 0.0), 1.0)
        return 1.0 if raw >= 1.0 else 0.0

    def format_ok(self, completion_text: str) -> bool:
        return answers.has_boxed_answer(completion_text)


_LATEX_OPERATORS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "÷": "/", "−": "-"}


def _clean_expression(text: str | None) -> str | None:
    """An arithmetic expression as countdown's scorer parses it.

    LaTeX/Unicode operators become `*`, `/`, `-`; math delimiters and a trailing period
    go; of "94*4 - 61 - 6 = 309" (or "309 = 94*4 - 61 - 6") the side with an operator
    is kept, since the scorer rejects '='.
    """
    if text is None:
        return None
    for written, plain in _LATEX_OPERATORS.items():
        text = text.replace(written, plain)
    text = text.strip().strip("$").strip().rstrip(".").strip()
    sides = [side.strip() for side in text.split("=")]
    with_operator = [side for side in sides if re.search(r"\d\s*[-+*/]\s*[\d(]", side)]
    return with_operator[0] if with_operator else sides[0]
