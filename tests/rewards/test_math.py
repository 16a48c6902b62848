"""Math verifier: equivalent forms a human grader accepts, near-misses they reject."""

import pytest

from prorl_async.rewards import grade
from prorl_async.rewards.base import find_last_boxed
from prorl_async.rewards.math import extract_answer

EQUIVALENT = [
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}"),
    ("\\frac{3}{4}", "\\boxed{\\tfrac34}"),
    ("0.75", "\\boxed{3/4}"),
    ("\\frac{7}{2}", "\\boxed{3.5}"),
    ("-\\frac{2}{3}", "\\boxed{\\frac{-2}{3}}"),
    ("-\\frac{2}{3}", "\\boxed{-2/3}"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("\\frac{\\sqrt{3}}{3}", "\\boxed{\\frac{1}{\\sqrt{3}}}"),
    ("3\\sqrt{3}", "\\boxed{\\sqrt{27}}"),
    ("\\sqrt{2}/2", "\\boxed{\\frac{\\sqrt2}{2}}"),
    ("50\\%", "\\boxed{50\\%}"),
    ("50\\%", "\\boxed{0.5}"),
    ("0.25", "\\boxed{25\\%}"),
    ("12", "\\boxed{12 \\text{ cm}}"),
    ("12", "\\boxed{12\\text{ meters}}"),
    ("5", "\\boxed{\\$5}"),
    ("1000", "\\boxed{1,000}"),
    ("1000", "\\boxed{1{,}000}"),
    ("10", "\\boxed{10.0}"),
    ("90", "\\boxed{90^\\circ}"),
    ("[1,2)", "\\boxed{[1, 2)}"),
    ("(-\\infty, 3]", "\\boxed{(-\\infty,3]}"),
    ("(0,\\infty)", "\\boxed{(0, \\infty)}"),
    ("\\{1,2,3\\}", "\\boxed{\\{3, 1, 2\\}}"),
    ("\\{-2, 5\\}", "\\boxed{\\{5,-2\\}}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("2x+2", "\\boxed{2(x+1)}"),
    ("\\frac{x}{2}", "\\boxed{0.5x}"),
    ("3", "\\boxed{x = 3}"),
    ("1/3", "\\boxed{\\frac{1}{3}}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("2\\pi", "\\boxed{2 \\pi}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}"),
    ("e^2", "\\boxed{e^{2}}"),
    ("3+2i", "\\boxed{2i+3}"),
    ("(1, 2)", "\\boxed{(1,2)}"),
    ("42", "Let me compute. First 6*7 = 42. The answer is 42."),
    ("42", "So the final answer is $42$."),
    ("\\frac{1}{4}", "Thus the answer is \\(\\frac{1}{4}\\)."),
    ("7", "We get \\boxed{5} at first, but correcting: \\boxed{7}"),
    ("\\frac{19}{12}", "Adding: $\\frac{3}{4}+\\frac{5}{6}=\\frac{9}{12}+\\frac{10}{12}$, so \\boxed{\\frac{19}{12}}."),
    ("-4", "\\boxed{-4}"),
    ("0", "\\boxed{0}"),
    ("10^{6}", "\\boxed{1000000}"),
    ("\\infty", "\\boxed{\\infty}"),
    ("2^{10}", "\\boxed{1024}"),
    ("\\log_2 8", "\\boxed{3}"),
    ("\\binom{5}{2}", "\\boxed{10}"),
    (7, "\\boxed{7}"),  # a numeric gold (JSON number)
    ("\\boxed{12}", "\\boxed{12}"),  # a gold written with its own box
]

NOT_EQUIVALENT = [
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("0.5", "\\boxed{0.05}"),
    ("\\frac{1}{3}", "\\boxed{0.33}"),
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{3}}"),
    ("\\sqrt{2}", "\\boxed{2}"),
    ("-3", "\\boxed{3}"),
    ("12", "\\boxed{13 \\text{ cm}}"),
    ("[1,2)", "\\boxed{(1,2)}"),
    ("[1,2)", "\\boxed{[1,2]}"),
    ("\\{1,2,3\\}", "\\boxed{\\{1,2\\}}"),
    ("x^2+2x+1", "\\boxed{(x-1)^2}"),
    ("2x+2", "\\boxed{2x+1}"),
    ("\\pi", "\\boxed{3.14}"),
    ("3+2i", "\\boxed{3-2i}"),
    ("(1, 2)", "\\boxed{(2,1)}"),
    ("42", "\\boxed{24}"),
    ("7", "\\boxed{7} was my first guess but it is \\boxed{8}"),
    ("1000", "\\boxed{100}"),
    ("10", "\\boxed{1}"),
    ("e^2", "\\boxed{2e}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\pi}"),
]

