"""Instruction-following verifier: every constraint type, satisfied and violated."""

import pytest

from prorl_async.rewards import grade
from prorl_async.rewards.instruction import CHECKERS


def irow(*constraints):
    return {"id": "i", "domain": "instruction", "prompt": "?",
            "constraints": [{"type": t, "kwargs": kw} for t, kw in constraints]}


# type -> (kwargs, a response that satisfies it, a response that violates it)
CASES = {
    "word_count": ({"relation": "at least", "num": 5}, "one two three four five", "one two three"),
    "sentence_count": ({"relation": "exactly", "num": 2}, "It rains. We stay in!", "One. Two. Three."),
    "paragraph_count": ({"num": 2}, "First part.\n\nSecond part.", "Only one paragraph."),
    "keywords_include": ({"keywords": ["river", "stone"]}, "A stone by the River.", "A stone by the sea."),
    "keywords_exclude": ({"keywords": ["very"]}, "It is everyday.", "It is very good."),
    "keyword_frequency": ({"keyword": "tea", "relation": "at least", "num": 2},
                          "Tea first, then more tea.", "Tea, then steak."),
    "letter_frequency": ({"letter": "z", "relation": "at least", "num": 3}, "zoo zebra zen", "zoo"),
    "json_format": ({}, '```json\n{"a": [1, 2]}\n```', '{"a": [1, 2],}'),
    "bullet_count": ({"num": 3}, "* one\n* two\n- three", "* one\n* two"),
    "highlight_count": ({"num": 2}, "This is *bold* and *this*.", "Only *one* here."),
    "placeholder_count": ({"num": 2}, "Dear [name], at [address].", "Dear [name]."),
    "title": ({}, "<<My Poem>>\nRoses.", "My Poem\nRoses."),
    "start_with": ({"phrase": "Dear friend"}, "  dear friend, hello", "Hello, dear friend"),
    "end_with": ({"phrase": "Any other questions?"}, "Done. Any other questions?  \n", "Any other questions? Done."),
    "postscript": ({"marker": "P.S."}, "Hi.\n\nP.S. see you", "Hi. See you P.S."),
    "quotation": ({}, '"All of it quoted."', 'Not "quoted".'),
    "all_lowercase": ({}, "all small here.", "Not all small."),
    "all_uppercase": ({}, "ALL CAPS HERE.", "ALL CAPS Except."),
    "capital_word_frequency": ({"relation": "at most", "num": 1}, "ONE capital word.", "TWO CAPITAL words."),
    "no_commas": ({}, "No commas here.", "One, two."),
    "sections": ({"num": 2, "splitter": "Section"}, "Section 1\nA\nSection 2\nB", "Section 1\nA"),
}


def test_every_constraint_type_is_covered():
    assert set(CASES) == set(CHECKERS)


@pytest.mark.parametrize("ctype", sorted(CASES))
def test_constraint_satisfied_and_violated(ctype):
    kwargs, good, bad = CASES[ctype]
    ok = grade(irow((ctype, kwargs)), good)
    ko = grade(irow((ctype, kwargs)), bad)
    assert (ok.reward, ok.valid, ok.reason) == (1.0, True, "all_satisfied")
    assert (ko.reward, ko.valid, ko.reason) == (0.0, True, f"failed:{ctype}")


@pytest.mark.parametrize("rel,n,count,ok", [
    ("at least", 3, 3, True), ("at least", 3, 2, False), ("at most", 3, 3, True),
    ("at most", 3, 4, False), ("less than", 3, 2, True), ("less than", 3, 3, False),
    ("more than", 3, 4, True), ("more than", 3, 3, False), ("exactly", 3, 3, True),
    ("exactly", 3, 4, False),
])
def test_relations(rel, n, count, ok):
    g = grade(irow(("word_count", {"relation": rel, "num": n})), " ".join(["w"] * count))
    assert g.reward == float(ok)


def test_fraction_and_all_modes():
    r = irow(("no_commas", {}), ("all_lowercase", {}), ("word_count", {"relation": "at least", "num": 100}))
    assert grade(r, "two of three hold").reward == pytest.approx(2 / 3)
    assert grade(r, "two of three hold", instruction_mode="all").reward == 0.0
    assert grade(r, " ".join(["ok"] * 100), instruction_mode="all").reward == 1.0


def test_only_the_text_after_thinking_is_checked():
    r = irow(("no_commas", {}))
    assert grade(r, "<think>hmm, well, yes</think>No commas at all.").reward == 1.0
    assert grade(r, "<think>fine</think>A, B").reward == 0.0


def test_unknown_constraint_is_invalid_and_named():
    g = grade(irow(("no_commas", {}), ("rhymes_with", {"word": "cat"})), "x")
    assert (g.valid, g.reason) == (False, "unknown_constraint:rhymes_with")


@pytest.mark.parametrize("constraint", [
    ("word_count", {"relation": "around", "num": 5}),
    ("word_count", {"relation": "at least"}),
    ("keywords_include", {"keywords": "river"}),
    ("letter_frequency", {"letter": "ab", "relation": "at least", "num": 1}),
    ("start_with", {}),
])
def test_bad_kwargs_are_invalid(constraint):
    g = grade(irow(constraint), "x")
    assert not g.valid and g.reason == f"malformed_row:bad kwargs for {constraint[0]}"


def test_missing_constraints_is_invalid():
    assert not grade({"id": "i", "domain": "instruction", "prompt": "?"}, "x").valid


# ---- reward hacking: saying nothing satisfies every "do not" constraint

SATISFIED_BY_NOTHING = [("no_commas", {}), ("keywords_exclude", {"keywords": ["very"]}),
                        ("word_count", {"relation": "at most", "num": 50}),
                        ("capital_word_frequency", {"relation": "less than", "num": 2}),
                        ("letter_frequency", {"letter": "z", "relation": "at most", "num": 1})]


@pytest.mark.parametrize("response", ["", "  \n\t", "<think>Let me think, then answer.</think>", "<think>ok</think>\n\n",
                                      "<think>a long thought, cut at max length and never closed"])
@pytest.mark.parametrize("mode", ["fraction", "all"])
def test_an_empty_answer_satisfies_no_constraint(response, mode):
    for constraint in SATISFIED_BY_NOTHING:
        g = grade(irow(constraint), response, instruction_mode=mode)
        assert (g.reward, g.valid, g.reason) == (0.0, True, "no_answer"), (constraint, g)
    g = grade(irow(*SATISFIED_BY_NOTHING), response, instruction_mode=mode)
    assert (g.reward, g.valid, g.reason) == (0.0, True, "no_answer")


def test_a_short_answer_after_thinking_is_still_graded():
    r = irow(("no_commas", {}), ("all_lowercase", {}))
    assert grade(r, "<think>well, hm</think>yes").reward == 1.0
    assert grade(r, "plain answer").reward == 1.0  # no thinking tags at all: the whole response


def test_a_malformed_row_is_invalid_even_for_an_empty_answer():
    g = grade(irow(("no_commas", {}), ("start_with", {})), "")
    assert (g.valid, g.reason) == (False, "malformed_row:bad kwargs for start_with")
