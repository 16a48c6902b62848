"""GraderPool: persistent grading worker processes with a hard, kill-based per-sample time limit.

A reward function that hangs (SymPy / Math-Verify on adversarial input, Math-Verify #65, verl
PR #6673) must not stall the step, and a grader timeout or exception must not be scored 0.0
(verl PrimeRewardManager). The processes and their protocol are in
:mod:`prorl_async.rewards.workers`; this module schedules samples onto them and counts what
happened:

* the pool kills (SIGKILL) a worker whose current sample has run longer than ``timeout_s`` and
  grades that sample ``Grade(valid=False, reason="timeout")``. Killing is the only limit that
  works for code stuck in C or in a tight loop, and it works from any thread;
* an exception in a verifier gives ``valid=False, reason="error:<ExceptionType>"``, a NaN or
  infinite reward ``valid=False, reason="non_finite"``, a worker that dies (segfault,
  ``os._exit``) ``valid=False, reason="worker_died"`` for the sample it was on;
* samples travel in chunks (up to ``max_chunk`` per message) so that cheap verifiers
  (``arithmetic``) reach thousands of samples per second; a kill only invalidates the one
  sample that hung.

A batch with many hanging samples costs about one time limit, not one per sample:

* **stalled workers are moved aside**: a worker whose current sample has run longer than
  ``stall_s`` (default ``min(1, timeout_s / 10)``) while other work waits gives up the rest of
  its chunk, the rest goes to the back of the queue, and the worker keeps running its slow
  sample outside the ``num_workers`` active slots until it finishes or is killed at
  ``timeout_s``. So hanging samples run their limit concurrently, up to ``max_stalled``
  (default ``max(8, num_workers)``) at a time; they share the cores with the normal samples
  meanwhile, and ``max_stalled`` bounds how many;
* **spare workers**: ``spare_workers`` (default ``num_workers``) forked, ready processes wait
  to take a stalled or killed worker's slot at once, and are topped up by the fork server, so
  a batch never waits for an interpreter start or Math-Verify's import per kill. A worker moved
  aside exits when its slow sample ends;
* once the pool has seen a domain with a warm-up sample, the fork server and idle spares warm
  it up at once, so workers forked later start warm. If the fork server dies, a worker is
  ``exec``-ed directly and a new fork server started (``grader/fork_server_restarts``).

``max_stalled=0`` and ``spare_workers=0`` give serial recovery (a hanging sample blocks the rest
of its chunk; a killed worker's slot waits for a new process): ``benchmarks/bench_grading.py
--hangs`` measures both. A result that arrives twice (a worker that read ``stop_at`` a moment
too late) is graded twice; the first result is kept.

Options given to the pool are passed to every :func:`prorl_async.rewards.grade` call; the pool
adds ``time_budget_s=timeout_s`` so that the code verifier fits its sandbox in the limit.

Health metrics, flat ``grader/*`` keys:
``grader/responses``, ``grader/timeouts``, ``grader/errors`` (verifier exceptions),
``grader/nonfinite``, ``grader/worker_died`` (each also per domain as ``grader/<name>/<domain>``),
``grader/restarts`` (worker processes killed or died and replaced), ``grader/stalls`` (samples
moved aside), ``grader/queue_wait_s`` / ``grader/queue_wait_max_s`` (mean / max time a sample
waited from :meth:`GraderPool.grade_many` until a worker started it), ``grader/grade_s`` /
``grader/grade_max_s`` (time a worker spent on a sample), ``grader/responses_per_s``, plus the
``reward/invalid``, ``reward/invalid/<reason>``, ``reward/invalid/<domain>`` counts.
:meth:`GraderPool.metrics` gives totals since the pool started; :meth:`GraderPool.metrics_since_last`
the counts since its previous call (one training step), with the totals as ``<key>_total``.
"""

from __future__ import annotations

import collections
import importlib
import math
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Sequence

from prorl_async.rewards import resolve_options
from prorl_async.rewards.base import Grade, invalid
from prorl_async.rewards.workers import STARTUP_TIMEOUT_S, Chunk, ForkServer, Worker, warm_up_key

# counters reported per domain as grader/<name>/<domain>, keyed by the invalid reason
_HEALTH = {"timeout": "timeouts", "non_finite": "nonfinite", "worker_died": "worker_died"}
_TOTALS = ("responses", "timeouts", "errors", "nonfinite", "worker_died", "restarts", "stalls")


