"""GraderPool through real worker processes: hangs, crashes, NaN, dying workers, throughput."""

import os
import threading
import time

import pytest

from prorl_async.rewards.pool import GraderPool
from prorl_async.rewards.sandbox import UID_BASE, UID_SLOTS

HOSTILE = ["rewards.hostile_verifiers"]


def echo(i, answer="x"):
    return {"id": f"e{i}", "domain": "echo", "answer": answer}


def arith_rows(n):
    rows = [{"id": f"a{i}", "domain": "arithmetic", "prompt": f"{i}+1=", "answer": str(i + 1)}
            for i in range(n)]
    responses = [str(i + 1) if i % 3 else f" {i} junk" for i in range(n)]
    return rows, responses


@pytest.fixture(scope="module")
def pool():
    with GraderPool(num_workers=2, timeout_s=1.0, extra_modules=HOSTILE) as p:
        yield p


def test_results_keep_input_order(pool):
    rows, responses = arith_rows(3000)
    grades = pool.grade_many(rows, responses)
    assert [g.reward for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(3000)]
    assert all(g.valid and g.domain == "arithmetic" for g in grades)
    assert len(pool.last_grade_times_s) == 3000


@pytest.mark.parametrize("domain,reason", [
    ("hang", "timeout"),  # sleeps forever
    ("spin", "timeout"),  # a tight Python loop: only a kill stops it
    ("boom", "error:RuntimeError"),
    ("nan", "non_finite"),
    ("die", "worker_died"),  # os._exit in the verifier
])
def test_failure_invalidates_only_that_sample(pool, domain, reason):
    before = pool.metrics()
    rows = [echo(i) for i in range(40)] + [{"id": "bad", "domain": domain}] + [echo(i) for i in range(40, 80)]
    responses = ["x" if i % 2 == 0 else "y" for i in range(len(rows))]
    t0 = time.monotonic()
    grades = pool.grade_many(rows, responses)
    elapsed = time.monotonic() - t0
    bad = grades[40]
    assert (bad.valid, bad.reason, bad.reward, bad.domain) == (False, reason, 0.0, domain)
    others = grades[:40] + grades[41:]
    assert all(g.valid and g.reason == "echo" for g in others)
    assert [g.reward for g in others] == [1.0 if i % 2 == 0 else 0.0 for i in range(len(rows)) if i != 40]
    after = pool.metrics()
    assert after["reward/invalid"] == before["reward/invalid"] + 1
    assert after[f"reward/invalid/{reason}"] == before.get(f"reward/invalid/{reason}", 0) + 1
    assert after[f"reward/invalid/{domain}"] == before.get(f"reward/invalid/{domain}", 0) + 1
    if reason == "timeout":
        assert after["grader/timeouts"] == before["grader/timeouts"] + 1
        assert 1.0 <= elapsed < 10
    if reason in ("timeout", "worker_died"):
        assert after["grader/worker_restarts"] == before["grader/worker_restarts"] + 1
    # and the pool keeps working afterwards
    assert pool.grade_many([echo(0)], ["x"])[0].reward == 1.0


def test_unknown_domain_is_invalid_in_the_pool(pool):
    g = pool.grade_many([{"id": "u", "domain": "nope"}], ["x"])[0]
    assert (g.valid, g.reason) == (False, "unknown_domain")


def test_several_failures_in_one_batch(pool):
    rows = [{"id": "h1", "domain": "hang"}, echo(1), {"id": "b", "domain": "boom"},
            {"id": "h2", "domain": "hang"}, echo(2)]
    grades = pool.grade_many(rows, ["x"] * 5)
    assert [g.reason for g in grades] == ["timeout", "echo", "error:RuntimeError", "timeout", "echo"]


def test_works_from_a_non_main_thread(pool):
    out = []
    t = threading.Thread(target=lambda: out.extend(pool.grade_many([{"id": "h", "domain": "hang"}, echo(0)],
                                                                   ["x", "x"])))
    t.start()
    t.join(30)
    assert [g.reason for g in out] == ["timeout", "echo"]


def test_metrics_keys(pool):
    m = pool.metrics()
    for key in ("reward/invalid", "grader/responses_per_s", "grader/timeouts", "grader/worker_restarts",
                "grader/responses"):
        assert isinstance(m[key], float)
    assert m["grader/responses_per_s"] > 0


def test_arithmetic_throughput(pool):
    rows, responses = arith_rows(20000)
    pool.grade_many(rows[:100], responses[:100])  # warm
    t0 = time.monotonic()
    pool.grade_many(rows, responses)
    rate = 20000 / (time.monotonic() - t0)
    assert rate > 2000, f"{rate:.0f} arithmetic responses/s through the pool"