NO_ANSWER = [
    ("42", "I think it's 42 but I am not sure."),  # no box, no "answer is"
    ("42", ""),
    ("42", "\\boxed{}"),
    ("5", "The result: \\boxed{5"),  # unclosed box
]


def row(gold):
    return {"id": "m1", "domain": "math", "prompt": "?", "answer": gold}


@pytest.mark.parametrize("gold,response", EQUIVALENT)
def test_equivalent_forms_match(gold, response):
    g = grade(row(gold), response)
    assert (g.reward, g.valid, g.reason) == (1.0, True, "correct"), g


@pytest.mark.parametrize("gold,response", NOT_EQUIVALENT)
def test_near_misses_do_not_match(gold, response):
    g = grade(row(gold), response)
    assert (g.reward, g.valid) == (0.0, True), g
    assert g.reason in ("wrong", "unparseable_answer")


@pytest.mark.parametrize("gold,response", NO_ANSWER)
def test_missing_final_answer_is_wrong_not_invalid(gold, response):
    g = grade(row(gold), response)
    assert (g.reward, g.valid, g.reason) == (0.0, True, "no_answer")


def test_case_count():
    assert len(EQUIVALENT) + len(NOT_EQUIVALENT) + len(NO_ANSWER) >= 60


def test_last_box_wins_and_nested_braces():
    assert find_last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert find_last_boxed("\\fbox{3}") == "3"
    assert find_last_boxed("no box") is None
    assert find_last_boxed("\\boxed{\\frac{1}{2}") is None


@pytest.mark.parametrize("response,expected", [
    ("so the answer is 42.", "42"),
    ("The final answer is: $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("**Final answer:** 17", "17"),
    ("Answer: \\(x=3\\)", "x=3"),
    ("the answer is 4\nbut then more text", "4"),
])
def test_answer_is_fallback(response, expected):
    assert extract_answer(response) == expected


def test_box_takes_precedence_over_answer_is():
    assert extract_answer("The answer is 3. Actually \\boxed{4}") == "4"


def test_malformed_rows_are_invalid():
    assert grade(row(""), "\\boxed{1}").reason == "malformed_row:missing answer"
    g = grade({"id": "m", "domain": "math", "prompt": "?"}, "\\boxed{1}")
    assert not g.valid and g.reason.startswith("malformed_row")


def test_works_off_the_main_thread():
    # Math-Verify's own signal timeouts would raise here; ours are disabled (the pool kills).
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(grade(row("\\frac{1}{2}"), "\\boxed{0.5}")))
    t.start()
    t.join(60)
    assert out and out[0].reward == 1.0


def test_group_samples_share_cached_verdicts():
    from prorl_async.rewards.math import _equivalent

    before = _equivalent.cache_info().hits
    for _ in range(4):  # the n samples of one group, same final answer
        assert grade(row("\\frac{5}{7}"), "work... \\boxed{10/14}").reward == 1.0
    assert _equivalent.cache_info().hits == before + 3


@pytest.mark.parametrize("gold,response", [
    ("2", "\\boxed{2, 3}"), ("2", "\\boxed{1,2,3,4}"), ("2", "\\boxed{2 \\text{ or } 3}"), ("2", "\\boxed{2 or 3}"),
    ("2", "\\boxed{x=2 \\text{ or } x=3}"), ("2", "\\boxed{\\{1,2,3\\}}"), ("2", "\\boxed{2; 3}"),
    ("2", "\\boxed{2 \\lor 3}"), ("B", "\\boxed{A, B, C, D}"), ("B", "\\boxed{A or B}"),
])
def test_several_candidates_in_one_box_are_wrong(gold, response):
    # a hedge contains the gold answer; Math-Verify compares the whole set/tuple, which is not it
    g = grade(row(gold), response)
    assert (g.reward, g.valid) == (0.0, True), g
    assert grade(row(gold), f"\\boxed{{{gold}}}").reward == 1.0
