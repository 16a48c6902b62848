"""Code verifier: run the response's program against the row's tests in the sandbox.

The program is the last fenced ```` ```python ```` (or ```` ```py ````/```` ```python3 ````)
block of the response, else the whole response. ``row["tests"]`` is a list of

* stdin/stdout cases ``{"input": str, "output": str}``: the program runs as ``__main__``
  with that stdin; its stdout must match ``output`` line by line, ignoring trailing whitespace
  and trailing blank lines, with numeric tokens compared at a relative/absolute tolerance of
  1e-6 (the usual competitive-programming checker, as in APPS / CodeContests / LiveCodeBench);
* function-call cases ``{"fn_name": str, "args": list, "expected": any}``: the program is
  executed, then ``fn_name(*args)`` (a top-level function, or LeetCode-style
  ``Solution().fn_name``) is called; the JSON form of its return value (tuples as lists, sets
  as sorted lists) must equal ``expected``, floats at 1e-6.

or one of two dicts that carry their tests as Python code (the forms of HumanEval and MBPP):

* HumanEval form ``{"check": "<source defining check(candidate)>", "entry_point": "<name>"}``,
  optionally with ``"prompt"`` (the problem's code prompt: signature and docstring): one test,
  passed iff ``check(<the program's entry_point>)`` returns without raising. With a prompt, a
  program that defines ``def <entry_point>(`` at top level is a full function and runs after
  the prompt (so the prompt's imports and helper functions exist; the program's definition
  replaces the prompt's stub); any other program is a function *body*, appended to the prompt
  (indented by four spaces first if none of its lines is indented) -- the completion form of
  the original HumanEval evaluation (Chen et al. 2021). Without a prompt the program runs as is;
* MBPP form ``{"asserts": ["assert f(1) == 2", ...], "setup": "<optional code>"}``: one test per
  assert, each run after the program and ``setup`` in a fresh process (MBPP's
  ``test_setup_code``); passed iff the assert holds.

For these two forms the test code runs *inside* the sandbox, in the program's own namespace, as
in the reference harnesses: a test passes only if its code ran to its end (an ``exit()`` or
``os._exit`` before that fails it), but a program that tampers with its interpreter (an object
equal to everything, writing the harness's completion marker itself) can fool it. Training on
untrusted policies is safer with stdin/stdout or function-call cases, whose expected values
never enter the sandbox.

What no form can tell: how an output was made. A program that prints one case's expected
output passes that case only (every case runs with its own input, so the other cases fail), but a
program holding a table of the row's inputs and outputs passes them all, as does a constant
program when every case expects the same output. Rows whose cases the prompt shows need hidden
cases, and enough of them with different inputs and outputs, for the reward to mean the program
computes its answer.

Reward: the fraction of tests passed (``code_mode="fraction"``, the PRIME/ProRL partial-credit
choice) or 1.0 iff all pass (``code_mode="all"``). A program that loops, crashes, floods its
output or tries to escape simply fails its tests: reward 0 with ``reason`` naming the first
failure (``failed:timeout``, ``failed:output_limit``, ``failed:error:MemoryError``,
``failed:wrong_output``...). Only a sandbox that could not run at all is ``valid=False``
(``sandbox_error``). Expected outputs of stdin/stdout and function-call cases never enter the
sandbox.
"""

from __future__ import annotations

import math
import re

from prorl_async.rewards.base import Grade, invalid
from prorl_async.rewards.sandbox import SandboxError, SandboxLimits, run_tests

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_EXC_NAME = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))\b", re.M)
_TOL = 1e-6


def extract_program(response: str) -> str:
    """The last fenced python block of ``response``, else the whole response."""
    blocks = _FENCE.findall(response)
    if blocks:
        return blocks[-1]
    # an unterminated last block (the response was cut at max length)
    start = re.search(r"```(?:python3?|py)[ \t]*\n", response, re.IGNORECASE)
    if start and "```" not in response[start.end():]:
        return response[start.end():]
    return response


def _tokens_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if math.isnan(x) or math.isnan(y):
        return False
    return math.isclose(x, y, rel_tol=_TOL, abs_tol=_TOL)


def stdout_matches(got: str, expected: str) -> bool:
    """Line-by-line comparison ignoring trailing whitespace/blank lines; numbers at 1e-6."""
    g = [line.rstrip() for line in got.rstrip().splitlines()]
    e = [line.rstrip() for line in str(expected).rstrip().splitlines()]
    if g == e:
        return True
    if len(g) != len(e):
        return False
    for gl, el in zip(g, e):
        gt, et = gl.split(), el.split()
        if len(gt) != len(et) or not all(_tokens_equal(x, y) for x, y in zip(gt, et)):
            return False
    return True


