"""Answer extraction from completions and formatting-tolerant answer comparison.

Tasks layer (host-side shell).

A completion states its final answer in one of several ways; `extract_answer` looks for
them in order of how explicit they are, and reports which one it found:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced — the format every task
   here asks for;
2. the last ``#### N`` line — GSM8K's own solution format;
3. the last "answer is N" / "Answer: N" / "final answer = N";
4. the last number anywhere in the text — small models often answer "1 + 5 = 6" and
   ignore the requested format; accepting it keeps the untrained reward informative.

Numbers compare as exact rationals (`fractions.Fraction`), after dropping what GSM-style
answers decorate them with: currency (``$``, ``\\$``, ``€``, ``£``), thousands commas,
percent signs, trailing units ("18 dollars", ``\\text{ cm}``), a trailing period, and
LaTeX fractions. So ``$1,000.00`` == ``1000``, ``18.0`` == ``18``, ``\\frac{1}{2}`` ==
``0.5``, ``10%`` == ``10`` (GSM8K writes percentages as bare numbers) and ``−4`` (Unicode
minus) == ``-4``. Non-numeric gold answers compare as normalised strings.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

# A number as written in prose: optional sign, optional currency, digits with either
# well-formed thousands commas ("1,234,567") or none, optional decimals, optional
# "/denominator". The look-behind stops "x2" or "v1.5" yielding a number and keeps a
# binary minus ("10-4") from being read as a negative sign.
_NUMBER_RE = re.compile(
    r"(?<![\w.])"
    r"(?P<num>[-−]?(?:\\\$|\$|€|£)?\s?"
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?\d+)?)"
    r"(?![\d])"
)
_HASH_RE = re.compile(r"####\s*(?P<ans>[^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*(?::\s*)?(?P<ans>[^\n]*)", re.IGNORECASE
)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm)\s*\{([^{}]*)\}")
_BOXED_OPENERS = ("\\boxed", "\\fbox")


@dataclasses.dataclass(frozen=True)
class ExtractedAnswer:
    """The final answer a completion states, and how it was found."""

    text: str  # the answer as written, e.g. "$1,000" or "\\frac{1}{2}"
    source: str  # "boxed" | "hash" | "answer_is" | "last_number"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in `text`, braces balanced.

    A regex cannot match nested braces (``\\boxed{\\frac{1}{2}}``), so this scans them.
    Returns None when there is no complete boxed expression (an unclosed one, as in a
    truncated completion, does not count).
    """
    # Walk back from the last opener until one closes properly.
    starts = sorted(
        {m.start() for opener in _BOXED_OPENERS for m in re.finditer(re.escape(opener), text)},
        reverse=True,
    )
    for start in starts:
        i = start + (6 if text.startswith("\\boxed", start) else 5)
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
    return None


def has_boxed_answer(text: str) -> bool:
    """True when the completion puts a non-empty final answer in ``\\boxed{}``."""
    content = extract_boxed(text)
    return content is not None and content != ""


def _last_number(text: str) -> str | None:
    matches = list(_NUMBER_RE.finditer(_strip_latex(text)))
    return matches[-1].group("num").strip() if matches else None


def _first_number(text: str) -> str | None:
    match = _NUMBER_RE.search(_strip_latex(text))
    return match.group("num").strip() if match else None


def _strip_latex(text: str) -> str:
    """Rewrite the LaTeX that wraps numbers into plain text: \\frac{a}{b} → a/b, etc."""
    text = _LATEX_TEXT_RE.sub(r" \1", text)
    text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    # Thin spaces and escaped percent/dollar signs appear inside boxed answers.
    for latex, plain in (("\\!", ""), ("\\,", ""), ("\\;", " "), ("\\%", "%"), ("\\left", "")):
        text = text.replace(latex, plain)
    return text.replace("\\right", "").replace("{,}", ",")


