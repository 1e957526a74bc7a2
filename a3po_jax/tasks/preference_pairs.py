"""Preference pairs from a JSON Lines file, and their held-out split by prompt.

Tasks layer (host-side shell).

One pair per line: ``{"prompt": str or [chat messages], "chosen": str, "rejected": str}``;
other keys are allowed and kept in the prompt's metadata. A malformed line is refused with
``file:line: field ...`` (the first one found), never skipped: a reward model trained on
silently dropped pairs would be a different model. Blank lines are skipped.

The held-out split hashes the prompt (its chat messages as canonical JSON) into [0, 1) with
`holdout_bucket`, so it is the same on every machine and every seed, and every pair of one
prompt lands on the same side: held-out accuracy is measured on prompts never trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from a3po_jax.tasks.jsonl_task import read_json_line
from a3po_jax.tasks.reasoning_gym_tasks import holdout_bucket
from a3po_jax.tasks.task import Prompt, json_safe, validate_messages

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One line of a pairs file: the prompt and the preferred and dispreferred completions."""

    prompt: Prompt
    chosen: str
    rejected: str
    line: int  # 1-based line of the file


def load_preference_pairs(path: str | os.PathLike) -> list[PreferencePair]:
    """Every pair of the file, in file order.

    Raises:
      FileNotFoundError: for a missing file.
      ValueError: ``"<file>:<line>: field <name> ..."`` for the first malformed line (not
        JSON, not an object, a field missing or of the wrong type, a bad chat message,
        chosen equal to rejected).
    """
    pairs = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{os.fspath(path)}:{line_no}"
            record = read_json_line(raw, where)
            if record is None:
                continue
            pairs.append(_pair(record, where, line_no))
    return pairs


def _pair(record: dict[str, Any], where: str, line_no: int) -> PreferencePair:
    missing = [name for name in PAIR_FIELDS if name not in record]
    if missing:
        raise ValueError(f"{where}: field {missing[0]!r} is missing (a pair needs {PAIR_FIELDS})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' is an empty string")
        messages = ({"role": "user", "content": prompt},)
    else:
        messages = validate_messages(prompt, f"{where}: field 'prompt'")
    for name in ("chosen", "rejected"):
        if not isinstance(record[name], str):
            raise ValueError(
                f"{where}: field {name!r} must be a string, got {type(record[name]).__name__}"
            )
    if record["chosen"] == record["rejected"]:
        raise ValueError(f"{where}: field 'rejected' equals 'chosen' (no preference)")
    extra = {k: v for k, v in record.items() if k not in PAIR_FIELDS}
    digest = hashlib.sha256(prompt_key(messages).encode()).hexdigest()[:12]
    return PreferencePair(
        prompt=Prompt(
            prompt_id=f"pairs/{digest}",
            messages=messages,
            answer="",
            metadata=json_safe({"line": line_no, **extra}),
        ),
        chosen=record["chosen"],
        rejected=record["rejected"],
        line=line_no,
    )


def prompt_key(messages: Sequence[Any]) -> str:
    """The canonical JSON of a prompt's chat messages: what identifies "the same prompt"."""
    return json.dumps([dict(m) for m in messages], sort_keys=True, ensure_ascii=False)


def split_pairs(
    pairs: Sequence[PreferencePair], holdout_fraction: float
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held out): a pair is held out when its prompt's hash bucket is below
    `holdout_fraction`; file order is kept on both sides."""
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    train, held = [], []
    for pair in pairs:
        bucket = holdout_bucket(prompt_key(pair.prompt.messages))
        (held if bucket < holdout_fraction else train).append(pair)
    return train, held
