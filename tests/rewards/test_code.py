"""Code verifier: program extraction, stdin/stdout, function-call, HumanEval and MBPP tests, partial credit."""

import os

import pytest

from prorl_async.rewards import code as code_mod
from prorl_async.rewards import grade
from prorl_async.rewards.code import extract_program, limits_from_options, stdout_matches, values_equal
from prorl_async.rewards.sandbox import SandboxError

ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"},
             {"input": "0 0\n", "output": "0\n"}, {"input": "5 5\n", "output": "10\n"}]


def row(tests):
    return {"id": "c", "domain": "code", "prompt": "add two ints", "tests": tests}


def test_correct_program_full_reward():
    g = grade(row(ADD_TESTS), "Here:\n```python\nimport sys\na, b = map(int, sys.stdin.read().split())\n"
                              "print(a + b)\n```\nDone.")
    assert (g.reward, g.valid, g.reason) == (1.0, True, "passed")


def test_partial_credit_and_all_mode():
    # right only when a == b or one is 0... i.e. for 0 0 and 5 5 (2 of 4)
    prog = "```python\na, b = map(int, input().split())\nprint(2 * max(a, b) if a == b else 7)\n```"
    frac = grade(row(ADD_TESTS), prog)
    assert (frac.reward, frac.reason) == (0.5, "failed:wrong_output")
    assert grade(row(ADD_TESTS), prog, code_mode="all").reward == 0.0


def test_runtime_error_reason_names_the_exception():
    g = grade(row(ADD_TESTS), "```python\nraise ZeroDivisionError\n```")
    assert (g.reward, g.valid, g.reason) == (0.0, True, "failed:error:ZeroDivisionError")


def test_function_call_cases_top_level_and_solution_class():
    tests = [{"fn_name": "two_sum", "args": [[2, 7, 11, 15], 9], "expected": [0, 1]},
             {"fn_name": "two_sum", "args": [[3, 2, 4], 6], "expected": [1, 2]}]
    top = "def two_sum(nums, t):\n    seen = {}\n    for i, x in enumerate(nums):\n" \
          "        if t - x in seen:\n            return (seen[t - x], i)\n        seen[x] = i\n"
    assert grade(row(tests), f"```python\n{top}```").reward == 1.0  # a tuple equals a JSON list
    cls = "class Solution:\n    def two_sum(self, nums, t):\n        return [0, 1]\n"
    assert grade(row(tests), f"```python\n{cls}```").reward == 0.5
    missing = grade(row(tests), "```python\ndef other():\n    pass\n```")
    assert (missing.reward, missing.reason) == (0.0, "failed:error:NameError")


def test_function_cases_do_not_run_main_guard():
    tests = [{"fn_name": "f", "args": [2], "expected": 4}]
    prog = "def f(x):\n    return x * x\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    assert grade(row(tests), prog).reward == 1.0


def test_mixed_case_kinds():
    tests = [ADD_TESTS[0], {"fn_name": "add", "args": [1, 2], "expected": 3}]
    prog = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n" \
           "    print(add(*map(int, input().split())))\n"
    assert grade(row(tests), prog).reward == 1.0


@pytest.mark.parametrize("response,expected", [
    ("```python\nA\n```\ntext\n```python\nB\n```", "B\n"),
    ("```py\nC\n```", "C\n"),
    ("```Python3\nD\n```", "D\n"),
    ("no fences at all", "no fences at all"),
    ("text\n```python\nE = 1\n", "E = 1\n"),  # cut off at max length
])
def test_extract_program(response, expected):
    assert extract_program(response) == expected


def test_stdout_comparison_rules():
    assert stdout_matches("3  \n\n\n", "3\n")
    assert stdout_matches("0.3333333333\n", "0.333333333")
    assert not stdout_matches("0.33\n", "0.333333333")
    assert not stdout_matches("3\n4\n", "3\n")
    assert not stdout_matches("3 4", "34")


