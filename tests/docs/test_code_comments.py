"""Comments say why in a line and link the page; the measurements live in the docs.

A comment or docstring in ``a3po_jax/`` or ``experiments/`` holds no date, no commit hash,
no machine a figure was measured on and no measured time: those are the
[performance page](docs/performance.md)'s (the current figure of each benchmark, with its
command and machine) and the [measurement log](docs/log.md)'s (the dated history, what was
tried), and a line of code links them (docs/style.md, items 14 and 20).

Only prose is read: ``#`` comments (``tokenize``) and docstrings, i.e. every string that
stands alone as a statement (module, class, function and attribute docstrings; ``ast``).
Strings the code uses (error messages, format strings, data) are not prose and are not
read. The rules, each a pattern over one line of prose:

* **date**: ``YYYY-MM-DD``.
* **commit**: a 7-40 character hex word with a digit and a letter (``749f325``), not a
  float's mantissa (``9.999999747e-06``).
* **cpu model**: EPYC, Xeon, Ryzen, ... (the machine a figure was measured on).
* **accelerator model**: H100, H200, A100, V100, TPU v5e, ...
* **timing**: a number with a unit of time (``12 ms``, ``3.4 s``, ``2 min``; not ``h``,
  a shape letter as often as an hour), or a speed ratio (``3x slower``).
* **timing method**: "min of N", an A/B pair.
* **session**: "session" or "sitting" (a story of when something was measured).
* **stale link**: "design §6", which no longer holds figures (they moved to the pages above).

One exemption, by field: an experiment's ``Hardware:`` header (the module docstring's
field, up to the next unindented line) may name the accelerators the run is sized for
("2 GPUs of 80 GB (H100/A100)") and about how long it takes ("about 3 minutes per run"),
which is that field's job in the house-style header (Command, Hardware, What it shows,
Parent). CPU models, dates, commits, sessions and timing methods stay out of it too.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RULES = {
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "commit": re.compile(r"(?<![\w.])[0-9a-f]{7,40}(?![\w])"),
    "cpu model": re.compile(r"\b(?:EPYC|Xeon|Ryzen|Threadripper|Graviton|Apple M\d)\b"),
    "accelerator model": re.compile(
        r"\b(?:[GB]?H[12]00|[AB][1-9]00|V100|MI[23]\d0X?|TPU ?v\d\w*)\b"
    ),
    "timing": re.compile(
        r"\d(?:[\d.,]*\d)?\s?(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?|hours?)\b"
        r"|\d\s?[x×]\s+(?:slower|faster)"
    ),
    "timing method": re.compile(r"\bmin(?:imum)? of \d|(?<!\w)A/B(?!\w)"),
    "session": re.compile(r"\b(?:session|sitting)s?\b", re.IGNORECASE),
    "stale link": re.compile(r"\bdesign(?:\.md)?,? §\s?6\b"),
}
# What an experiment's Hardware field may still say: the accelerator a run is sized for, and
# about how long it takes (not the CPU model a figure was measured on).
HARDWARE_FIELD_MAY = ("accelerator model", "timing")
# A float's mantissa before its exponent looks like hex (999999747e in 9.999999747e-06).
FLOAT_MANTISSA = re.compile(r"\d+e\d*")


def source_files() -> list[Path]:
    package = [p for p in sorted((ROOT / "a3po_jax").rglob("*.py")) if "_pb2" not in p.name]
    return package + sorted((ROOT / "experiments").glob("*.py"))


def prose_lines(source: str) -> list[tuple[int, str, bool]]:
    """(line number, text, in a Hardware field) for every line of a comment or docstring."""
    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines.append((tok.start[0], tok.string, False))
    tree = ast.parse(source)
    module_doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            continue
        in_hardware = False
        for offset, text in enumerate(node.value.value.splitlines()):
            if node is module_doc and text and not text[0].isspace():
                in_hardware = text.startswith("Hardware:")
            lines.append((node.lineno + offset, text, in_hardware))
    return lines


def findings(path: Path, source: str | None = None) -> list[str]:
    """Every rule a line of the file's prose breaks, as ``path:line: rule: text``."""
    source = path.read_text() if source is None else source
    is_experiment = path.parent.name == "experiments"
    found = []
    for line, text, in_hardware in prose_lines(source):
        for rule, pattern in RULES.items():
            if is_experiment and in_hardware and rule in HARDWARE_FIELD_MAY:
                continue
            hits = pattern.findall(text)
            if rule == "commit":
                hits = [
                    h
                    for h in hits
                    if re.search(r"\d", h)
                    and re.search(r"[a-f]", h)
                    and not FLOAT_MANTISSA.fullmatch(h)
                ]
            if hits:
                found.append(f"{path.relative_to(ROOT)}:{line}: {rule}: {text.strip()}")
    return found


def test_comments_and_docstrings_hold_no_dates_machines_or_timings():
    found = [f for path in source_files() for f in findings(path)]
    assert not found, (
        "a comment or docstring tells a measurement story; say why in a line and link "
        "docs/performance.md or docs/log.md (move the figure there, with its date, machine "
        "and command):\n" + "\n".join(found)
    )


def test_the_rules_catch_the_stories_and_spare_the_reasons():
    """Each rule on a line it must flag and a line it must not (golden lines)."""
    story = ROOT / "a3po_jax" / "example.py"
    flagged = {
        "date": "# measured 2026-11-26",
        "commit": "# before = 749f325, after = this tree",
        "cpu model": "# on the 2-core AMD EPYC",
        "accelerator model": "# H200, Qwen2.5-1.5B shapes",
        "timing": "# it took 3.5 ms, these two 0.8 ms; unpacked ~3x slower",
        "timing method": "# (min of 30, A/B)",
        "session": "# same sitting",
        "stale link": "# figures in design §6",
    }
    for rule, comment in flagged.items():
        assert [f"{rule}:" in f for f in findings(story, comment + "\n")] == [True], rule
    spared = [
        "# 4·C·V bytes: 192 MiB at C=1024 and SmolLM2's V",  # arithmetic of a shape
        "# the original config.json gives 9.999999747e-06",  # a float, not a hash
        "# a deadbeef-looking word is not a hash without a digit",
        "# every 30 steps, 1e-6 learning rate, design §3",  # counts, values, other sections
        'raise ValueError("took 3.5 ms on 2026-11-26")',  # a string the code uses
    ]
    for line in spared:
        assert findings(story, line + "\n") == [], line
    docstring = '"""Doc.\n\nSaved in 3.4 s on an H100.\n"""\n'
    assert len(findings(story, docstring)) == 2
    experiment = ROOT / "experiments" / "example.py"
    header = '"""Run.\n\nHardware: 2 GPUs (H100/A100); about 3 minutes\n          per run.\n"""\n'
    assert findings(experiment, header) == []
    dated = '"""Run.\n\nHardware: 5.5 s a step on an idle EPYC, 2026-11-26, min of 5.\n"""\n'
    rules = [f.split(": ")[1] for f in findings(experiment, dated)]
    assert rules == ["date", "cpu model", "timing method"]
