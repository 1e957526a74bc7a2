"""A task from the user's own JSON Lines files: one record per line, fields named by the user.

Tasks layer (host-side shell).

Each record holds a prompt (a string — the user turn — or a list of chat messages
`[{"role": ..., "content": ...}]`) and a gold answer (a string or a number). A malformed
record fails at load time with an error naming the file, the line and the field, not as
a `KeyError` deep inside training. Blank lines are skipped.

Scoring: when the gold answer is a number, the completion's final number (``\\boxed{}``,
"#### N", "answer is N", else the last number) must equal it, tolerating formatting
(`answers.answers_match`); otherwise the completion's final text (boxed content, the
"Answer:" line, else its last line) must equal the gold text up to case, whitespace,
quotes and a trailing period.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from a3po_jax.tasks import answers
from a3po_jax.tasks.task import Prompt, json_safe, make_messages, validate_messages


def load_jsonl_prompts(
    path: str | pathlib.Path,
    *,
    task_name: str,
    split: str,
    prompt_field: str,
    answer_field: str,
    id_field: str | None = None,
    instruction: str | None = None,
    system_prompt: str | None = None,
) -> list[Prompt]:
    """Read prompts from a JSONL file, validating every record.

    Prompt ids are "<task_name>/<split>/<id>", with <id> the record's `id_field` value
    (must be unique) or, without one, the 1-based line number.

    Raises:
      ValueError: naming the file, line and field of the first malformed record.
      FileNotFoundError: if `path` does not exist.
    """
    path = pathlib.Path(path)
    prompts: list[Prompt] = []
    seen_ids: dict[str, int] = {}
    # Bytes, decoded line by line: a byte that is not UTF-8 is named with its line (a text
    # mode read would fail with the byte offset of a whole buffer instead).
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path} line {line_no}"
            record = read_json_line(raw, where)
            if record is None:
                continue
            for field in (prompt_field, answer_field) + ((id_field,) if id_field else ()):
                if field not in record:
                    raise ValueError(
                        f"{where}: missing field {field!r} (the record has fields {sorted(record)})"
                    )
            messages = _record_messages(
                record[prompt_field],
                where=f"{where}, field {prompt_field!r}",
                instruction=instruction,
                system_prompt=system_prompt,
            )
            gold = _record_answer(record[answer_field], where=f"{where}, field {answer_field!r}")
            if id_field:
                record_id = str(record[id_field])
                if record_id in seen_ids:
                    raise ValueError(
                        f"{where}, field {id_field!r}: id {record_id!r} repeats line "
                        f"{seen_ids[record_id]}"
                    )
                seen_ids[record_id] = line_no
            else:
                record_id = str(line_no)
            prompts.append(
                Prompt(
                    prompt_id=f"{task_name}/{split}/{record_id}",
                    messages=messages,
                    answer=gold,
                    metadata={"record": json_safe(record), "line": line_no},
                )
            )
    if not prompts:
        raise ValueError(f"{path}: no records (the file is empty)")
    return prompts


def read_json_line(raw: bytes, where: str) -> dict | None:
    """One line of a JSONL file as a JSON object (None for a blank line); every error is a
    ValueError that starts with ``where`` (``path:line``)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where}: not UTF-8 text ({err.reason} at byte {err.start + 1} of the line)"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from err
    except RecursionError:  # nesting deeper than the parser's stack
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _record_answer(gold: Any, *, where: str) -> str:
    """A record's gold answer: a string or a number, not empty once stripped."""
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise ValueError(
            f"{where}: the answer must be a string or a number, got {type(gold).__name__}"
        )
    gold = str(gold).strip()
    if not gold:
        raise ValueError(f"{where}: the answer is empty")
    return gold


def _record_messages(
    value: Any, *, where: str, instruction: str | None, system_prompt: str | None
) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return make_messages(value, instruction=instruction, system_prompt=system_prompt)
    if isinstance(value, list):
        messages = list(validate_messages(value, where))
        if messages[-1]["role"] != "user":
            raise ValueError(f"{where}: the last chat message must have role 'user'")
        if instruction:
            last = messages[-1]
            messages[-1] = {"role": "user", "content": f"{last['content']}\n{instruction}"}
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tuple(messages)
    raise ValueError(
        f"{where}: the prompt must be a string or a list of chat messages, "
        f"got {type(value).__name__}"
    )


class JsonlTask:
    """Prompts and gold answers from JSONL files, one file per split.

    Args:
      path: a file for the "train" split, or a mapping split name → file
        (e.g. {"train": "train.jsonl", "test": "test.jsonl"}).
      prompt_field: the field holding the prompt (string or chat messages).
      answer_field: the field holding the gold answer (string or number).
      id_field: optional field with a unique record id (default: line numbers).
      name: the task name, the first part of every prompt id.
      instruction: optional text appended to the (last) user message, e.g.
        `task.BOXED_INSTRUCTION`; None leaves the prompts as written.
      system_prompt: optional system message, added when a record has none.
    """

    def __init__(
        self,
        path: str | pathlib.Path | Mapping[str, str | pathlib.Path],
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        id_field: str | None = None,
        name: str = "jsonl",
        instruction: str | None = None,
        system_prompt: str | None = None,
    ):
        paths = dict(path) if isinstance(path, Mapping) else {"train": path}
        if not paths:
            raise ValueError("JsonlTask.path: give a file or a mapping split -> file")
        for field, value in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"JsonlTask.{field} must be a non-empty string, got {value!r}")
        if prompt_field == answer_field:
            raise ValueError(
                f"JsonlTask.answer_field must differ from prompt_field, both are {prompt_field!r}"
            )
        self.name = name
        self.paths = {split: pathlib.Path(p) for split, p in paths.items()}
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.id_field = id_field
        self.instruction = instruction
        self.system_prompt = system_prompt
        self._prompts: dict[str, list[Prompt]] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def prompts(self, split: str) -> Sequence[Prompt]:
        if split not in self.paths:
            raise ValueError(
                f"{self.name}: no file for split {split!r}; JsonlTask.path has {self.splits}"
            )
        if split not in self._prompts:
            self._prompts[split] = load_jsonl_prompts(
                self.paths[split],
                task_name=self.name,
                split=split,
                prompt_field=self.prompt_field,
                answer_field=self.answer_field,
                id_field=self.id_field,
                instruction=self.instruction,
                system_prompt=self.system_prompt,
            )
        return self._prompts[split]

    def extract_answer(self, prompt: Prompt, completion_text: str) -> str | None:
        """The final number, or the final text when the gold answer is not a number."""
        if answers.parse_number(prompt.answer) is None:
            return answers.extract_final_text(completion_text)
        found = answers.extract_answer(completion_text)
        return None if found is None else found.text

    def score(self, prompt: Prompt, completion_text: str) -> float:
        predicted = self.extract_answer(prompt, completion_text)
        return float(answers.answers_match(predicted, prompt.answer))

    def format_ok(self, completion_text: str) -> bool:
        return answers.has_boxed_answer(completion_text)
