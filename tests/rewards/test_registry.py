"""The Grade contract, the domain registry and the arithmetic verifier."""

import dataclasses
import math
import timeit

import pytest

from prorl_async import rewards
from prorl_async.rewards import DEFAULT_OPTIONS, VERIFIERS, Grade, grade, register


def arith(answer, prompt="12+34="):
    return {"id": "a1", "domain": "arithmetic", "prompt": prompt, "answer": answer}


def test_builtin_domains_are_registered():
    assert {"arithmetic", "math", "code", "stem", "logic", "instruction"} <= set(VERIFIERS)


def test_grade_is_frozen():
    g = Grade(1.0, True, "correct", "math")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.reward = 0.0


def test_unknown_domain_names_row_and_known_domains():
    with pytest.raises(ValueError) as e:
        grade({"id": "row-17", "domain": "chemistry"}, "x")
    assert "row-17" in str(e.value) and "'arithmetic'" in str(e.value) and "chemistry" in str(e.value)


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="code_mod"):
        grade(arith("46"), "46", code_mod="all")
    with pytest.raises(ValueError, match="code_mode"):
        grade(arith("46"), "46", code_mode="half")


def test_default_options():
    assert DEFAULT_OPTIONS["code_mode"] == "fraction"
    assert DEFAULT_OPTIONS["instruction_mode"] == "fraction"
    assert DEFAULT_OPTIONS["stem_rel_tol"] == 1e-4


@pytest.mark.parametrize("response,reward,reason", [
    ("46", 1.0, "correct"),
    (" 46 ", 1.0, "correct"),
    ("\n46\n12+3=15", 1.0, "correct"),
    ("46abc", 1.0, "correct"),
    ("47", 0.0, "wrong"),
    ("460", 0.0, "wrong"),
    ("4 6", 0.0, "wrong"),
    ("the answer is 46", 0.0, "no_answer"),
    ("", 0.0, "no_answer"),
    ("+46", 0.0, "no_answer"),
])
def test_arithmetic(response, reward, reason):
    g = grade(arith("46"), response)
    assert (g.reward, g.valid, g.reason, g.domain) == (reward, True, reason, "arithmetic")


def test_arithmetic_negative_and_malformed():
    assert grade(arith("-7", "3-10="), "-7").reward == 1.0
    assert grade(arith("-7", "3-10="), "7").reward == 0.0
    bad = grade(arith("forty-six"), "46")
    assert not bad.valid and bad.reason.startswith("malformed_row")


def test_arithmetic_is_cheap():
    row = arith("46")
    per_call = min(timeit.repeat(lambda: grade(row, " 46 junk"), number=2000, repeat=3)) / 2000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per arithmetic grade"


def test_register_custom_verifier_plain_and_with_options():
    seen = {}

    def plain(row, response):
        return Grade(0.5, True, "half", "custom_plain")

    def with_opts(row, response, **options):
        seen.update(options)
        return Grade(1.0, True, "ok", "custom_opts")

    try:
        register("custom_plain", plain)
        register("custom_opts", with_opts)
        assert grade({"id": "c", "domain": "custom_plain"}, "x").reward == 0.5
        grade({"id": "c", "domain": "custom_opts"}, "x", stem_rel_tol=0.5)
        assert seen["stem_rel_tol"] == 0.5 and seen["code_mode"] == "fraction"
    finally:
        VERIFIERS.pop("custom_plain", None)
        VERIFIERS.pop("custom_opts", None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf])
def test_non_finite_reward_is_invalid(value):
    register("custom_nan", lambda row, response: Grade(value, True, "x", "custom_nan"))
    try:
        g = grade({"id": "n", "domain": "custom_nan"}, "x")
    finally:
        VERIFIERS.pop("custom_nan")
    assert (g.valid, g.reason, g.reward) == (False, "non_finite", 0.0)


def test_verifier_exceptions_propagate_from_grade():
    def boom(row, response):
        raise KeyError("x")

    register("custom_boom", boom)
    try:
        with pytest.raises(KeyError):
            grade({"id": "b", "domain": "custom_boom"}, "x")
    finally:
        VERIFIERS.pop("custom_boom")


def test_invalid_helper():
    assert rewards.invalid("math", "timeout") == Grade(0.0, False, "timeout", "math")