def values_equal(got, expected) -> bool:
    """Structural equality of JSON values; floats at 1e-6; bool is not a number."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return got is expected or (type(got) is type(expected) and got == expected)
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=_TOL, abs_tol=_TOL)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return got == expected


def to_cases(tests) -> tuple[list[dict], str | None]:
    """Sandbox cases (inputs only, or test code for the dict forms) from ``row["tests"]``, or an error message."""
    if isinstance(tests, dict):
        return _code_test_cases(tests)
    if not isinstance(tests, list) or not tests:
        return [], "tests must be a non-empty list, or a {check, entry_point} / {asserts} object"
    cases = []
    for k, t in enumerate(tests):
        if not isinstance(t, dict):
            return [], f"test {k} is not an object"
        if "fn_name" in t:
            if not isinstance(t["fn_name"], str) or "expected" not in t:
                return [], f"test {k}: a function case needs str fn_name, args and expected"
            args = t.get("args", [])
            if not isinstance(args, list):
                return [], f"test {k}: args must be a list"
            cases.append({"kind": "call", "fn_name": t["fn_name"], "args": args})
        elif "input" in t and "output" in t:
            if not isinstance(t["input"], str) or not isinstance(t["output"], str):
                return [], f"test {k}: input and output must be strings"
            cases.append({"kind": "stdio", "input": t["input"]})
        else:
            return [], f"test {k} has neither input/output nor fn_name/args/expected"
    return cases, None


_IDENT = re.compile(r"^[A-Za-z_]\w*$")


def _code_test_cases(tests: dict) -> tuple[list[dict], str | None]:
    """``exec`` cases of the HumanEval ``{check, entry_point}`` and MBPP ``{asserts, setup}`` forms."""
    if "check" in tests:
        unknown = sorted(set(tests) - {"check", "entry_point", "prompt"})
        if unknown:
            return [], f"unknown key(s) {unknown} in a HumanEval-form test; use check, entry_point, prompt"
        check, entry = tests.get("check"), tests.get("entry_point")
        if not isinstance(check, str) or not check.strip():
            return [], "check must be Python source defining check(candidate)"
        if not isinstance(entry, str) or not _IDENT.match(entry):
            return [], "entry_point must be the name of the function under test"
        if tests.get("prompt") is not None and not isinstance(tests["prompt"], str):
            return [], "prompt must be a string (the problem's code prompt)"
        return [{"kind": "exec", "code": f"{check}\n\ncheck({entry})\n"}], None
    if "asserts" in tests:
        unknown = sorted(set(tests) - {"asserts", "setup"})
        if unknown:
            return [], f"unknown key(s) {unknown} in an MBPP-form test; use asserts, setup"
        asserts, setup = tests["asserts"], tests.get("setup") or ""
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) and a.strip() for a in asserts):
            return [], "asserts must be a non-empty list of Python statements (strings)"
        if not isinstance(setup, str):
            return [], "setup must be a string of Python code"
        return [{"kind": "exec", "code": f"{setup}\n{a}\n"} for a in asserts], None
    return [], "a tests object needs check and entry_point (HumanEval form) or asserts (MBPP form)"


def humaneval_program(program: str, prompt: str, entry_point: str) -> str:
    """The program to test for a HumanEval-form row with a code prompt (see the module doc)."""
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", program, re.MULTILINE):
        return f"{prompt.rstrip()}\n\n\n{program}"
    lines = program.splitlines()
    if not any(line[:1] in (" ", "\t") for line in lines if line.strip()):
        program = "\n".join(("    " + line) if line.strip() else line for line in lines) + "\n"
    return prompt + program if prompt.endswith("\n") else f"{prompt}\n{program}"


def limits_from_options(options: dict) -> SandboxLimits:
    total = float(options.get("code_total_time_s", 6.0))
    budget = options.get("time_budget_s")
    if budget:  # leave the pool's kill-based limit room for sandbox start-up and comparison
        total = max(0.5, min(total, 0.8 * float(budget) - 1.0))
    return SandboxLimits(
        time_limit_s=min(float(options.get("code_time_limit_s", 2.0)), total),
        total_time_s=total,
        memory_mb=int(options.get("code_memory_mb", 512)),
        max_procs=int(options.get("code_max_procs", 16)),
        max_output_bytes=int(options.get("code_max_output_bytes", 1 << 20)),
    )


def _failure_reason(case, test) -> str:
    if case.status == "ok":
        return "wrong_output"
    if case.status == "error":
        names = _EXC_NAME.findall(case.stderr)
        return f"error:{names[-1].rsplit('.', 1)[-1]}" if names else f"error:exit_{case.exit}"
    return case.status


def verify(row: dict, response: str, **options) -> Grade:
    tests = row.get("tests")
    cases, problem = to_cases(tests)
    if problem:
        return invalid("code", f"malformed_row:{problem}")
    program = extract_program(response)
    if not program.strip():
        return Grade(0.0, True, "no_answer", "code")
    if isinstance(tests, dict) and tests.get("prompt"):
        program = humaneval_program(program, tests["prompt"], tests["entry_point"])
    try:
        run = run_tests(program, cases, limits_from_options(options),
                        isolation=options.get("code_isolation", "auto"))
    except SandboxError:
        return invalid("code", "sandbox_error")
    passed, first_failure = 0, None
    if isinstance(tests, dict):  # test code ran in the sandbox: ok means it passed
        tests = [{"code": c["code"]} for c in cases]
    for test, case in zip(tests, run.cases):
        if case.status == "ok":
            if "code" in test:
                ok = case.returned is True
            elif "fn_name" in test:
                ok = values_equal(case.returned, test["expected"])
            else:
                ok = stdout_matches(case.stdout, test["output"])
        else:
            ok = False
        if ok:
            passed += 1
        elif first_failure is None:
            first_failure = _failure_reason(case, test)
    n = len(tests)
    if options.get("code_mode", "fraction") == "all":
        reward = 1.0 if passed == n else 0.0
    else:
        reward = passed / n
    return Grade(reward, True, "passed" if passed == n else f"failed:{first_failure}", "code")
