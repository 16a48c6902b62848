"""GraderPool: persistent grading worker processes with a hard, kill-based per-sample time limit.

Why (LESSONS.md): a reward function that hangs (SymPy / Math-Verify on adversarial input,
Math-Verify #65, verl PR #6673) must not stall the step, and a grader timeout or exception must
not be scored 0.0 (verl PrimeRewardManager). So:

* workers are separate interpreter processes started with ``subprocess`` (a fresh ``exec``,
  never ``fork``: the pool lives inside a Ray actor that has threads), importing
  :mod:`prorl_async.rewards` and ``extra_modules`` once, then grading chunks of samples;
* each worker publishes, in a small shared-memory block (a memfd both sides ``mmap``), the
  index and start time of the sample it is grading; the parent kills (SIGKILL) a worker whose
  current sample has run longer than ``timeout_s``, grades that sample
  ``Grade(valid=False, reason="timeout")``, re-queues the rest of its chunk and starts a new
  worker. Killing is the only limit that works for code stuck in C or in a tight loop, and it
  works from any thread;
* an exception in a verifier gives ``valid=False, reason="error:<ExceptionType>"``, a NaN or
  infinite reward ``valid=False, reason="non_finite"``, a worker that dies (segfault,
  ``os._exit``) ``valid=False, reason="worker_died"`` for the sample it was on;
* a worker pays Math-Verify's import and first-parse cost (~1 s) on a fixed warm-up sample,
  untimed, before its first math sample, so that sample is not timed out for it;
* samples travel in chunks (up to ``max_chunk`` per message) so that cheap verifiers
  (``arithmetic``) reach thousands of samples per second; a kill only invalidates the one
  sample that hung.

Options given to the pool are passed to every :func:`prorl_async.rewards.grade` call; the pool
adds ``time_budget_s=timeout_s`` so that the code verifier fits its sandbox in the limit.
Counters in :meth:`GraderPool.metrics` are cumulative since the pool started, except
``grader/responses_per_s``, which is for the latest :meth:`GraderPool.grade_many` call.
"""

from __future__ import annotations

import collections
import importlib
import math
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Sequence

from prorl_async.rewards import VERIFIERS, grade, resolve_options
from prorl_async.rewards.base import Grade, invalid

_PROGRESS = struct.Struct("dd")  # (index in chunk, start time on CLOCK_MONOTONIC; 0 = idle)
STARTUP_TIMEOUT_S = 120.0


def safe_grade(row: dict, response: str, options: dict) -> Grade:
    """:func:`grade` with every failure turned into an invalid grade (what a worker runs)."""
    domain = row.get("domain") if isinstance(row, dict) else None
    if domain not in VERIFIERS:
        return invalid(str(domain), "unknown_domain")
    try:
        return grade(row, response, **options)
    except Exception as e:  # noqa: BLE001 -- fault tolerance is the point; counted in metrics
        return invalid(domain, f"error:{type(e).__name__}")


# ---------------------------------------------------------------------------------------------
# worker side


_WARM_UPS = {  # domain -> a sample whose first grading pays one-off costs (imports, parser set-up)
    "math": ({"id": "warm-up", "domain": "math", "answer": "\\frac{1}{2}"}, "\\boxed{0.5}"),
}


def _worker_main(conn_fd: int, progress_fd: int) -> None:
    conn = Connection(conn_fd)
    progress = mmap.mmap(progress_fd, _PROGRESS.size)
    init = conn.recv()
    for name in init["extra_modules"]:
        importlib.import_module(name)
    options = init["options"]
    warm: set[str] = set()
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        chunk_id, rows, responses = msg
        out = []
        for k, (row, response) in enumerate(zip(rows, responses)):
            domain = row.get("domain") if isinstance(row, dict) else None
            if domain in _WARM_UPS and domain not in warm:  # untimed: progress says idle
                _PROGRESS.pack_into(progress, 0, -1.0, 0.0)
                safe_grade(*_WARM_UPS[domain], options)
                warm.add(domain)
            t0 = time.monotonic()
            _PROGRESS.pack_into(progress, 0, float(k), t0)
            g = safe_grade(row, response, options)
            out.append((g.reward, g.valid, g.reason, g.domain, time.monotonic() - t0))
        _PROGRESS.pack_into(progress, 0, -1.0, 0.0)
        conn.send((chunk_id, out))


# ---------------------------------------------------------------------------------------------
# parent side


class _Worker:
    def __init__(self, init: dict):
        parent_sock, child_sock = _socketpair()
        self.progress_fd = os.memfd_create("grader-progress")
        os.ftruncate(self.progress_fd, _PROGRESS.size)
        self.progress = mmap.mmap(self.progress_fd, _PROGRESS.size)
        _PROGRESS.pack_into(self.progress, 0, -1.0, 0.0)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        code = ("import sys; from prorl_async.rewards.pool import _worker_main; "
                "_worker_main(int(sys.argv[1]), int(sys.argv[2]))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(child_sock), str(self.progress_fd)],
            pass_fds=(child_sock, self.progress_fd), env=env, close_fds=True,
        )
        os.close(child_sock)
        self.conn = Connection(parent_sock)
        self.conn.send(init)
        self.ready = False
        self.started = time.monotonic()
        self.chunk: tuple[int, list[int]] | None = None  # (chunk id, sample indices)

    def current(self) -> tuple[int, float]:
        k, t0 = _PROGRESS.unpack_from(self.progress, 0)
        return int(k), t0

    def kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.close_handles()

    def close_handles(self) -> None:
        self.conn.close()
        self.progress.close()
        os.close(self.progress_fd)


def _socketpair() -> tuple[int, int]:
    import socket

    a, b = socket.socketpair()
    return a.detach(), b.detach()