def test_first_math_sample_after_a_restart_is_not_timed_out(pool):
    """A fresh worker imports Math-Verify (~1 s, more than this pool's 1 s limit) untimed."""
    pool.grade_many([{"id": "d", "domain": "die"}, {"id": "d2", "domain": "die"}], ["x", "x"])  # fresh workers
    rows = [{"id": f"m{i}", "domain": "math", "prompt": "?", "answer": "\\frac{1}{2}"} for i in range(4)]
    assert [g.reason for g in pool.grade_many(rows, ["\\boxed{0.5}"] * 4)] == ["correct"] * 4


def test_adversarial_math_that_hangs_sympy_is_killed(pool):
    """A real Math-Verify hang (SymPy evaluating a power tower), not a test verifier."""
    rows = [{"id": f"m{i}", "domain": "math", "prompt": "?", "answer": "2"} for i in range(3)]
    grades = pool.grade_many(rows, ["\\boxed{2}", "\\boxed{10^{10^{10}}}", "\\boxed{3}"])
    assert [(g.valid, g.reason) for g in grades] == [(True, "correct"), (False, "timeout"), (True, "wrong")]


def test_real_domains_through_the_pool(pool):
    rows = [
        {"id": "m", "domain": "math", "prompt": "?", "answer": "\\frac{1}{2}"},
        {"id": "c", "domain": "code", "prompt": "?", "tests": [{"input": "2\n", "output": "4\n"}]},
        {"id": "s", "domain": "stem", "prompt": "?", "answer": "B", "choices": ["1", "2"]},
    ]
    grades = pool.grade_many(rows, ["\\boxed{0.5}", "print(int(input()) * 2)", "\\boxed{B}"])
    assert [(g.reward, g.valid) for g in grades] == [(1.0, True)] * 3


def test_looping_program_is_wrong_not_a_pool_timeout():
    """The pool's limit is passed to the code verifier, which fits its sandbox inside it."""
    with GraderPool(num_workers=1, timeout_s=3.0) as p:
        row = {"id": "c", "domain": "code", "prompt": "?", "tests": [{"input": "", "output": "1\n"}]}
        g = p.grade_many([row], ["while True: pass"])[0]
        assert (g.valid, g.reward, g.reason) == (True, 0.0, "failed:timeout")
        assert p.metrics()["grader/timeouts"] == 0


def _sandbox_processes():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if UID_BASE <= uid < UID_BASE + UID_SLOTS or b"_sandbox_launcher.py" in cmd:
            found.append(pid)
    return found


def test_killing_a_worker_mid_sandbox_leaves_no_sandbox_processes():
    opts = {"code_time_limit_s": 30.0, "code_total_time_s": 30.0, "time_budget_s": 60.0}
    with GraderPool(num_workers=1, timeout_s=1.5, options=opts) as p:
        row = {"id": "c", "domain": "code", "prompt": "?", "tests": [{"input": "", "output": "1\n"}]}
        g = p.grade_many([row], ["import os\nos.fork()\nwhile True: pass"])[0]
        assert (g.valid, g.reason) == (False, "timeout")
        deadline = time.monotonic() + 5
        while _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandbox_processes() == []


def test_close_stops_workers_and_rejects_work():
    p = GraderPool(num_workers=2, timeout_s=5.0)
    pids = [w.proc.pid for w in p._workers]
    assert p.grade_many(*arith_rows(10))[1].reward == 1.0
    p.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    with pytest.raises(RuntimeError, match="closed"):
        p.grade_many(*arith_rows(1))
    p.close()  # idempotent


def test_argument_validation(pool):
    with pytest.raises(ValueError):
        GraderPool(num_workers=0)
    with pytest.raises(ModuleNotFoundError):
        GraderPool(extra_modules=["no_such_module_xyz"])
    with pytest.raises(ValueError, match="code_mode"):
        GraderPool(options={"code_mode": "most"})
    with pytest.raises(ValueError, match="2 rows but 1 responses"):
        pool.grade_many([{}, {}], ["x"])


def test_a_worker_that_died_while_idle_is_replaced():
    with GraderPool(num_workers=1, timeout_s=5.0) as p:
        p._workers[0].proc.kill()  # e.g. the OOM killer, between two batches
        p._workers[0].proc.wait()
        grades = p.grade_many(*arith_rows(30))
        assert [g.reward for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(30)]
        assert p.metrics()["grader/worker_restarts"] == 1
