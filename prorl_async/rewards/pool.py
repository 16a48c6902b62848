"""GraderPool: persistent grading worker processes with a hard, kill-based per-sample time limit.

Why (LESSONS.md): a reward function that hangs (SymPy / Math-Verify on adversarial input,
Math-Verify #65, verl PR #6673) must not stall the step, and a grader timeout or exception must
not be scored 0.0 (verl PrimeRewardManager). So:

* workers are separate processes that grade chunks of samples. The pool never forks itself (it
  lives inside a Ray actor that has threads): it starts one **fork server** with ``subprocess``
  (a fresh ``exec``), which imports :mod:`prorl_async.rewards` and ``extra_modules``, warms up
  the verifiers that need it, and has no threads; every worker is forked from it on request
  (its socket and shared block passed as file descriptors), in milliseconds and already warm.
  The pool holds a pidfd of each worker, so killing it cannot hit a reused pid. If the fork
  server dies, a worker is ``exec``-ed directly and a new fork server started
  (``grader/fork_server_restarts``);
* each worker publishes, in a small shared-memory block (a memfd both sides ``mmap``), the
  index and start time of the sample it is grading; the parent kills (SIGKILL) a worker whose
  current sample has run longer than ``timeout_s`` and grades that sample
  ``Grade(valid=False, reason="timeout")``. Killing is the only limit that works for code stuck
  in C or in a tight loop, and it works from any thread;
* an exception in a verifier gives ``valid=False, reason="error:<ExceptionType>"``, a NaN or
  infinite reward ``valid=False, reason="non_finite"``, a worker that dies (segfault,
  ``os._exit``) ``valid=False, reason="worker_died"`` for the sample it was on;
* samples travel in chunks (up to ``max_chunk`` per message) so that cheap verifiers
  (``arithmetic``) reach thousands of samples per second; a kill only invalidates the one
  sample that hung.

Fast recovery (issue 15: "a batch with many timeouts costs about one time limit, not one per
sample"). A hanging sample must not hold up the samples queued behind it, and a killed worker
must not be replaced while everyone waits:

* **stalled workers are moved aside**: a worker whose current sample has run longer than
  ``stall_s`` (default ``min(1, timeout_s / 10)``) while other work waits gives up the rest of
  its chunk (the parent lowers a ``stop_at`` index in the shared block; the worker reads it
  before each sample), the rest goes to the back of the queue, and the worker keeps running
  its slow sample outside the ``num_workers`` active slots until it finishes or is killed at
  ``timeout_s``. So hanging samples run their limit concurrently, up to ``max_stalled``
  (default ``max(8, num_workers)``) at a time;
* **spare workers**: ``spare_workers`` (default ``num_workers``) forked, ready processes wait
  to take a stalled or killed worker's slot at once, and are topped up by the fork server, so
  a batch never waits for an interpreter start or Math-Verify's import (~1 s, measured 0.3 s +
  0.9 s on the development machine under load) per kill. A worker moved aside exits when its
  slow sample ends;
* a worker pays Math-Verify's import and first-parse cost untimed on a fixed warm-up sample
  before its first math sample; once the pool has seen such a domain, the fork server and idle
  spares warm it up at once, so workers forked later start warm.

Trade-off: hanging samples that spin the CPU (SymPy) run side by side for one limit and share
the cores with the normal samples meanwhile; ``max_stalled`` bounds how many.

``max_stalled=0`` and ``spare_workers=0`` give the serial behaviour of before (a hanging sample
blocks the rest of its chunk; a killed worker's slot waits for a new process):
``benchmarks/bench_grading.py --hangs`` measures both in one run. A result that arrives twice (a worker that read ``stop_at``
a moment too late) is graded twice; the first result is kept.

Options given to the pool are passed to every :func:`prorl_async.rewards.grade` call; the pool
adds ``time_budget_s=timeout_s`` so that the code verifier fits its sandbox in the limit.

Health metrics (issue 13, "grader health in every step's metrics"), flat ``grader/*`` keys:
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
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recvfds, sendfds
from typing import Sequence

from prorl_async.rewards import grade, resolve_options, verifier_domain
from prorl_async.rewards.base import Grade, invalid

_PROGRESS = struct.Struct("dd")  # worker writes: (index in chunk, start time on CLOCK_MONOTONIC; 0 = idle)
_STOP_AT = struct.Struct("d")  # parent writes: the worker grades chunk indices < stop_at
_SHM_SIZE = _PROGRESS.size + _STOP_AT.size
STARTUP_TIMEOUT_S = 120.0

# counters reported per domain as grader/<name>/<domain>, keyed by the invalid reason
_HEALTH = {"timeout": "timeouts", "non_finite": "nonfinite", "worker_died": "worker_died"}
_TOTALS = ("responses", "timeouts", "errors", "nonfinite", "worker_died", "restarts", "stalls")


def safe_grade(row: dict, response: str, options: dict) -> Grade:
    """:func:`grade` with every failure turned into an invalid grade (what a worker runs)."""
    domain = row.get("domain") if isinstance(row, dict) else None
    if verifier_domain(domain) is None:
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


def _warm_up(domains, warm: set, options: dict) -> None:
    for domain in set(domains) - warm:
        safe_grade(*_WARM_UPS[domain], options)
        warm.add(domain)


def _serve(conn: Connection, shm: mmap.mmap, options: dict, warm: set) -> None:
    """A worker's loop: grade the chunks sent on ``conn`` until ``None`` arrives."""
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "warm":  # an idle spare learns of a domain the pool has started to see
            _warm_up(msg[1], warm, options)
            continue
        chunk_id, rows, responses = msg
        out = []
        for k, (row, response) in enumerate(zip(rows, responses)):
            if k >= _STOP_AT.unpack_from(shm, _PROGRESS.size)[0]:  # the parent took the rest back
                break
            domain = row.get("domain") if isinstance(row, dict) else None
            if domain in _WARM_UPS and domain not in warm:  # untimed: progress says idle
                _PROGRESS.pack_into(shm, 0, -1.0, 0.0)
                _warm_up([domain], warm, options)
            t0 = time.monotonic()
            _PROGRESS.pack_into(shm, 0, float(k), t0)
            g = safe_grade(row, response, options)
            out.append((g.reward, g.valid, g.reason, g.domain, t0, time.monotonic() - t0))
        _PROGRESS.pack_into(shm, 0, -1.0, 0.0)
        conn.send((chunk_id, out))