def extract_answer(text: str) -> ExtractedAnswer | None:
    """The final numeric answer a completion states (see the module docstring for the order).

    Returns None when the completion holds no number at all. Inside a box the *last*
    number is taken ("\\boxed{5 - 9 = -4}" gives -4); after "####" or "answer is" the
    *first* one on that line ("The answer is 12 apples, since 3 * 4 = 12" gives 12).
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        number = _last_number(boxed)
        if number is not None:
            return ExtractedAnswer(number, "boxed")
    hashes = list(_HASH_RE.finditer(text))
    if hashes:
        number = _first_number(hashes[-1].group("ans"))
        if number is not None:
            return ExtractedAnswer(number, "hash")
    for match in reversed(list(_ANSWER_IS_RE.finditer(text))):
        # "The answer is 12 apples, because 3 * 4 = 12" → the number right after "is".
        number = _first_number(match.group("ans"))
        if number is not None:
            return ExtractedAnswer(number, "answer_is")
    number = _last_number(text)
    if number is not None:
        return ExtractedAnswer(number, "last_number")
    return None


def extract_final_text(text: str) -> str | None:
    """The final answer as free text, for non-numeric answers (an expression, a word).

    Boxed content, else the rest of the last "answer is / Answer:" line, else the last
    non-empty line. Returns None for an empty completion.
    """
    boxed = extract_boxed(text)
    if boxed:
        return boxed
    matches = list(_ANSWER_IS_RE.finditer(text))
    if matches and matches[-1].group("ans").strip():
        return matches[-1].group("ans").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def parse_number(text: str | None) -> Fraction | None:
    """Parse a written number into an exact rational, or None if `text` is not one number.

    Accepts sign (also Unicode minus), currency, thousands commas, decimals, a fraction
    ``a/b`` or ``\\frac{a}{b}``, a trailing percent sign, trailing units ("18 dollars"),
    and a trailing period. Rejects text with two numbers ("3 or 4") or none.
    """
    if text is None:
        return None
    s = _strip_latex(text).strip().replace("−", "-")
    s = re.sub(r"^[\s(]+|[\s).]+$", "", s)
    s = s.rstrip("%").strip()
    # Drop trailing unit words ("18 dollars", "5 cm", "12 apples each").
    s = re.sub(r"(?<=\d)\s*[A-Za-z][A-Za-z\s.]*$", "", s).strip().rstrip("%").strip()
    s = re.sub(r"^(?:\\\$|\$|€|£)\s*", "", s)
    s = re.sub(r"^-\s*(?:\\\$|\$|€|£)\s*", "-", s)
    match = re.fullmatch(
        r"(?P<sign>[-+]?)\s*(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
        r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?",
        s,
    )
    if match is None:
        return None
    value = Fraction(match.group("num").replace(",", ""))
    if match.group("den") is not None:
        den = Fraction(match.group("den"))
        if den == 0:
            return None
        value /= den
    return -value if match.group("sign") == "-" else value


def canonical_number(text: str | None) -> str | None:
    """A written number in the plain form verifiers expect: "1000", "-4", "3.5", "1/3".

    Integers print without decimals; terminating decimals as decimals; other rationals as
    "p/q". Returns None when `text` is not a number.
    """
    value = parse_number(text)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    # A fraction has a terminating decimal expansion iff its denominator is 2^a 5^b.
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:
        # Print the exact decimal from integers; a float would round long values.
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        scaled = str(abs((value * 10**digits).numerator)).rjust(digits + 1, "0")
        sign = "-" if value < 0 else ""
        return f"{sign}{scaled[:-digits]}.{scaled[-digits:]}"
    return f"{value.numerator}/{value.denominator}"


def _normalise_text(text: str) -> str:
    text = _strip_latex(text).strip().strip("\"'`").rstrip(".").strip()
    return re.sub(r"\s+", " ", text).casefold()


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether a predicted answer equals the gold answer, tolerating formatting.

    When the gold answer is a number, the prediction must parse to the same rational
    (see `parse_number`); otherwise both compare as case-folded, whitespace-collapsed text
    with surrounding quotes and a trailing period removed.
    """
    if predicted is None:
        return False
    gold_value = parse_number(gold)
    if gold_value is not None:
        return parse_number(predicted) == gold_value
    return _normalise_text(predicted) == _normalise_text(gold)


def gold_from_gsm8k_solution(solution: str) -> str:
    """The final answer of a GSM8K reference solution ("... #### 1,234" → "1234").

    Raises ValueError when the solution has no ``#### N`` line or N is not a number, so a
    corrupted record fails loudly instead of scoring every completion 0.
    """
    matches = list(_HASH_RE.finditer(solution))
    if not matches:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    written = matches[-1].group("ans").strip()
    number = canonical_number(written)
    if number is None:
        raise ValueError(f"GSM8K solution's final answer {written!r} is not a number")
    return number
