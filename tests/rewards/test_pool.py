"""GraderPool through real worker processes: hangs, crashes, NaN, dying workers, fast recovery
from many hangs at once, and the ``grader/*`` health metrics (per step and in total).

Rates and wall times are measured in ``benchmarks/bench_grading.py``, not asserted here."""

import os
import signal
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
        assert after["grader/restarts"] == before["grader/restarts"] + 1
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
    for key in ("reward/invalid", "grader/responses_per_s", "grader/timeouts", "grader/restarts",
                "grader/responses", "grader/errors", "grader/nonfinite", "grader/stalls",
                "grader/queue_wait_s", "grader/queue_wait_max_s", "grader/grade_s"):
        assert isinstance(m[key], float)
    assert m["grader/responses_per_s"] > 0


def test_large_arithmetic_batch_is_graded_correctly(pool):
    """Correctness at the size the throughput benchmark uses (the rate is measured there)."""
    rows, responses = arith_rows(20000)
    grades = pool.grade_many(rows, responses)
    assert [g.reward for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(20000)]
    assert all(g.valid for g in grades)


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
    pids = [w.pid for w in p._active + p._spares] + [p._fork_server.proc.pid]
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
        p._active[0].signal(signal.SIGKILL)  # e.g. the OOM killer, between two batches
        assert p._active[0].wait(timeout=10)
        grades = p.grade_many(*arith_rows(30))
        assert [g.reward for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(30)]
        assert p.metrics()["grader/restarts"] == 1


def _hang_batch(n_hang, n_echo):
    rows = [echo(i) for i in range(n_echo)]
    hang_at = [k * (n_echo // n_hang) for k in range(n_hang)]
    for k, at in enumerate(hang_at):
        rows.insert(at + k, {"id": f"h{k}", "domain": "hang"})
    return rows, [i for i, r in enumerate(rows) if r["domain"] == "hang"]


@pytest.mark.parametrize("fast", [True, False], ids=["fast-recovery", "old-serial"])
def test_many_hangs_in_one_batch_run_their_limits_side_by_side(fast):
    """4 hanging samples: with fast recovery all are running before the first is killed (the
    batch costs about one limit); with it switched off (max_stalled=0, spare_workers=0) the
    last one waits for the three before it. Asserted on the pool's own per-sample start times."""
    timeout = 3.0 if fast else 1.0
    kw = {"stall_s": 0.1} if fast else {"max_stalled": 0, "spare_workers": 0}
    with GraderPool(num_workers=1, timeout_s=timeout, extra_modules=HOSTILE, **kw) as p:
        rows, hangs = _hang_batch(4, 40)
        responses = ["x" if i % 2 == 0 else "y" for i in range(len(rows))]
        grades = p.grade_many(rows, responses)
        assert [grades[i].reason for i in hangs] == ["timeout"] * 4
        others = [i for i in range(len(rows)) if i not in hangs]
        assert [grades[i].reward for i in others] == [1.0 if i % 2 == 0 else 0.0 for i in others]
        assert all(grades[i].valid for i in others)
        m = p.metrics()
        assert m["grader/timeouts"] == 4 and m["grader/restarts"] == 4
        started = [p.last_queue_wait_s[i] for i in hangs]
        if fast:
            assert max(started) < timeout, started  # every hang started before the first was killed
            assert m["grader/stalls"] >= 4
        else:
            assert max(started) >= 3 * timeout, started
            assert m["grader/stalls"] == 0
        # the pool keeps working, with one active worker again
        assert p.grade_many([echo(0)], ["x"])[0].reward == 1.0
        assert len(p._active) == 1 and not p._stalled


def test_health_metrics_per_step_through_the_fault_verifiers():
    """tests/fault_verifiers.py: one crash, one NaN, one hang per batch, counted per domain,
    per call of metrics_since_last, and in total."""
    from prorl_async.data import arithmetic

    from tests.fault_verifiers import fault_of

    pool_rows = arithmetic.generate(400, seed=5, split="train")
    picked = {}
    for r in pool_rows:
        picked.setdefault(fault_of(r), []).append({**r, "domain": "flaky"})
    bad = [picked["error"][0], picked["non_finite"][0], picked["timeout"][0]]
    good = picked["ok"][:20]
    with GraderPool(num_workers=2, timeout_s=1.0, extra_modules=["tests.fault_verifiers"]) as p:
        rows = good[:10] + bad + good[10:]
        responses = [r["answer"] for r in rows]
        grades = p.grade_many(rows, responses)
        assert [g.reason for g in grades[10:13]] == ["error:RuntimeError", "non_finite", "timeout"]
        assert all(g.valid and g.reward == 1.0 and g.domain == "flaky" for g in grades[:10] + grades[13:])
        step1 = p.metrics_since_last()
        for key in ("grader/timeouts", "grader/timeouts/flaky", "grader/errors", "grader/errors/flaky",
                    "grader/nonfinite", "grader/nonfinite/flaky", "grader/restarts"):
            assert step1[key] == 1.0, (key, step1)
        assert step1["grader/responses"] == 23 and step1["reward/invalid"] == 3
        assert step1["grader/worker_died"] == 0
        assert 0 <= step1["grader/queue_wait_s"] <= step1["grader/queue_wait_max_s"]
        assert step1["grader/grade_max_s"] >= 1.0  # the hang ran to the limit

        # a clean step: per-step counts go back to zero, totals stay
        grades = p.grade_many(good, [r["answer"] for r in good])
        assert all(g.valid and g.reward == 1.0 for g in grades)
        step2 = p.metrics_since_last()
        assert step2["grader/responses"] == 20 and step2["grader/timeouts"] == 0
        assert step2["grader/errors"] == 0 and step2["grader/nonfinite"] == 0 and step2["grader/restarts"] == 0
        assert "grader/timeouts/flaky" not in step2
        assert step2["grader/grade_max_s"] < 1.0  # the maximum is per step too
        assert step2["grader/timeouts_total"] == 1 and step2["grader/responses_total"] == 43
        total = p.metrics()
        assert total["grader/timeouts"] == 1 and total["grader/timeouts/flaky"] == 1
        assert total["grader/responses"] == 43


def test_metrics_can_be_read_while_a_batch_is_grading():
    """The actor reads metrics from another thread while grade_many waits on a hang."""
    with GraderPool(num_workers=1, timeout_s=2.0, extra_modules=HOSTILE) as p:
        out = []
        t = threading.Thread(target=lambda: out.extend(p.grade_many([{"id": "h", "domain": "hang"}], ["x"])))
        t.start()
        time.sleep(0.3)
        assert t.is_alive()  # still grading
        m = p.metrics_since_last()  # does not wait for the batch
        assert m["grader/responses"] == 0
        t.join(30)
        assert [g.reason for g in out] == ["timeout"]
        assert p.metrics_since_last()["grader/timeouts"] == 1