def _zygote_main(conn_fd: int) -> None:
    """The fork server: imports the verifiers and warms them up once, then forks one worker per
    ``("spawn", warm_domains)`` request (the worker's socket and shared block arrive as passed
    file descriptors) and answers with its pid. It has no threads, so forking it is safe."""
    sock = socket.socket(fileno=conn_fd)
    conn = Connection(os.dup(conn_fd))
    init = conn.recv()
    for name in init["extra_modules"]:
        importlib.import_module(name)
    options = init["options"]
    warm: set[str] = set()
    _warm_up(init["warm_domains"], warm, options)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        _warm_up(msg[1], warm, options)
        if msg[0] == "warm":
            continue
        worker_fd, shm_fd = recvfds(sock, 2)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the code sandbox waits for its children
                conn.close()
                sock.close()
                _serve(Connection(worker_fd), mmap.mmap(shm_fd, _SHM_SIZE), options, warm)
            except BaseException:  # noqa: BLE001 -- a worker's own end; the parent sees EOF
                code = 1
            finally:
                os._exit(code)
        os.close(worker_fd)
        os.close(shm_fd)
        conn.send(("spawned", pid))


# ---------------------------------------------------------------------------------------------
# parent side


@dataclass
class _Chunk:
    id: int
    call: int  # which grade_many call it belongs to; results of an earlier call are dropped
    idx: list = field(default_factory=list)  # sample indices in that call, in chunk order


def _exec_python(code: str, args: list[int]) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], pass_fds=tuple(args), env=env,
                            close_fds=True)


class _Zygote:
    """Parent side of the fork server (see :func:`_zygote_main`)."""

    def __init__(self, init: dict):
        parent_sock, child_sock = socket.socketpair()
        self.proc = _exec_python("import sys; from prorl_async.rewards.pool import _zygote_main; "
                                 "_zygote_main(int(sys.argv[1]))", [child_sock.fileno()])
        child_sock.close()
        self.sock = parent_sock
        self.conn = Connection(os.dup(parent_sock.fileno()))
        self.conn.send(init)
        self.ready = False

    def spawn(self, warm_domains: list[str], worker_fd: int, shm_fd: int) -> int:
        """Fork a worker serving ``worker_fd`` / ``shm_fd``; its pid. Raises OSError if the
        fork server is gone or does not answer."""
        try:
            self.conn.send(("spawn", warm_domains))
            sendfds(self.sock, [worker_fd, shm_fd])
            while True:
                if not self.conn.poll(STARTUP_TIMEOUT_S):
                    raise OSError("the grader fork server did not answer")
                msg = self.conn.recv()
                if msg[0] == "spawned":
                    return msg[1]
                self.ready = True  # its ("ready", pid)
        except EOFError as e:
            raise OSError("the grader fork server died (see its stderr)") from e

    def warm(self, domains: list[str]) -> None:
        try:
            self.conn.send(("warm", domains))
        except OSError:
            pass  # gone: found at the next spawn

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.sock.close()


