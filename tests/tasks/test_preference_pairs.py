"""Preference pairs files: malformed lines refused by file, line and field; the held-out
split by prompt hash (deterministic, one prompt never on both sides)."""

import json

import pytest

from a3po_jax.tasks.preference_pairs import load_preference_pairs, split_pairs


def _write(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


GOOD = {"prompt": "2 + 3?", "chosen": "5", "rejected": "6"}


def test_pairs_are_read_with_chat_prompts_and_extra_keys(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = _write(
        tmp_path, [GOOD, "", {"prompt": messages, "chosen": "a", "rejected": "b", "gold": 0.5}]
    )
    first, second = load_preference_pairs(path)
    assert first.prompt.messages == ({"role": "user", "content": "2 + 3?"},)
    assert (first.chosen, first.rejected, first.line) == ("5", "6", 1)
    assert second.prompt.messages == tuple(messages) and second.line == 3
    assert second.prompt.metadata == {"line": 3, "gold": 0.5}


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"pairs.jsonl:2: not valid JSON"),
        ('["a list"]', r"pairs.jsonl:2: expected a JSON object"),
        ({"prompt": "p", "chosen": "a"}, r"pairs.jsonl:2: field 'rejected' is missing"),
        ({"chosen": "a", "rejected": "b"}, r"pairs.jsonl:2: field 'prompt' is missing"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, r"pairs.jsonl:2: field 'chosen' must be"),
        ({"prompt": "p", "chosen": "a", "rejected": None}, r":2: field 'rejected' must be a str"),
        ({"prompt": "  ", "chosen": "a", "rejected": "b"}, r":2: field 'prompt' is an empty"),
        (
            {"prompt": [{"role": "bot", "content": "x"}], "chosen": "a", "rejected": "b"},
            r"pairs.jsonl:2: field 'prompt'\[0\]\['role'\]",
        ),
        ({"prompt": 7, "chosen": "a", "rejected": "b"}, r":2: field 'prompt' must be a list"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, r":2: field 'rejected' equals"),
    ],
)
def test_a_malformed_line_is_refused_naming_line_and_field(tmp_path, line, message):
    path = _write(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(ValueError, match=message):
        load_preference_pairs(path)


def test_bytes_that_are_not_utf8_name_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: not UTF-8"):
        load_preference_pairs(path)


def test_the_split_is_by_prompt_and_deterministic(tmp_path):
    lines = []
    for i in range(200):
        for side in range(2):  # two pairs per prompt
            lines.append({"prompt": f"question {i}", "chosen": f"a{side}", "rejected": "b"})
    pairs = load_preference_pairs(_write(tmp_path, lines))
    train, held = split_pairs(pairs, 0.2)
    assert (train, held) == split_pairs(pairs, 0.2)
    held_prompts = {p.prompt.prompt_id for p in held}
    assert not held_prompts & {p.prompt.prompt_id for p in train}
    assert 0.1 < len(held_prompts) / 200 < 0.3
    assert split_pairs(pairs, 0.0) == (list(pairs), [])
    # A larger fraction holds out a superset: the buckets do not move.
    assert held_prompts <= {p.prompt.prompt_id for p in split_pairs(pairs, 0.5)[1]}
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_pairs(pairs, 1.0)
