"""The task interface: prompts with gold answers, a scorer, and chat-template rendering.

Tasks layer (host-side shell).

A task is anything with a `name`, `prompts(split)` and `score(prompt, completion_text)`
(plus `format_ok` and `extract_answer`, used by reward shaping and evaluation records).
Each source (reasoning-gym, GSM8K, a user's JSONL file) is one concrete class; `Task` is a
`typing.Protocol`, so no class inherits from it.

Every built-in task asks for the final answer in ``\\boxed{}`` (`BOXED_INSTRUCTION`,
appended to the question on its own line); the scorers also accept a bare last number,
because small untrained models often ignore the requested format, and the optional format
reward (`rewards.RewardConfig.format_reward`) is what teaches the format.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from a3po_jax.model.chat_template import CHATML_TEMPLATE  # re-exported by a3po_jax.tasks

BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
# Word problems: ask for the working first, then the boxed number without units, which is
# what the GSM8K scorer compares.
MATH_INSTRUCTION = (
    "Solve the following math problem step by step. Put your final numeric answer "
    "(without units) within \\boxed{}."
)

_ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a task, with what its scorer needs.

    Attributes:
      prompt_id: stable across runs and machines, "<task>/<split>/<index>"; the rollout
        queue and checkpoints refer to prompts by it.
      messages: chat messages, e.g. ({"role": "user", "content": "..."},); a system message
        may come first.
      answer: the gold answer as a string (for display; scorers may use `metadata`).
      metadata: whatever the scorer needs (a reasoning-gym entry, the original record);
        JSON-serialisable, so a prompt round-trips through `to_json`/`from_json`.
    """

    prompt_id: str
    messages: tuple[Mapping[str, str], ...]
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.prompt_id, str) or not self.prompt_id:
            raise ValueError(f"Prompt.prompt_id must be a non-empty string, got {self.prompt_id!r}")
        if not isinstance(self.answer, str):
            raise ValueError(f"Prompt.answer must be a string, got {type(self.answer).__name__}")
        object.__setattr__(self, "messages", validate_messages(self.messages, "Prompt.messages"))

    def __hash__(self) -> int:
        # The generated hash would hash the metadata dict and fail; the id identifies a prompt.
        return hash(self.prompt_id)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; `Prompt.from_json` inverts it."""
        return {
            "prompt_id": self.prompt_id,
            "messages": [dict(m) for m in self.messages],
            "answer": self.answer,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Prompt:
        return cls(
            prompt_id=data["prompt_id"],
            messages=tuple(data["messages"]),
            answer=data["answer"],
            metadata=data.get("metadata", {}),
        )


def validate_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    """Check chat messages are {"role", "content"} dicts with known roles; return a tuple.

    Args:
      messages: a sequence of message dicts.
      where: names the field in error messages (e.g. "data.jsonl line 3, field 'prompt'").
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{where} must be a list of chat messages, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError(f"{where} must hold at least one chat message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise ValueError(f"{where}[{i}]['role'] must be one of {_ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(
                f"{where}[{i}]['content'] must be a string, got {type(content).__name__}"
            )
        checked.append({"role": role, "content": content})
    return tuple(checked)


def make_messages(
    question: str, *, instruction: str | None, system_prompt: str | None
) -> tuple[dict[str, str], ...]:
    """The chat messages for a question: optional system message, then one user turn.

    The instruction goes after the question on its own line, where instruction-tuned
    models (SmolLM2, Qwen) most reliably follow it.
    """
    question = question.rstrip()
    content = question if not instruction else f"{question}\n{instruction}"
    messages = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": content})
    return tuple(messages)


def json_safe(value: Any) -> Any:
    """`value` with tuples turned into lists and non-JSON leaves into strings.

    Prompt metadata must survive a checkpoint's JSON round trip unchanged, so tasks store
    it in this form from the start and score from the same form they restore.
    """
    return json.loads(json.dumps(value, default=str))


@runtime_checkable
class Task(Protocol):
    """What the trainer and `evaluation.evaluate` need from a task."""

    name: str

    def prompts(self, split: str) -> Sequence[Prompt]:
        """The prompts of `split` ("train" / "test"), in a fixed, deterministic order."""
        ...

    def score(self, prompt: Prompt, completion_text: str) -> float:
        """Correctness reward in [0, 1] of a decoded completion (special tokens removed)."""
        ...

    def format_ok(self, completion_text: str) -> bool:
        """Whether the completion states its answer in the format the prompt asked for."""
        ...

    def extract_answer(self, prompt: Prompt, completion_text: str) -> str | None:
        """The answer the scorer reads from the completion (for logs and eval records)."""
        ...


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of `prompt` under the tokenizer's chat template, ending where the model speaks.

    Applies `tokenizer.apply_chat_template(..., add_generation_prompt=True)`; if the
    tokenizer has no chat template, `CHATML_TEMPLATE` is used instead. The template is
    rendered to text and then encoded with `add_special_tokens=False`: templates that want
    a BOS token write it themselves, so letting `encode` add another would double it (and
    transformers 5 returns a `BatchEncoding`, not ids, from `tokenize=True`).

    Args:
      tokenizer: a transformers `PreTrainedTokenizer(Fast)` or the character tokenizer.
      prompt: the prompt to render.

    Returns:
      The prompt's token ids, a list of ints.
    """
    template = None if tokenizer.chat_template else CHATML_TEMPLATE
    text = tokenizer.apply_chat_template(
        [dict(m) for m in prompt.messages],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