class _Worker:
    """One grading process: forked by the fork server, or (``zygote=None``) exec-ed."""

    def __init__(self, init: dict, zygote: _Zygote | None):
        parent_sock, child_sock = _socketpair()
        self.shm_fd = os.memfd_create("grader-progress")
        os.ftruncate(self.shm_fd, _SHM_SIZE)
        self.shm = mmap.mmap(self.shm_fd, _SHM_SIZE)
        _PROGRESS.pack_into(self.shm, 0, -1.0, 0.0)
        self.proc: subprocess.Popen | None = None
        try:
            if zygote is None:
                raise OSError("no fork server")
            self.pid = zygote.spawn(init["warm_domains"], child_sock, self.shm_fd)
            self.pidfd = os.pidfd_open(self.pid)  # kill and wait without pid-reuse races
        except OSError:
            self.proc = _exec_python("import sys; from prorl_async.rewards.pool import _worker_main; "
                                     "_worker_main(int(sys.argv[1]), int(sys.argv[2]))", [child_sock, self.shm_fd])
            self.pid, self.pidfd = self.proc.pid, None
            self.forked = False
        else:
            self.forked = True
        os.close(child_sock)
        self.conn = Connection(parent_sock)
        if self.proc is not None:
            self.conn.send(init)
        self.ready = False
        self.started = time.monotonic()
        self.chunk: _Chunk | None = None

    def current(self) -> tuple[int, float]:
        k, t0 = _PROGRESS.unpack_from(self.shm, 0)
        return int(k), t0

    def give(self, chunk: _Chunk, rows: list, responses: list) -> None:
        _STOP_AT.pack_into(self.shm, _PROGRESS.size, float(len(chunk.idx)))
        self.conn.send((chunk.id, [rows[i] for i in chunk.idx], [responses[i] for i in chunk.idx]))
        self.chunk = chunk

    def stop_after(self, j: int) -> None:
        _STOP_AT.pack_into(self.shm, _PROGRESS.size, float(j + 1))

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return not select.select([self.pidfd], [], [], 0)[0]  # a pidfd turns readable at exit

    def poll_ready(self) -> bool:
        """Take a pending ``ready`` message without blocking; False if the worker died."""
        try:
            while not self.ready and self.conn.poll(0):
                msg = self.conn.recv()
                self.ready = msg[0] == "ready"
        except (EOFError, OSError):
            return False
        return self.alive()

    def signal(self, sig: int) -> None:
        try:
            if self.proc is not None:
                self.proc.send_signal(sig)
            else:
                signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the process has exited; False on timeout."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        return bool(select.select([self.pidfd], [], [], timeout)[0])

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()
        self.close_handles()

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it does not within 5 s."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        if not self.wait(timeout=5):
            self.signal(signal.SIGKILL)
            self.wait()
        self.close_handles()

    def close_handles(self) -> None:
        self.conn.close()
        self.shm.close()
        os.close(self.shm_fd)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _worker_main(conn_fd: int, progress_fd: int) -> None:
    """An exec-ed worker (used when the fork server is unavailable)."""
    conn = Connection(conn_fd)
    init = conn.recv()
    for name in init["extra_modules"]:
        importlib.import_module(name)
    warm: set[str] = set()
    _warm_up(init["warm_domains"], warm, init["options"])
    _serve(conn, mmap.mmap(progress_fd, _SHM_SIZE), init["options"], warm)


def _socketpair() -> tuple[int, int]:
    a, b = socket.socketpair()
    return a.detach(), b.detach()


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
        self._zygote = _Zygote(self._init())
        self._active = [self._start() for _ in range(num_workers)]  # grade queued chunks
        self._spares = [self._start() for _ in range(self.spare_workers)]  # take a slot at once
        self._stalled: list[_Worker] = []  # finishing one slow sample outside the active slots

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
            self._zygote.close()

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            for w in getattr(self, "_active", []) + getattr(self, "_spares", []) + getattr(self, "_stalled", []):
                w.signal(signal.SIGKILL)
            if hasattr(self, "_zygote"):
                self._zygote.proc.kill()

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

    def _start(self) -> _Worker:
        """A new worker, forked by the fork server (milliseconds); if that is gone, exec one and
        start a new fork server for the next."""
        w = _Worker(self._init(), self._zygote)
        if not w.forked:
            self._zygote.close()
            self._zygote = _Zygote(self._init())
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

    def _discard(self, w: _Worker) -> bool:
        """A spare that died while idle: reap it, count a restart. Returns False (filter it out)."""
        w.kill()
        self._bump("grader/restarts")
        return False

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` (timed out or died) and take it out of the pool; its slot is refilled."""
        w.kill()
        self._bump("grader/restarts")
        for group in (self._active, self._stalled):
            if w in group:
                group.remove(w)
        self._fill_slots()

    def _release(self, w: _Worker) -> None:
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
        new_domains = {r.get("domain") for r in rows if isinstance(r, dict)} & set(_WARM_UPS) - self._warm_domains
        if new_domains:  # workers started from now on warm these up first; idle spares now
            self._warm_domains |= new_domains
            self._zygote.warm(sorted(new_domains))
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

        def fail_current(w: _Worker, reason: str) -> None:
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
                    w.give(_Chunk(self._next_chunk, call, idx), rows, responses)
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

    def _move_aside(self, w: _Worker, j: int, queue: collections.deque) -> None:
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

    def _poll_interval(self, busy: list[_Worker]) -> float:
        now = time.monotonic()
        interval = 0.05
        for w in busy:
            _, t0 = w.current()
            if t0 > 0:
                interval = min(interval, t0 + self.timeout_s - now)
                if w in self._active and t0 + self.stall_s > now:  # not yet due to be moved aside
                    interval = min(interval, t0 + self.stall_s - now)
        return max(interval, 0.001)