def test_value_comparison_rules():
    assert values_equal([1, [2.0000000001]], [1, [2]])
    assert not values_equal(True, 1) and not values_equal(1, True)
    assert values_equal({"a": [1]}, {"a": [1]}) and not values_equal({"a": 1}, {"b": 1})
    assert not values_equal([1, 2], [1, 2, 3])
    assert not values_equal("1", 1)


@pytest.mark.parametrize("tests,reason", [
    (None, "tests must be a non-empty list"),
    ([], "tests must be a non-empty list"),
    ([{"input": "1"}], "neither"),
    ([{"input": 1, "output": "1"}], "must be strings"),
    ([{"fn_name": "f", "args": [1]}], "function case"),
    ([{"fn_name": "f", "args": 1, "expected": 1}], "args must be a list"),
])
def test_malformed_tests_are_invalid(tests, reason):
    g = grade(row(tests), "print(1)")
    assert not g.valid and g.reason.startswith("malformed_row") and reason in g.reason


def test_empty_program_is_wrong_not_invalid():
    g = grade(row(ADD_TESTS), "```python\n\n```")
    assert (g.reward, g.valid, g.reason) == (0.0, True, "no_answer")


def test_sandbox_failure_is_invalid(monkeypatch):
    def broken(*a, **k):
        raise SandboxError("unshare: Operation not permitted")

    monkeypatch.setattr(code_mod, "run_tests", broken)
    g = grade(row(ADD_TESTS), "print(3)")
    assert (g.valid, g.reason) == (False, "sandbox_error")


def test_time_budget_from_the_pool_caps_the_sandbox_time():
    assert limits_from_options({"code_total_time_s": 6.0, "time_budget_s": None}).total_time_s == 6.0
    capped = limits_from_options({"code_total_time_s": 6.0, "code_time_limit_s": 2.0, "time_budget_s": 3.0})
    assert capped.total_time_s == pytest.approx(1.4) and capped.time_limit_s == pytest.approx(1.4)


# ---- tests as Python code: the HumanEval and MBPP forms

