"""Hostile replies against the task graders: every one is a bounded reward, never an exception, and the answer
extraction is linear in the reply (one reading per ``####``, no nested quantifiers to backtrack through)."""

import pytest

from asyncsess.rl import Problem
from asyncsess.tasks import arithmetic, gsm8k
from asyncsess.tasks.numbers import canonical


@pytest.mark.parametrize(
    ("number", "spelled"),
    [("0", "-0"), ("0", "-000.000"), ("7", "007"), ("-7.5", "-7.50"), ("0.5", ".5"), ("-0.5", "-.5"), ("12", "12.")],
)
def test_canonical_spellings(number, spelled):
    assert canonical(spelled.rstrip(".")) == number


@pytest.mark.parametrize(
    "reply",
    [
        "#### 1e999999",  # read "1" before: right for an answer of 1
        "#### 1E5",
        "#### 10**10**10",  # read "10"
        "#### 2 ^ 10",
        "#### 3/4",
        "#### 2 * 5",
        "#### ٤٢",  # Arabic-Indic: \d matched it, and format was 1
        "#### ４２",  # full-width
        "#### nan",
        "#### inf",
        "#### 1.2.3",
        "#### ,,,",
    ],
)
def test_gsm8k_refuses_what_is_not_a_plain_decimal(reply):
    assert gsm8k.final_answer(reply) is None
    assert gsm8k.grade(Problem("q", "1"), reply) == (0.0, {"correct": 0.0, "format": 0.0})


def test_gsm8k_answers_in_canonical_form():
    assert gsm8k.final_answer("#### -0") == "0" and gsm8k.final_answer("#### 0042") == "42"
    assert gsm8k.final_answer("#### 1,200.50.") == "1200.5" and gsm8k.final_answer("#### $ 18 dollars") == "18"
    assert gsm8k.final_answer("#### 5 then #### x") == "5"  # the last #### that has a number
    digits = "9" * 100_000  # compared as text: int() would refuse it, float() would make it inf
    assert gsm8k.grade(Problem("q", digits), "#### " + digits)[0] == 1.0
    assert gsm8k.grade(Problem("q", "0"), "so #### -0")[0] == 1.0


@pytest.mark.parametrize(("reference", "reply"), [("1,200", "#### 1200"), ("42.0", "#### 42"), (" 7 ", "#### 007"), ("-0.50", "#### -.5")])
def test_gsm8k_a_hand_written_reference_is_compared_in_canonical_form(reference, reply):
    """A Problem built by hand with "1,200" or "42.0" never matched: only the reply was made canonical."""
    assert gsm8k.grade(Problem("q", reference), reply)[0] == 1.0
    assert gsm8k.grade(Problem("q", reference), "#### 999")[0] == 0.0
    assert gsm8k.grade(Problem("q", ""), "#### 0")[0] == 0.0  # an empty reference matches nothing


def test_gsm8k_extraction_has_no_quadratic_backtracking():
    """'####' then spaces and no number took 1.2 s at 8 KB (the two optional-space runs around an optional '$'
    split every way): minutes at 100 KB. Now each '####' is read once; these are 1-10 MB."""
    assert gsm8k.final_answer("####" + " " * 1_000_000 + "x") is None
    assert gsm8k.final_answer("####" + " " * 1_000_000 + "$" + " " * 1_000_000 + "x") is None
    assert gsm8k.final_answer("#### " + "1" * 1_000_000 + "e5") is None
    assert gsm8k.final_answer("#### " * 2_000_000 + "7") == "7"
    assert gsm8k.final_answer("#" * 10_000_000) is None


@pytest.mark.parametrize(
    ("answer", "reply", "correct"),
    [
        ("0", "-0", 1.0),  # was wrong: compared as text
        ("68", "068", 1.0),
        ("42", "٤٢", 0.0),  # ASCII digits only, as the prompt's
        ("42", "４２", 0.0),
        ("1", "9" * 100_000, 0.0),
        ("9" * 100_000, "It is " + "9" * 100_000, 1.0),
        ("1", "-" * 1_000_000, 0.0),
        ("1", "1e999999", 0.0),  # the last integer is 999999
    ],
)
def test_arithmetic_grades_hostile_numbers(answer, reply, correct):
    assert arithmetic.grade(Problem("q", answer), reply)[0] == correct