class GraderPool:
    """A pool of grading processes; see the module docstring."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0,
                 extra_modules: Sequence[str] = (), options: dict | None = None,
                 max_chunk: int = 256):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for name in extra_modules:  # registers custom verifiers here too; fails fast on a typo
            importlib.import_module(name)
        options = dict(options or {})
        options.setdefault("time_budget_s", timeout_s)
        self.options = resolve_options(options)
        self.num_workers, self.timeout_s, self.max_chunk = num_workers, float(timeout_s), max_chunk
        self._init = {"extra_modules": list(extra_modules), "options": self.options}
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._last_rate = 0.0
        self.last_grade_times_s: list[float] = []
        self._closed = False
        self._workers = [_Worker(self._init) for _ in range(num_workers)]

    # -- public API ----------------------------------------------------------------------------

    def grade_many(self, rows: list[dict], responses: list[str]) -> list[Grade]:
        """Grade ``responses[i]`` against ``rows[i]``; the result is in the same order."""
        if len(rows) != len(responses):
            raise ValueError(f"{len(rows)} rows but {len(responses)} responses")
        with self._lock:
            if self._closed:
                raise RuntimeError("GraderPool is closed")
            t0 = time.monotonic()
            grades, times = self._run(rows, responses)
            wall = time.monotonic() - t0
        self._last_rate = len(rows) / wall if wall > 0 else 0.0
        self.last_grade_times_s = times
        self._count(grades)
        return grades

    def metrics(self) -> dict[str, float]:
        m = {k: float(v) for k, v in self._counters.items()}
        for key in ("reward/invalid", "grader/responses", "grader/timeouts",
                    "grader/worker_restarts", "grader/errors"):
            m.setdefault(key, 0.0)
        m["grader/responses_per_s"] = self._last_rate
        return m

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            for w in self._workers:
                try:
                    w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
                w.close_handles()

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            for w in self._workers:
                w.proc.kill()

    # -- internals -----------------------------------------------------------------------------

    def _count(self, grades: list[Grade]) -> None:
        c = self._counters
        c["grader/responses"] += len(grades)
        for g in grades:
            if not g.valid:
                c["reward/invalid"] += 1
                c[f"reward/invalid/{g.reason}"] += 1
                c[f"reward/invalid/{g.domain}"] += 1
                if g.reason == "timeout":
                    c["grader/timeouts"] += 1
                elif g.reason.startswith("error:") or g.reason == "worker_died":
                    c["grader/errors"] += 1

    def _respawn(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._init)
        self._counters["grader/worker_restarts"] += 1

    def _run(self, rows: list[dict], responses: list[str]) -> tuple[list[Grade], list[float]]:
        n = len(rows)
        grades: list[Grade | None] = [None] * n
        times = [0.0] * n
        size = max(1, min(self.max_chunk, math.ceil(n / (self.num_workers * 4))))
        queue = collections.deque(list(range(s, min(s + size, n))) for s in range(0, n, size))
        next_id = 0
        remaining = n
        while remaining:
            for k, w in enumerate(self._workers):  # hand out work
                if w.chunk is None and queue:
                    idx = queue.popleft()
                    try:
                        w.conn.send((next_id, [rows[i] for i in idx], [responses[i] for i in idx]))
                    except OSError:  # died while idle (e.g. the OOM killer): replace, retry the chunk
                        queue.appendleft(idx)
                        self._respawn(k)
                        continue
                    w.chunk = (next_id, idx)
                    next_id += 1
            busy = [w for w in self._workers if w.chunk is not None]
            ready = wait([w.conn for w in busy], timeout=self._poll_interval(busy))
            for conn in ready:
                k = next(i for i, w in enumerate(self._workers) if w.conn is conn)
                w = self._workers[k]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if not w.ready:
                        raise RuntimeError("a grader worker died while starting (see its stderr)")
                    remaining -= self._fail_current(k, "worker_died", rows, grades, times, queue)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    continue
                chunk_id, out = msg
                _, idx = w.chunk
                for i, (reward, valid, reason, domain, dt) in zip(idx, out):
                    grades[i] = Grade(reward, valid, reason, domain)
                    times[i] = dt
                remaining -= len(idx)
                w.chunk = None
            now = time.monotonic()
            for k, w in enumerate(self._workers):  # enforce the per-sample limit
                if w.chunk is None:
                    continue
                j, t0 = w.current()
                if t0 > 0 and now - t0 > self.timeout_s:
                    remaining -= self._fail_current(k, "timeout", rows, grades, times, queue)
                elif not w.ready and now - w.started > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"grader worker did not start within {STARTUP_TIMEOUT_S} s")
        return grades, times  # type: ignore[return-value]

    def _fail_current(self, k: int, reason: str, rows: list[dict], grades: list, times: list,
                      queue: collections.deque) -> int:
        """Invalidate the sample worker k is on, re-queue the rest of its chunk, replace it."""
        w = self._workers[k]
        j, t0 = w.current()
        _, idx = w.chunk
        failed = 0
        if 0 <= j < len(idx):
            i = idx[j]
            domain = rows[i].get("domain") if isinstance(rows[i], dict) else None
            grades[i] = invalid(str(domain), reason)
            if t0 > 0:
                times[i] = time.monotonic() - t0
            rest = idx[:j] + idx[j + 1:]
            failed = 1
        else:  # died between samples: nothing to blame, re-run everything
            rest = idx
        if rest:
            queue.appendleft(rest)
        w.chunk = None
        self._respawn(k)
        return failed

    def _poll_interval(self, busy: list[_Worker]) -> float:
        now = time.monotonic()
        interval = 0.05
        for w in busy:
            _, t0 = w.current()
            if t0 > 0:
                interval = min(interval, t0 + self.timeout_s - now)
        return max(interval, 0.001)
