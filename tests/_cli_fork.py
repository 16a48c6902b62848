"""The real ``prorl-async`` entry point in a process forked from one that has already imported it.

A CLI run through a fresh ``python`` spends ~9 s of its ~25 (alone on a 2-core machine; twice that
beside a second pytest worker) importing torch, transformers, Ray and Aim before it does anything.
Here a ``multiprocessing`` fork server (a clean process started once per pytest worker, which
imports the driver's modules and nothing else: no Ray cluster, no model) forks one child per call,
and the child runs ``actors.cli.main`` with the call's argv, working directory and environment, its
stdout and stderr to files, and ``atexit`` handlers run at the end as an interpreter's are. The
child is a process of its own: it starts its own Ray cluster (or joins ``ray.address``), its own
actors, and its exit status is ``main``'s.

What differs from a fresh interpreter: modules the fork server imported are not re-imported (what
they print at import time is not in the child's output; settings they read from the environment at
import time keep the fork server's values). Tests of those things (the console's line count, the
default run as a user starts it) pass ``fresh=True`` to ``tests.conftest.cli`` for a new interpreter;
the runs whose output a test reads line by line as it comes (tests/test_curriculum_cli.py,
test_node_death.py, test_soak.py) start ``prorl-async`` themselves. A signal reaches a forked child as
it reaches a subprocess (:func:`start`, in a session of its own if asked).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# what the train / eval paths import before their first line of work (driver, engines' tokenizer, Aim)
PRELOAD = ["actors.cli", "actors.driver", "actors.offline_eval", "prorl_async.models", "transformers",
           "transformers.models.llama.modeling_llama", "aim", "tests._cli_fork"]

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(argv: list[str], cwd: str, env: dict, out: str, err: str, new_session: bool = False) -> None:
    if new_session:  # a process group of its own (os.killpg); the Ray cluster it starts has sessions of its
        # own (actors.cluster.ray_processes_in_own_sessions) and dies with it
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    f = os.open(out, os.O_WRONLY | os.O_APPEND)  # the caller made both files, empty
    os.dup2(f, 1)
    if err != out:
        os.close(f)
        f = os.open(err, os.O_WRONLY | os.O_APPEND)
    os.dup2(f, 2)
    os.close(f)
    sys.argv = [str(Path(sys.executable).with_name("prorl-async")), *argv]  # Ray reads the script's folder
    from ray._raylet import Config as _RayConfig

    _RayConfig.initialize("")  # Ray read its auth settings from the fork server's environment at import
    try:
        from actors.cli import main

        code = main(argv)
    except SystemExit as e:  # argparse's usage errors, as the console script reports them
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        atexit._run_exitfuncs()  # what an interpreter's exit runs (Ray's shutdown, when it is still up)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Launched:
    """The part of ``subprocess.Popen``'s interface the tests use, for a forked CLI."""

    def __init__(self, process):
        self._p = process
        self.pid = process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and self._p.exitcode is not None:
            self.returncode = self._p.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._p.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["prorl-async"], timeout)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._p.kill()
        self._p.join(30)


def start(argv: list[str], cwd: str, env: dict, log: str, err: str = "", new_session: bool = False) -> Launched:
    """``subprocess.Popen([prorl-async, *argv], stdout=log, stderr=err or STDOUT, start_new_session=...)``'s
    equivalent, forked: the run goes on while the caller watches its log and signals it."""
    err = err or log
    for path in {log, err}:
        open(path, "wb").close()  # there, empty, when this returns (as Popen's caller opened it)
    p = _context().Process(target=_child, args=(list(argv), str(cwd), dict(env), str(log), str(err), new_session))
    p.start()
    return Launched(p)


def run(argv: list[str], cwd: str, env: dict, timeout: float, raw: bool) -> subprocess.CompletedProcess:
    """``subprocess.run([prorl-async, *argv], capture_output=True, timeout=...)``'s result, from a forked child."""
    with tempfile.TemporaryDirectory(prefix="prorl-cli-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = start(argv, cwd, env, out, err)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise subprocess.TimeoutExpired(["prorl-async", *argv], timeout, _read(out, raw), _read(err, raw)) from None
        return subprocess.CompletedProcess(["prorl-async", *argv], code, _read(out, raw), _read(err, raw))


def _read(path: str, raw: bool):
    with open(path, "rb") as f:
        data = f.read()
    return data if raw else data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