class GraderPool:
    """A pool of grading processes; see the module docstring."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0,
                 extra_modules: Sequence[str] = (), options: dict | None = None,
                 max_chunk: int = 256, spare_workers: int | None = None,
                 max_stalled: int | None = None, stall_s: float | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for name, v in (("spare_workers", spare_workers), ("max_stalled", max_stalled)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if stall_s is not None and not 0 < stall_s <= timeout_s:
            raise ValueError(f"stall_s must be in (0, timeout_s={timeout_s}], got {stall_s}")
        for name in extra_modules:  # registers custom verifiers here too; fails fast on a typo
            importlib.import_module(name)
        options = dict(options or {})
        options.setdefault("time_budget_s", timeout_s)
        self.options = resolve_options(options)
        self.num_workers, self.timeout_s, self.max_chunk = num_workers, float(timeout_s), max_chunk
        self.spare_workers = num_workers if spare_workers is None else spare_workers
        self.max_stalled = max(8, num_workers) if max_stalled is None else max_stalled
        self.stall_s = min(1.0, self.timeout_s / 10) if stall_s is None else float(stall_s)
        self._extra_modules = list(extra_modules)
        self._warm_domains: set[str] = set()
        self._lock = threading.Lock()  # one grade_many at a time
        self._mlock = threading.Lock()  # metrics may be read from another thread meanwhile
        self._counters: collections.Counter[str] = collections.Counter()
        self._sums: collections.Counter[str] = collections.Counter()  # queue wait / grade time sums
        self._maxes: dict[str, float] = {}
        self._since: tuple[collections.Counter, collections.Counter, dict] = (
            collections.Counter(), collections.Counter(), {})
        self._last_rate = 0.0
        self.last_grade_times_s: list[float] = []  # per sample of the latest call: time in a worker
        self.last_queue_wait_s: list[float] = []  # and time from the call until a worker started it
        self._closed = False
        self._call = 0
        self._next_chunk = 0
        self._fork_server = ForkServer(self._init())
        self._active = [self._start() for _ in range(num_workers)]  # grade queued chunks
        self._spares = [self._start() for _ in range(self.spare_workers)]  # take a slot at once
        self._stalled: list[Worker] = []  # finishing one slow sample outside the active slots

    # -- public API ----------------------------------------------------------------------------

    def grade_many(self, rows: list[dict], responses: list[str]) -> list[Grade]:
        """Grade ``responses[i]`` against ``rows[i]``; the result is in the same order."""
        if len(rows) != len(responses):
            raise ValueError(f"{len(rows)} rows but {len(responses)} responses")
        with self._lock:
            if self._closed:
                raise RuntimeError("GraderPool is closed")
            t0 = time.monotonic()
            grades, times, waits = self._run(rows, responses)
            wall = time.monotonic() - t0
        self._last_rate = len(rows) / wall if wall > 0 else 0.0
        self.last_grade_times_s, self.last_queue_wait_s = times, waits
        self._count(grades, times, waits)
        return grades

    def metrics(self) -> dict[str, float]:
        """Totals since the pool started (``grader/responses_per_s``: the latest call)."""
        with self._mlock:
            return self._render(self._counters, self._sums, self._maxes)

    def metrics_since_last(self) -> dict[str, float]:
        """Counts since the previous call (one training step), plus ``<key>_total`` totals."""
        with self._mlock:
            c0, s0, _ = self._since
            counters = self._counters - c0
            sums = self._sums - s0
            m = self._render(counters, sums, self._since[2])
            for name in _TOTALS:
                m[f"grader/{name}_total"] = float(self._counters[f"grader/{name}"])
            self._since = (self._counters.copy(), self._sums.copy(), {})
        return m

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._stalled:  # busy with a slow sample: nothing left to wait for
                w.kill()
            for w in self._active + self._spares:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            for w in self._active + self._spares:
                w.stop()
            self._fork_server.close()

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            for w in getattr(self, "_active", []) + getattr(self, "_spares", []) + getattr(self, "_stalled", []):
                w.signal(signal.SIGKILL)
            if hasattr(self, "_fork_server"):
                self._fork_server.proc.kill()

    # -- metrics -------------------------------------------------------------------------------

    def _count(self, grades: list[Grade], times: list[float], waits: list[float]) -> None:
        with self._mlock:
            c = self._counters
            c["grader/responses"] += len(grades)
            for g in grades:
                if g.valid:
                    continue
                c["reward/invalid"] += 1
                c[f"reward/invalid/{g.reason}"] += 1
                c[f"reward/invalid/{g.domain}"] += 1
                name = "errors" if g.reason.startswith("error:") else _HEALTH.get(g.reason)
                if name:
                    c[f"grader/{name}"] += 1
                    c[f"grader/{name}/{g.domain}"] += 1
            self._sums["queue_wait"] += sum(waits)
            self._sums["grade"] += sum(times)
            for key, values in (("queue_wait", waits), ("grade", times)):
                if values:
                    for maxes in (self._maxes, self._since[2]):
                        maxes[key] = max(maxes.get(key, 0.0), max(values))

    def _bump(self, key: str) -> None:
        with self._mlock:
            self._counters[key] += 1

    def _render(self, counters, sums, maxes) -> dict[str, float]:
        m = {k: float(v) for k, v in counters.items()}
        for key in ("reward/invalid", *(f"grader/{name}" for name in _TOTALS)):
            m.setdefault(key, 0.0)
        n = max(m["grader/responses"], 1.0)
        m["grader/queue_wait_s"] = sums["queue_wait"] / n
        m["grader/queue_wait_max_s"] = maxes.get("queue_wait", 0.0)
        m["grader/grade_s"] = sums["grade"] / n
        m["grader/grade_max_s"] = maxes.get("grade", 0.0)
        m["grader/responses_per_s"] = self._last_rate
        return m

    # -- workers -------------------------------------------------------------------------------

    def _init(self) -> dict:
        return {"extra_modules": self._extra_modules, "options": self.options,
                "warm_domains": sorted(self._warm_domains)}

    def _start(self) -> Worker:
        """A new worker, forked by the fork server (milliseconds); if that is gone, exec one and
        start a new fork server for the next."""
        w = Worker(self._init(), self._fork_server)
        if not w.forked:
            self._fork_server.close()
            self._fork_server = ForkServer(self._init())
            self._bump("grader/fork_server_restarts")
        return w

    def _fill_slots(self) -> None:
        """Keep ``num_workers`` active workers (a ready spare first, else a new process) and top
        up the spares."""
        while len(self._active) < self.num_workers:
            self._spares = [w for w in self._spares if w.poll_ready() or self._discard(w)]
            ready = [w for w in self._spares if w.ready]
            w = (ready or self._spares or [None])[0]
            if w is None:
                w = self._start()
            else:
                self._spares.remove(w)
            self._active.append(w)
        while len(self._spares) < self.spare_workers:
            self._spares.append(self._start())

    def _discard(self, w: Worker) -> bool:
        """A spare that died while idle: reap it, count a restart. Returns False (filter it out)."""
        w.kill()
        self._bump("grader/restarts")
        return False

    def _replace(self, w: Worker) -> None:
        """Kill ``w`` (timed out or died) and take it out of the pool; its slot is refilled."""
        w.kill()
        self._bump("grader/restarts")
        for group in (self._active, self._stalled):
            if w in group:
                group.remove(w)
        self._fill_slots()

    def _release(self, w: Worker) -> None:
        """A stalled worker finished its slow sample: it exits; the fork server makes a new one in
        milliseconds when one is needed."""
        self._stalled.remove(w)
        w.stop()
        self._fill_slots()

    # -- grading -------------------------------------------------------------------------------

    def _run(self, rows: list[dict], responses: list[str]) -> tuple[list[Grade], list[float], list[float]]:
        n = len(rows)
        self._call += 1
        call, t_enqueue = self._call, time.monotonic()
        grades: list[Grade | None] = [None] * n
        times, waits = [0.0] * n, [0.0] * n
        new_domains = {warm_up_key(r.get("domain")) for r in rows if isinstance(r, dict)} - {None} - self._warm_domains
        if new_domains:  # workers started from now on warm these up first; idle spares now
            self._warm_domains |= new_domains
            self._fork_server.warm(sorted(new_domains))
            for w in self._spares:
                try:
                    w.conn.send(("warm", sorted(new_domains)))
                except OSError:
                    pass  # died while idle: found and replaced when it is promoted
        size = max(1, min(self.max_chunk, math.ceil(n / (self.num_workers * 4))))
        queue = collections.deque(list(range(s, min(s + size, n))) for s in range(0, n, size))
        remaining = n

        def settle(i: int, g: Grade, dt: float, wait_s: float) -> None:
            nonlocal remaining
            if grades[i] is None:
                grades[i], times[i], waits[i] = g, dt, wait_s
                remaining -= 1

        def fail_current(w: Worker, reason: str) -> None:
            """Invalidate the sample ``w`` is on, re-queue the rest of its chunk, replace ``w``."""
            j, t0 = w.current()
            chunk = w.chunk
            if chunk is not None and chunk.call == call:
                idx = chunk.idx
                if 0 <= j < len(idx):
                    i = idx[j]
                    domain = rows[i].get("domain") if isinstance(rows[i], dict) else None
                    now = time.monotonic()
                    settle(i, invalid(str(domain), reason), now - t0 if t0 > 0 else 0.0,
                           max(0.0, t0 - t_enqueue) if t0 > 0 else 0.0)
                    rest = idx[:j] + idx[j + 1:]
                else:  # died between samples: nothing to blame, re-run everything
                    rest = idx
                if rest:
                    queue.appendleft(rest)
            w.chunk = None
            self._replace(w)

        while remaining:
            for w in list(self._active):  # hand out work
                if w.chunk is not None:
                    continue
                while queue:
                    idx = [i for i in queue.popleft() if grades[i] is None]
                    if idx:
                        break
                else:
                    break
                self._next_chunk += 1
                try:
                    w.give(Chunk(self._next_chunk, call, idx), rows, responses)
                except OSError:  # died while idle (e.g. the OOM killer): replace, retry the chunk
                    queue.appendleft(idx)
                    w.chunk = None
                    self._replace(w)
            busy = [w for w in self._active + self._stalled if w.chunk is not None]
            if not busy:
                if queue:  # a replacement slot is waiting for work: loop to hand it out
                    continue
                raise RuntimeError(f"grader pool lost track of {remaining} samples")  # a bug, not a fault
            for conn in wait([w.conn for w in busy], timeout=self._poll_interval(busy)):
                w = next(w for w in busy if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if not w.ready:
                        raise RuntimeError("a grader worker died while starting (see its stderr)")
                    fail_current(w, "worker_died")
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    continue
                chunk_id, out = msg
                if w.chunk is not None and w.chunk.id == chunk_id and w.chunk.call == call:
                    for i, (reward, valid, reason, domain, t0, dt) in zip(w.chunk.idx, out):
                        settle(i, Grade(reward, valid, reason, domain), dt, max(0.0, t0 - t_enqueue))
                w.chunk = None
                if w in self._stalled:
                    self._release(w)
            now = time.monotonic()
            for w in self._active + self._stalled:  # enforce the per-sample limit
                if w.chunk is None:
                    continue
                j, t0 = w.current()
                if t0 > 0 and now - t0 > self.timeout_s:
                    fail_current(w, "timeout")
                elif not w.ready and now - w.started > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"grader worker did not start within {STARTUP_TIMEOUT_S} s")
                elif (t0 > 0 and now - t0 > self.stall_s and w in self._active
                      and len(self._stalled) < self.max_stalled and w.chunk.call == call):
                    self._move_aside(w, j, queue)
        return grades, times, waits  # type: ignore[return-value]

    def _move_aside(self, w: Worker, j: int, queue: collections.deque) -> None:
        """``w`` has been on sample ``j`` of its chunk past ``stall_s``: if other work waits for
        it, take back the rest of its chunk and let a spare take its active slot. The rest goes
        to the back of the queue in ``num_workers`` pieces: the chunks not started yet come
        first, so that the hanging samples among them start (and run their limits side by
        side) as early as possible."""
        idx = w.chunk.idx
        if not 0 <= j < len(idx):
            return
        rest = idx[j + 1:]
        if not rest and not queue:
            return  # nothing waits behind it
        w.stop_after(j)
        w.chunk.idx = idx[:j + 1]
        k = max(1, math.ceil(len(rest) / self.num_workers))
        queue.extend(rest[s:s + k] for s in range(0, len(rest), k))
        self._active.remove(w)
        self._stalled.append(w)
        self._bump("grader/stalls")
        self._fill_slots()

    def _poll_interval(self, busy: list[Worker]) -> float:
        now = time.monotonic()
        interval = 0.05
        for w in busy:
            _, t0 = w.current()
            if t0 > 0:
                interval = min(interval, t0 + self.timeout_s - now)
                if w in self._active and t0 + self.stall_s > now:  # not yet due to be moved aside
                    interval = min(interval, t0 + self.stall_s - now)
        return max(interval, 0.001)