HE_PROMPT = 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum of xs."""\n'
HE_CHECK = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n"


def he_row(prompt=HE_PROMPT):
    tests = {"check": HE_CHECK, "entry_point": "add"}
    if prompt is not None:
        tests["prompt"] = prompt
    return row(tests)


@pytest.mark.parametrize("response", [
    "    return sum(xs)\n",                                        # a completion of the prompt
    "return sum(xs)",                                              # a bare, unindented body
    "Sure:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```",  # a full function
    "```python\ndef add(xs):\n    t = 0\n    for x in xs:\n        t += x\n    return t\n```",
])
def test_humaneval_form_passes_a_right_body_or_function(response):
    assert grade(he_row(), response) == grade(he_row(), response)  # deterministic
    g = grade(he_row(), response)
    assert (g.reward, g.valid, g.reason) == (1.0, True, "passed")


@pytest.mark.parametrize("response,reason", [
    ("    pass\n", "failed:error:AssertionError"),                 # a stub body returns None
    ("    return 0\n", "failed:error:AssertionError"),
    ("```python\ndef add(xs):\n    return len(xs)\n```", "failed:error:AssertionError"),
    ("```python\ndef other(xs):\n    return sum(xs)\n```", "failed:error:AssertionError"),  # the stub stays
    ("    raise SystemExit(0)\n", "failed:error:exit_0"),          # exiting early is no pass
    ("    import os\n    os._exit(0)\n", "failed:error:exit_0"),
    ("    while True:\n        pass\n", "failed:timeout"),
])
def test_humaneval_form_fails_wrong_stub_and_early_exit(response, reason):
    g = grade(he_row(), response, code_time_limit_s=0.75, code_total_time_s=2.0)
    assert (g.reward, g.valid, g.reason) == (0.0, True, reason)


def test_humaneval_form_without_prompt_runs_the_program_as_is():
    assert grade(he_row(prompt=None), "def add(xs):\n    return sum(xs)\n").reward == 1.0
    missing = grade(he_row(prompt=None), "return sum(xs)")  # no prompt: a body is not a program
    assert (missing.reward, missing.valid) == (0.0, True) and missing.reason.startswith("failed:error")


def test_humaneval_program_assembly():
    full = code_mod.humaneval_program("def add(xs):\n    return 1\n", HE_PROMPT, "add")
    assert full.startswith(HE_PROMPT.rstrip()) and full.endswith("def add(xs):\n    return 1\n")
    body = code_mod.humaneval_program("return 1", HE_PROMPT, "add")
    assert body == HE_PROMPT + "    return 1\n"
    indented = code_mod.humaneval_program("    x = 1\n    return x\n", HE_PROMPT, "add")
    assert indented == HE_PROMPT + "    x = 1\n    return x\n"


MBPP = {"asserts": ["assert double(1) == 2", "assert double(2) == 4", "assert double(3) == 7"],
        "setup": "import math\nSCALE = 2"}


def test_mbpp_form_is_the_fraction_of_asserts_passed():
    g = grade(row(MBPP), "```python\ndef double(x):\n    return SCALE * x\n```")
    assert g.reward == pytest.approx(2 / 3) and g.reason == "failed:error:AssertionError"
    assert grade(row(MBPP), "def double(x):\n    return 2 * x\n", code_mode="all").reward == 0.0
    right = {"asserts": MBPP["asserts"][:2], "setup": MBPP["setup"]}
    assert grade(row(right), "def double(x):\n    return 2 * x\n", code_mode="all").reward == 1.0
    # each assert runs in its own process: a program that dies in one does not take the rest
    flaky = "import os\ndef double(x):\n    if x == 1:\n        os._exit(0)\n    return 2 * x\n"
    assert grade(row(right), flaky).reward == 0.5


@pytest.mark.parametrize("tests,reason", [
    ({"check": "def check(c): pass"}, "entry_point"),
    ({"check": "", "entry_point": "f"}, "check must be"),
    ({"check": "def check(c): pass", "entry_point": "f(x)"}, "entry_point"),
    ({"check": "def check(c): pass", "entry_point": "f", "tests": []}, "unknown key"),
    ({"asserts": []}, "asserts must be"),
    ({"asserts": ["assert f(1)"], "setup": 3}, "setup must be"),
    ({"asserts": "assert f(1)"}, "asserts must be"),
    ({"entry_point": "f"}, "needs check and entry_point"),
])
def test_malformed_code_test_objects_are_invalid(tests, reason):
    g = grade(row(tests), "def f(x):\n    return x\n")
    assert not g.valid and g.reason.startswith("malformed_row") and reason in g.reason


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="root isolation needs root")


@ROOT_ONLY
@pytest.mark.parametrize("body,reason", [
    # a child that outlives the check, in a session of its own
    ("    import os, time\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\n"
     "    return sum(xs) + 1\n", "failed:error:AssertionError"),
    # tries to reach the grader's files and the network from inside check(candidate)
    ("    import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    return sum(xs)\n",
     "failed:error:OSError"),
    ("    open('/etc/prorl_check_escape_probe', 'w').write('x')\n    return sum(xs)\n",
     "failed:error:PermissionError"),
])
def test_hostile_code_in_the_humaneval_form_is_contained(monkeypatch, body, reason):
    from prorl_async.rewards.sandbox import leftover_processes

    runs, real = [], code_mod.run_tests
    monkeypatch.setattr(code_mod, "run_tests", lambda *a, **k: runs.append(real(*a, **k)) or runs[-1])
    g = grade(he_row(), body, code_time_limit_s=1.0, code_total_time_s=2.0)
    assert (g.reward, g.valid, g.reason) == (0.0, True, reason)
    assert runs[0].isolation == "root"
    assert leftover_processes(runs[0].session_id, runs[0].uid) == []
    assert not os.path.exists("/etc/prorl_check_escape_probe")


# ---- reward hacking: leaving before the tests run, printing the answer without computing it

MBPP_DOUBLE = {"asserts": ["assert double(1) == 2", "assert double(2) == 4", "assert double(5) == 10"]}
RIGHT_DOUBLE = "def double(x):\n    return 2 * x\n"
ROOMY = {"code_time_limit_s": 5.0, "code_total_time_s": 30.0}  # no case times out on a loaded machine


@pytest.mark.parametrize("leave", [
    "import sys\nsys.exit(0)\n", "import sys\nsys.exit()\n", "raise SystemExit\n", "raise SystemExit(0)\n",
    "import os\nos._exit(0)\n", "import sys\nsys.stdout.flush()\nsys.exit(None)\n",
])
@pytest.mark.parametrize("where", ["after", "before"])
def test_mbpp_form_an_exit_before_the_asserts_passes_none(leave, where):
    program = RIGHT_DOUBLE + leave if where == "after" else leave + RIGHT_DOUBLE
    assert grade(row(MBPP_DOUBLE), RIGHT_DOUBLE, **ROOMY).reward == 1.0  # the program itself is right
    g = grade(row(MBPP_DOUBLE), f"```python\n{program}```", **ROOMY)
    assert (g.reward, g.valid) == (0.0, True), g
    assert g.reason in ("failed:error:exit_0", "failed:error:SystemExit"), g


def test_mbpp_form_an_exit_inside_the_function_under_test_fails_that_assert():
    program = "import sys\ndef double(x):\n    if x == 5:\n        sys.exit(0)\n    return 2 * x\n"
    g = grade(row(MBPP_DOUBLE), program, **ROOMY)
    assert g.reward == pytest.approx(2 / 3) and g.reason == "failed:error:exit_0"


SQUARE_TESTS = [{"input": "3\n", "output": "9\n"}, {"input": "4\n", "output": "16\n"},
                {"input": "-5\n", "output": "25\n"}, {"input": "0\n", "output": "0\n"}]


def test_stdio_form_printing_one_expected_output_fails_the_other_cases():
    right = grade(row(SQUARE_TESTS), "```python\nx = int(input())\nprint(x * x)\n```", **ROOMY)
    assert right.reward == 1.0
    for k, case in enumerate(SQUARE_TESTS):
        printed = f"```python\nprint({case['output'].strip()!r})\n```"
        g = grade(row(SQUARE_TESTS), printed, **ROOMY)
        assert (g.reward, g.valid, g.reason) == (0.25, True, "failed:wrong_output"), (k, g)
        assert grade(row(SQUARE_TESTS), printed, code_mode="all", **ROOMY).reward == 0.0


def test_stdio_form_printing_every_expected_output_passes_none():
    outputs = "".join(c["output"] for c in SQUARE_TESTS)
    g = grade(row(SQUARE_TESTS), f"```python\nprint({outputs!r}, end='')\n```", **ROOMY)
    assert (g.reward, g.reason) == (0.0, "failed:wrong_output")


def test_stdio_form_exiting_before_printing_fails():
    g = grade(row(SQUARE_TESTS), "```python\nimport sys\nsys.exit(0)\nx = int(input())\nprint(x * x)\n```", **ROOMY)
    assert (g.reward, g.valid, g.reason) == (0.0, True, "failed:wrong_output")


def test_stdio_form_limit_a_table_of_the_cases_inputs_passes_them():
    # The documented limit (code.py's docstring): the grader sees outputs, not how they were made,
    # so a program that looks its input up in a table of the row's cases passes them. Only cases
    # the policy never sees (hidden tests, many inputs) defend against it.
    table = {c["input"].strip(): c["output"].strip() for c in SQUARE_TESTS}
    g = grade(row(SQUARE_TESTS), f"```python\nprint({table!r}[input().strip()])\n```", **ROOMY)
    assert g.reward == 1.0
    assert "table" in code_mod.__doc__ and "hidden" in code_mod.__doc__
