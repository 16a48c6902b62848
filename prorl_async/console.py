"""What a run's console shows (issue 27): the project's own lines, never an engine's.

Quiet by default. Every actor process sends its fd 1 and 2 -- Python, C/C++ and OpenMP output
alike: vLLM, DeepSpeed, torch, transformers, safetensors bars -- to ``<run_dir>/logs/<role>.log``,
from a Ray worker setup hook (:func:`actor_output_to_file`) that runs before the actor's class is
imported; Ray's own streaming of worker output to the driver (``log_to_driver``) is off. Warnings
the project raises inside an actor (its ``prorl_async`` / ``actors`` loggers, WARNING and up) are
held in that process and drained by the driver (:class:`ActorWarnings`), printed as
``warning: [role] message``; errors come back as the exceptions of the calls that failed. In the
driver, Python warnings raised outside the project go to ``<run_dir>/logs/driver.log``
(:func:`quiet_driver`). ``--verbose`` (``$PRORL_ASYNC_VERBOSE=1``) keeps all of it on the console
as Ray streams it, prefixed ``(GeneratorActor pid=...)``.

Progress bars (:func:`bar`) redraw in place with a carriage return on a terminal; anywhere else
(a pipe, a file) each is a plain line at most every ``PLAIN_EVERY_S`` seconds, plus its last.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Callable

from prorl_async.machine import with_env_vars

LOG_DIR_ENV = "PRORL_ASYNC_LOG_DIR"  # set in the job's runtime env: where actors' output goes
ROLE_ENV = "PRORL_ASYNC_ROLE"  # set per actor: its file name (generator-0, learner, grader, buffer)
VERBOSE_ENV = "PRORL_ASYNC_VERBOSE"  # "1": engines' and Ray's lines on the console, as before issue 27
PROJECT_LOGGERS = ("prorl_async", "actors")
PROJECT_DIRS = tuple(str(Path(__file__).resolve().parents[1] / d) + os.sep for d in ("prorl_async", "actors"))
PLAIN_EVERY_S = 10.0
OWN_HANDLER_LOGGERS = ("DeepSpeed",)  # e.g. "Setting accelerator to CPU" when the driver imports DeepSpeed


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def with_role(opts: dict, role: str) -> dict:
    """Ray actor options ``opts`` plus the actor's role in its runtime env: with a quiet console
    its output goes to ``<run_dir>/logs/<role>.log``."""
    return with_env_vars(opts, {ROLE_ENV: role})


# ------------------------------------------------------------------ inside an actor process
class HeldWarnings(logging.Handler):
    """The project's warnings in an actor process, kept until the driver drains them."""

    def __init__(self, role: str, maxlen: int = 200):
        super().__init__(logging.WARNING)
        self.role, self.lines = role, deque(maxlen=maxlen)

    def emit(self, record: logging.LogRecord) -> None:  # called under the handler's lock
        self.lines.append(f"{record.levelname.lower()}: [{self.role}] {record.getMessage()}")

    def drain(self) -> list[str]:
        with self.lock:
            out = list(self.lines)
            self.lines.clear()
        return out


HELD: HeldWarnings | None = None


def actor_output_to_file() -> None:
    """Ray worker setup hook: an actor with a role sends fd 1 and 2 to ``$PRORL_ASYNC_LOG_DIR/<role>.log``
    (appended: a restarted generator continues its file) and holds the project's warnings for the
    driver. Workers without a role (none of the run's actors) keep Ray's own log files."""
    global HELD
    log_dir, role = os.environ.get(LOG_DIR_ENV), os.environ.get(ROLE_ENV)
    if not log_dir or not role:
        return
    path = Path(log_dir) / f"{role}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"--- {role}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}", file=sys.stderr, flush=True)
    HELD = HeldWarnings(role)
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(HELD)
        logger.addHandler(logging.StreamHandler(sys.stderr))  # and in the file, as before


