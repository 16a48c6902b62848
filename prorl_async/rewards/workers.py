"""Grading worker processes and the shared-memory protocol between them and the pool.

:class:`~prorl_async.rewards.pool.GraderPool` schedules samples onto these processes; this module
is what runs in them and the parent-side handles it keeps.

* The pool never forks itself (it lives inside a Ray actor that has threads). It starts one
  **fork server** with ``subprocess`` (a fresh ``exec``), which imports
  :mod:`prorl_async.rewards` and ``extra_modules``, warms up the verifiers that need it, and has
  no threads; every worker is forked from it on request (its socket and shared block passed as
  file descriptors), in milliseconds and already warm. The parent holds a pidfd of each forked
  worker, so killing it cannot hit a reused pid. If the fork server is gone, a worker is
  ``exec``-ed directly (:func:`_worker_main`).
* A worker grades chunks of samples sent on its socket (``(chunk_id, rows, responses)``, answered
  with ``(chunk_id, results)``) until ``None`` arrives, and turns every verifier failure into an
  invalid grade (:func:`safe_grade`).
* **Shared block** (a memfd both sides ``mmap``): the worker writes ``(index in chunk, start time
  on CLOCK_MONOTONIC)`` before each sample (``(-1, 0)`` when idle or warming up), so the parent can
  kill a worker whose sample has run past the limit, from any thread; the parent writes
  ``stop_at``, and the worker grades only chunk indices below it, so the parent can take back the
  rest of a chunk.
* A worker pays one-off costs (Math-Verify's import and first parse, Reasoning Gym's import)
  untimed on a fixed warm-up sample (:data:`WARM_UPS`) before its first sample of such a domain
  or family (:func:`warm_up_key`); a ``("warm", keys)``
  message tells an idle worker or the fork server to warm up ahead of time.
"""

from __future__ import annotations

import importlib
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds

from prorl_async.rewards import grade, verifier_domain
from prorl_async.rewards.base import Grade, invalid

_PROGRESS = struct.Struct("dd")  # worker writes: (index in chunk, start time on CLOCK_MONOTONIC; 0 = idle)
_STOP_AT = struct.Struct("d")  # parent writes: the worker grades chunk indices < stop_at
_SHM_SIZE = _PROGRESS.size + _STOP_AT.size
STARTUP_TIMEOUT_S = 120.0


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


WARM_UPS = {  # a domain, or a family ("rg:" for rg:TASK@LEVEL) -> a sample whose first grading pays
    # one-off costs (imports, parser set-up): Math-Verify's ~1 s, Reasoning Gym's 2-3 s (more on a busy CPU)
    "math": ({"id": "warm-up", "domain": "math", "answer": "\\frac{1}{2}"}, "\\boxed{0.5}"),
    "rg:": ({"id": "warm-up", "domain": "rg:chain_sum", "answer": "5",
             "meta": {"task": "chain_sum", "entry": {"question": "2 + 3 =", "answer": "5", "metadata": {}}}},
            "<answer>5</answer>"),
}


def warm_up_key(domain) -> str | None:
    """The :data:`WARM_UPS` entry a sample of ``domain`` needs first: its own, its family's, or none."""
    if not isinstance(domain, str):
        return None
    if domain in WARM_UPS:
        return domain
    family = domain.split(":", 1)[0] + ":"
    return family if ":" in domain and family in WARM_UPS else None


def _warm_up(domains, warm: set, options: dict) -> None:
    for domain in set(domains) - warm:
        safe_grade(*WARM_UPS[domain], options)
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
            key = warm_up_key(row.get("domain") if isinstance(row, dict) else None)
            if key is not None and key not in warm:  # untimed: progress says idle
                _PROGRESS.pack_into(shm, 0, -1.0, 0.0)
                _warm_up([key], warm, options)
            t0 = time.monotonic()
            _PROGRESS.pack_into(shm, 0, float(k), t0)
            g = safe_grade(row, response, options)
            out.append((g.reward, g.valid, g.reason, g.domain, t0, time.monotonic() - t0))
        _PROGRESS.pack_into(shm, 0, -1.0, 0.0)
        conn.send((chunk_id, out))


def _fork_server_main(conn_fd: int) -> None:
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
class Chunk:
    id: int
    call: int  # which grade_many call it belongs to; results of an earlier call are dropped
    idx: list = field(default_factory=list)  # sample indices in that call, in chunk order


def _exec_python(code: str, args: list[int]) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], pass_fds=tuple(args), env=env,
                            close_fds=True)


class ForkServer:
    """Parent side of the fork server (see :func:`_fork_server_main`)."""

    def __init__(self, init: dict):
        parent_sock, child_sock = socket.socketpair()
        self.proc = _exec_python("import sys; from prorl_async.rewards.workers import _fork_server_main; "
                                 "_fork_server_main(int(sys.argv[1]))", [child_sock.fileno()])
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


class Worker:
    """One grading process: forked by the fork server, or (``fork_server=None``) exec-ed."""

    def __init__(self, init: dict, fork_server: ForkServer | None):
        parent_sock, child_sock = _socketpair()
        self.shm_fd = os.memfd_create("grader-progress")
        os.ftruncate(self.shm_fd, _SHM_SIZE)
        self.shm = mmap.mmap(self.shm_fd, _SHM_SIZE)
        _PROGRESS.pack_into(self.shm, 0, -1.0, 0.0)
        self.proc: subprocess.Popen | None = None
        try:
            if fork_server is None:
                raise OSError("no fork server")
            self.pid = fork_server.spawn(init["warm_domains"], child_sock, self.shm_fd)
            self.pidfd = os.pidfd_open(self.pid)  # kill and wait without pid-reuse races
        except OSError:
            self.proc = _exec_python("import sys; from prorl_async.rewards.workers import _worker_main; "
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
        self.chunk: Chunk | None = None

    def current(self) -> tuple[int, float]:
        k, t0 = _PROGRESS.unpack_from(self.shm, 0)
        return int(k), t0

    def give(self, chunk: Chunk, rows: list, responses: list) -> None:
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
