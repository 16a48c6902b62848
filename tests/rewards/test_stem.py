"""STEM verifier: multiple choice by letter or option text, numeric answers with a tolerance."""

import pytest

from prorl_async.rewards import grade
from prorl_async.rewards.stem import parse_number

CHOICES = ["3.2 m/s", "6.4 m/s", "12.8 m/s", "1.6 m/s"]


def mc(answer="B", choices=CHOICES):
    r = {"id": "s", "domain": "stem", "prompt": "?", "answer": answer}
    if choices is not None:
        r["choices"] = choices
    return r


def num(answer):
    return {"id": "s", "domain": "stem", "prompt": "?", "answer": answer}


@pytest.mark.parametrize("response", [
    "\\boxed{B}", "\\boxed{(B)}", "The answer is B.", "Answer: (b)", "\\boxed{B) 6.4 m/s}",
    "\\boxed{Option B}", "\\boxed{6.4 m/s}", "the answer is 6.4  M/S", "B",
])
def test_multiple_choice_right(response):
    g = grade(mc(), response)
    assert (g.reward, g.valid) == (1.0, True), g


@pytest.mark.parametrize("response,reason", [
    ("\\boxed{A}", "wrong"), ("The answer is C", "wrong"), ("\\boxed{3.2 m/s}", "wrong"),
    ("\\boxed{E}", "unparseable_answer"),  # no option E among four
    ("I am torn between B and C", "no_answer"),
])
def test_multiple_choice_wrong(response, reason):
    g = grade(mc(), response)
    assert (g.reward, g.valid, g.reason) == (0.0, True, reason)


def test_gold_given_as_option_text_and_letter_without_choices():
    assert grade(mc(answer="6.4 m/s"), "\\boxed{B}").reward == 1.0
    assert grade(mc(answer="C", choices=None), "\\boxed{C}").reward == 1.0
    assert grade(mc(answer="C", choices=None), "\\boxed{D}").reward == 0.0


@pytest.mark.parametrize("gold,response,reward", [
    ("9.81", "\\boxed{9.81}", 1.0),
    ("9.81", "\\boxed{9.8100 m/s^2}", 1.0),
    ("9.81", "\\boxed{9.80}", 0.0),
    ("6.022e23", "The answer is 6.022 \\times 10^{23} mol^-1", 1.0),
    ("6.022e23", "\\boxed{6.022x10^23}", 1.0),
    ("6.022e23", "\\boxed{6.022e22}", 0.0),
    ("1.5e-3", "\\boxed{0.0015 A}", 1.0),
    ("-273.15", "\\boxed{−273.15}", 1.0),
    ("12000", "\\boxed{12,000 J}", 1.0),
    ("100", "\\boxed{100.005}", 1.0),  # within 1e-4 relative
    ("100", "\\boxed{100.02}", 0.0),
    ("100", "\\boxed{\\text{about one hundred}}", 0.0),
])
def test_numeric_with_relative_tolerance(gold, response, reward):
    g = grade(num(gold), response)
    assert (g.reward, g.valid) == (reward, True), g


def test_tolerance_option():
    assert grade(num("100"), "\\boxed{101}").reward == 0.0
    assert grade(num("100"), "\\boxed{101}", stem_rel_tol=0.02).reward == 1.0


def test_text_answers_compare_case_insensitively():
    assert grade(num("mitochondria"), "The answer is Mitochondria.").reward == 1.0
    assert grade(num("mitochondria"), "The answer is ribosome").reward == 0.0


def test_malformed_rows_are_invalid():
    assert not grade(num(""), "\\boxed{1}").valid
    assert grade(mc(answer="Z"), "\\boxed{A}").reason.startswith("malformed_row")
    assert grade(mc(choices="A,B"), "\\boxed{A}").reason.startswith("malformed_row")


def test_parse_number():
    assert parse_number("approximately 3.0 x 10^8 m/s") == pytest.approx(3.0e8)
    assert parse_number("-2.5e-3") == pytest.approx(-2.5e-3)
    assert parse_number("no digits") is None


# ---- reward hacking: several candidates in one final answer

@pytest.mark.parametrize("response", [
    "\\boxed{A,B,C,D}", "\\boxed{A, B, C, D}", "\\boxed{A B C D}", "\\boxed{B or C}", "\\boxed{C or B}",
    "\\boxed{B and C}", "\\boxed{Both B and C}", "\\boxed{B/C}", "\\boxed{(B)(C)}", "\\boxed{B. C.}",
    "\\boxed{Options B, D}", "The answer is B or C", "Answer: (b) or (c)", "\\boxed{B or Z}",
])
def test_a_hedged_multiple_choice_answer_is_refused(response):
    for row in (mc(), mc(answer="C", choices=None)):  # the gold letter is among the candidates
        g = grade(row, response)
        assert (g.reward, g.valid, g.reason) == (0.0, True, "hedged_answer"), (row, g)


def test_one_candidate_written_twice_or_with_its_option_text_is_not_a_hedge():
    assert grade(mc(), "\\boxed{B) 6.4 m/s}").reason == "correct"
    assert grade(mc(), "\\boxed{(B)}").reason == "correct"
    assert grade(mc(), "\\boxed{B or b}").reason == "correct"
    # an option whose text names letters is that option, not a hedge
    assert grade(mc(answer="D", choices=["1", "2", "3", "A and B"]), "\\boxed{A and B}").reason == "correct"