def drain_held(_actor=None) -> list[str]:
    """Run in an actor by ``__ray_call__``: its held warnings since the last drain."""
    return HELD.drain() if HELD is not None else []


class ActorWarnings:
    """Drains actors' held warnings without waiting on a busy actor: a drain is asked of each
    actor that has none outstanding, and its answer is read at a later poll."""

    def __init__(self):
        self.asked: dict[int, object] = {}  # actor's position in the list -> ObjectRef

    def poll(self, actors: list, wait_s: float = 0.0) -> list[str]:
        """Lines drained so far; ``wait_s``: how long to wait for the answers (at the end of a run)."""
        import ray

        for i, a in enumerate(actors):
            if i not in self.asked and a is not None:
                self.asked[i] = a.__ray_call__.remote(drain_held)
        refs = list(self.asked.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0]) if refs else set()
        lines = []
        for i, ref in list(self.asked.items()):
            if ref in ready:
                del self.asked[i]
                try:
                    lines += ray.get(ref)
                except ray.exceptions.RayError:  # a dead or restarting actor: the loop reports its death
                    pass
        return lines


# ------------------------------------------------------------------ the driver process
def is_project_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(PROJECT_DIRS)


def quiet_driver(log_dir: Path) -> Callable[[], None]:
    """The driver's console keeps the project's warnings (``warning: message``); Python warnings
    from other packages, and their loggers' records, go to ``log_dir/driver.log``. Returns the
    undo (a run called in-process leaves its caller's warnings and logging as they were)."""
    if verbose():
        return lambda: None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "driver.log"
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def show(message, category, filename, lineno, file=None, line=None):
        if is_project_file(filename):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            to_file.stream.write(warnings.formatwarning(message, category, filename, lineno, line))
            to_file.flush()

    before = warnings.showwarning
    warnings.showwarning = show
    root, diverted = logging.getLogger(), _ToFile(to_file)
    root.addHandler(to_file)
    for name in OWN_HANDLER_LOGGERS:  # loggers that print through their own handler, set up on import
        logging.getLogger(name).addFilter(diverted)
    if "transformers" in sys.modules:  # its default handler prints to stderr: through the root's instead
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    added = []
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(ProjectFormat())
            logger.addHandler(h)
            added.append((logger, h, logger.propagate))
            logger.propagate = False  # not also in driver.log through the root's handler

    def restore() -> None:
        warnings.showwarning = before
        root.removeHandler(to_file)
        to_file.close()
        for name in OWN_HANDLER_LOGGERS:
            logging.getLogger(name).removeFilter(diverted)
        for logger, h, propagate in added:
            logger.removeHandler(h)
            logger.propagate = propagate

    return restore


class _ToFile(logging.Filter):
    """On a logger with its own console handler: the record goes to ``handler`` (the log file) instead."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        self.handler.handle(record)
        return False


class ProjectFormat(logging.Formatter):
    """``warning: message``, the form of every project warning on the console."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


# ------------------------------------------------------------------ progress bars
_last_plain = [float("-inf")]


def bar(label: str, done: int, total: int, width: int = 30, final: bool = False, out=None,
        now: float | None = None) -> None:
    """A progress bar for long phases (the built-in model's warm-up, evaluation): redrawn with
    ``\\r`` on a terminal; elsewhere a plain line at most every ``PLAIN_EVERY_S`` s, and the last."""
    out = out if out is not None else sys.stdout
    last = final or done >= total
    if out.isatty():
        frac = done / max(total, 1)
        out.write(f"\r[{'#' * int(frac * width):<{width}}] {done}/{total}  {label}   " + ("\n" if last else ""))
        out.flush()
        return
    now = time.monotonic() if now is None else now
    if last or now - _last_plain[0] >= PLAIN_EVERY_S:
        _last_plain[0] = float("-inf") if last else now
        out.write(f"{done}/{total}  {label}\n")
        out.flush()
