"""Logic puzzles: each family's generator is solvable and its checker validates solutions."""

import random

import pytest

from prorl_async.rewards import grade
from prorl_async.rewards.logic import FAMILIES, check_countdown, check_graph_coloring, check_knights_knaves


def lrow(meta, answer="x"):
    return {"id": "l", "domain": "logic", "prompt": "?", "answer": answer, "meta": meta}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generated_gold_answers_pass_their_checker(family):
    gen, check = FAMILIES[family]
    rng = random.Random(7)
    for _ in range(25):
        prompt, answer, meta = gen(rng)
        assert meta["family"] == family and prompt
        assert check(meta, answer) == (True, "correct")
        assert grade(lrow(meta, answer), f"Reasoning...\n\\boxed{{{answer}}}").reward == 1.0


def test_generators_are_deterministic_by_seed():
    for gen, _ in FAMILIES.values():
        assert gen(random.Random(3)) == gen(random.Random(3))


COUNTDOWN = {"family": "countdown", "numbers": [4, 7, 8, 8], "target": 24}


@pytest.mark.parametrize("answer,ok", [
    ("(7 - 8 / 8) * 4", True),
    ("4 \\times (7 - 8 \\div 8)", True),
    ("(7-(8/8))*4 = 24", True),
    ("8 + 8 + 4 + 7", False),  # 27
    ("(7 - 8 / 8) * 4 + 0", False),  # an extra number
    ("(7 - 1) * 4", False),  # 1 is not given
    ("24", False),
    ("__import__('os').system('true')", False),
    ("8 / (8 - 8) + 4 + 7", False),
])
def test_countdown_checker(answer, ok):
    assert check_countdown(COUNTDOWN, answer)[0] is ok


def test_countdown_accepts_any_valid_expression_not_just_the_stored_one():
    meta = {"family": "countdown", "numbers": [1, 2, 3, 4], "target": 24}
    for expr in ["1 * 2 * 3 * 4", "(1 + 2 + 3) * 4", "4 * 3 * 2 / 1"]:
        assert grade(lrow(meta, "1*2*3*4"), f"\\boxed{{{expr}}}").reward == 1.0


GRAPH = {"family": "graph_coloring", "n": 4, "k": 3, "edges": [[0, 1], [1, 2], [2, 3], [0, 2]]}


@pytest.mark.parametrize("answer,ok", [
    ("0, 1, 2, 0", True), ("2, 0, 1, 2", True), ("0 1 2 1", True),
    ("0: 0, 1: 1, 2: 2, 3: 1", True),
    ("0, 1, 0, 1", False),  # 0-2 share a colour
    ("0, 1, 2", False),  # too short
    ("0, 1, 3, 0", False),  # colour out of range
])
def test_graph_coloring_checker(answer, ok):
    assert check_graph_coloring(GRAPH, answer)[0] is ok


KK = {"family": "knights_knaves", "names": ["Alice", "Bob"],
      # Alice: "Bob is a knave"; Bob: "Alice and Bob are the same kind"  ->  Alice knight, Bob knave
      "statements": [["Alice", "is_knave", "Bob"], ["Bob", "same", "Alice", "Bob"]]}


@pytest.mark.parametrize("answer,ok", [
    ("Alice: knight, Bob: knave", True),
    ("Bob is a knave and Alice is a knight", True),
    ("alice - Knight; bob - knave", True),
    ("Alice: knave, Bob: knight", False),
    ("Alice: knight, Bob: knight", False),
    ("Alice: knight", False),
])
def test_knights_knaves_checker(answer, ok):
    assert check_knights_knaves(KK, answer)[0] is ok


def test_answer_extraction_and_rows_without_meta():
    assert grade(lrow(GRAPH), "The answer is 0, 1, 2, 0").reward == 1.0
    assert grade(lrow(GRAPH), "blah\n0, 1, 2, 0").reward == 1.0  # last line fallback
    plain = {"id": "l", "domain": "logic", "prompt": "?", "answer": "Blue House"}
    assert grade(plain, "\\boxed{blue  house}").reward == 1.0
    assert grade(plain, "\\boxed{red house}").reward == 0.0


def test_bad_meta_is_invalid():
    assert grade(lrow({"family": "sudoku"}), "\\boxed{1}").reason.startswith("malformed_row")
    g = grade(lrow({"family": "countdown"}), "\\boxed{1+2}")
    assert not g.valid and g.reason.startswith("malformed_row")
