"""Answer extraction and formatting-tolerant comparison, on hand-written completions."""

from fractions import Fraction

import pytest

from a3po_jax.tasks.answers import (
    answers_match,
    canonical_number,
    extract_answer,
    extract_boxed,
    extract_final_text,
    gold_from_gsm8k_solution,
    has_boxed_answer,
    parse_number,
)

# (completion, expected answer text, expected source, why this case matters)
EXTRACTION_CASES = [
    ("So the total is \\boxed{42}.", "42", "boxed", "the requested format"),
    (
        "First 3 + 4 = 7, then \\boxed{7}. Check: 2 * 7 = 14",
        "7",
        "boxed",
        "boxed wins over a later number from a sanity check",
    ),
    ("\\boxed{3} no wait, \\boxed{5}", "5", "boxed", "the LAST boxed answer is final"),
    ("\\boxed{\\frac{1}{2}}", "1/2", "boxed", "nested braces: a regex [^}]* would cut at '{1'"),
    ("\\boxed{5 - 9 = -4}", "-4", "boxed", "an equation in the box: the result is last"),
    (
        "\\boxed{\\$1,000}",
        "\\$1,000",
        "boxed",
        "escaped dollar stays with the number as written; parse_number drops it",
    ),
    ("\\fbox{12}", "12", "boxed", "fbox is boxed too"),
    (
        "Natalia sold 48 + 24 = 72 clips.\n#### 72",
        "72",
        "hash",
        "GSM8K's reference format",
    ),
    (
        "The answer is 12 apples, because 3 * 4 = 12 and 2 more makes 14",
        "12",
        "answer_is",
        "the number right after 'answer is', not the last number",
    ),
    ("Final answer: -3", "-3", "answer_is", "'Answer:' form with a negative number"),
    ("5 - 9 = -4", "-4", "last_number", "no marker: last number, with its minus sign"),
    ("I think 10-4 is 6.", "6", "last_number", "sentence period is not a decimal point"),
    ("It costs $18.00.", "$18.00", "last_number", "currency and trailing period"),
    ("1 + 5 = 6", "6", "last_number", "how SmolLM2 often answers chain_sum"),
    ("The result is −7", "−7", "last_number", "Unicode minus sign (U+2212)"),
    (
        "\\boxed{} so 8",
        "8",
        "last_number",
        "an empty box holds no number: fall back to the last number",
    ),
    ("\\boxed{12", "12", "last_number", "an unclosed (truncated) box is not an answer"),
]


@pytest.mark.parametrize("text,expected,source,why", EXTRACTION_CASES)
def test_extract_answer(text, expected, source, why):
    found = extract_answer(text)
    assert found is not None, why
    assert (found.text, found.source) == (expected, source), why


@pytest.mark.parametrize(
    "text",
    [
        "",  # empty completion (e.g. immediate EOS)
        "I don't know.",  # no number at all
        "Version v2 of model x3",  # digits glued to letters are not numbers
    ],
)
def test_extract_answer_none_when_no_number(text):
    assert extract_answer(text) is None


def test_extract_boxed_balanced_and_missing():
    assert extract_boxed("a \\boxed{\\frac{3}{4}} b") == "\\frac{3}{4}"
    # Walking back from an unclosed last box finds the earlier complete one.
    assert extract_boxed("\\boxed{1} then \\boxed{2") == "1"
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed {7}") == "7"  # a space before the brace is allowed
    assert has_boxed_answer("\\boxed{x}") and not has_boxed_answer("\\boxed{ }")


@pytest.mark.parametrize(
    "text,value",
    [
        ("$1,000.00", Fraction(1000)),  # currency + thousands commas + trailing .00
        ("18.0", Fraction(18)),  # trailing .0 must equal the integer
        ("10%", Fraction(10)),  # GSM8K writes percentages as bare numbers
        ("−4", Fraction(-4)),  # Unicode minus
        ("-$5", Fraction(-5)),  # sign before currency
        ("\\$1,000", Fraction(1000)),  # LaTeX-escaped dollar, as inside \boxed{}
        ("\\frac{1}{2}", Fraction(1, 2)),  # LaTeX fraction
        ("3/4", Fraction(3, 4)),  # plain fraction
        ("18 dollars", Fraction(18)),  # trailing unit word
        ("5\\text{ cm}", Fraction(5)),  # LaTeX unit
        ("12.", Fraction(12)),  # sentence period
        (".5", Fraction(1, 2)),  # leading decimal point
    ],
)
def test_parse_number_tolerates_formatting(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "3 or 4",  # two numbers: ambiguous, not one answer
        "1,2345",  # malformed thousands grouping
        "1/0",  # division by zero
        "twelve",  # number words are not parsed
        "",
        None,
    ],
)
def test_parse_number_rejects_malformed(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "text,canonical",
    [
        ("1,000.00", "1000"),  # integers print without decimals
        ("-4.0", "-4"),
        ("2.50", "2.5"),  # terminating decimal stays decimal, trailing zero dropped
        ("\\frac{1}{4}", "0.25"),
        ("1/3", "1/3"),  # non-terminating: kept as a fraction, not a rounded float
        ("-0.25", "-0.25"),  # sign and leading zero of a negative decimal
        ("1234567890123.4567", "1234567890123.4567"),  # a float would round the last digit
    ],
)
def test_canonical_number(text, canonical):
    assert canonical_number(text) == canonical


@pytest.mark.parametrize(
    "predicted,gold,match",
    [
        ("72", "72", True),  # right
        ("71", "72", False),  # wrong by one
        ("$1,234", "1234", True),  # tricky formatting, same value
        ("1234.0", "1,234", True),  # gold formatted, prediction has trailing .0
        ("-4", "4", False),  # sign matters
        ("0.5", "1/2", True),  # decimal vs fraction
        ("12 apples", "12", True),  # unit after the number
        ("12", "120", False),  # prefix is not a match (string `in` would say yes)
        (None, "5", False),  # nothing extracted
        ("Paris.", "paris", True),  # non-numeric gold: case and trailing period ignored
        ("Lyon", "Paris", False),
    ],
)
def test_answers_match(predicted, gold, match):
    assert answers_match(predicted, gold) is match


def test_gold_from_gsm8k_solution():
    assert gold_from_gsm8k_solution("48/2 = <<48/2=24>>24\n#### 1,234") == "1234"
    assert gold_from_gsm8k_solution("so 3.50\n#### 3.50") == "3.5"
    with pytest.raises(ValueError, match="no '#### <answer>' line"):
        gold_from_gsm8k_solution("The answer is 5.")  # malformed: no #### line
    with pytest.raises(ValueError, match="not a number"):
        gold_from_gsm8k_solution("#### five")


def test_extract_final_text():
    assert extract_final_text("work\n\\boxed{2*(3+4)}") == "2*(3+4)"
    assert extract_final_text("Thinking...\nAnswer: 94*4 - 61 - 6\n") == "94*4 - 61 - 6"
    assert extract_final_text("line one\n  the end  \n\n") == "the end"
    assert extract_final_text("   ") is None
