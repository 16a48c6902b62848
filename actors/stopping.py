"""How a run stops on a signal: SIGTERM (what ``ray job stop``, Kubernetes and SLURM send before
they kill) asks the loop to stop after what is in flight, with a checkpoint (:func:`stop_on_sigterm`);
the run then ends with :class:`Stopped`, which the CLI turns into exit status 143. Outside the loop
(start-up, the preflight, the step-0 and final evaluations) SIGTERM stops the run at once
(:func:`sigterm_stops_at_once`, :class:`Terminated`), its actors and Ray shut down, also status 143.

The at-once handler raises where the main thread happens to be, and that can be inside Ray's C
code, which runs Python's signal handlers from within its waits and hands their exception on
only as a ``SystemError`` left pending, so code between there and the driver can lose it (a CI
run SIGTERMed while its actors started went on to train both steps and exit 0). The signal is
therefore also recorded, and :func:`raise_if_terminated` raises it again where the driver next
waits on its actors (:func:`actors.cluster.get`, :func:`actors.evaluation.gather`), before the
training loop's first step and when the run returns."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from actors.loop_state import LoopState


class Stopped(Exception):
    """The run stopped on a signal after writing a checkpoint; ``--resume`` continues it."""

    def __init__(self, signal_name: str, step: int, run_dir):
        super().__init__(f"stopped by {signal_name} at step {step}, with a checkpoint; continue with "
                         f"`prorl-async train --resume {run_dir}`")
        self.signal_name, self.step, self.run_dir = signal_name, step, run_dir


class Terminated(BaseException):
    """SIGTERM outside the training loop: before step 1 (model, Ray and actors starting, the
    preflight, the step-0 evaluation) nothing is in flight that a checkpoint could keep, and after
    the last step the end checkpoint is already written, so the run stops at once. A
    ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the way swallows it,
    and every ``finally`` (actors, Ray, the Aim run) runs."""

    def __init__(self, signal_name: str):
        super().__init__(f"stopped by {signal_name} outside the training loop (before step 1, or after the last "
                         "step's checkpoint): nothing was lost that a checkpoint would keep; a run stopped before "
                         "step 1 starts again from the beginning")
        self.signal_name = signal_name


@contextlib.contextmanager
def _on_sigterm(handler):
    """``handler`` for SIGTERM inside the block, the previous one back after it; nothing outside the
    main thread, where Python cannot install signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_received: list[str] = []  # the SIGTERM the at-once handler took, until the run ends


def sigterm_stops_at_once():
    """SIGTERM raises :class:`Terminated` in the main thread (the default action would kill the
    driver without its ``finally`` blocks, leaving the Ray cluster it started), and is recorded
    for :func:`raise_if_terminated`. Inside the loop :func:`stop_on_sigterm` takes the signal over
    and gives it back when the loop ends."""

    def on_sigterm(signum, _frame):
        name = signal.Signals(signum).name
        _received[:] = [name]
        raise Terminated(name)

    _received.clear()
    return _on_sigterm(on_sigterm)


def raise_if_terminated() -> None:
    """:class:`Terminated` if the at-once handler took a SIGTERM since it was installed: called
    where the driver next waits, so a signal whose exception was lost on its way out of Ray's C
    code still stops the run there, with the same line and status. Not while an exception is
    being handled: the ``finally`` blocks that shut the actors and Ray down run to their end."""
    if _received and sys.exc_info()[0] is None and threading.current_thread() is threading.main_thread():
        raise Terminated(_received[0])


def stop_on_sigterm(s: LoopState):
    """SIGTERM (what ``ray job stop``, Kubernetes and SLURM send before they kill) stops the run
    cleanly: the loop starts nothing new, what is in flight lands, a checkpoint is written and
    :class:`Stopped` ends the run (exit status 143); ``--resume`` continues it exactly. A second
    SIGTERM stops at once, as SIGINT does: the newest checkpoint stays. The handler only sets a
    flag, which the loop reads at least once a second. A SIGTERM the at-once handler took
    before (:func:`raise_if_terminated`) stops the run here, before the loop's first step."""
    raise_if_terminated()

    def on_sigterm(signum, _frame):
        if s.signalled:
            raise KeyboardInterrupt
        s.signalled = signal.Signals(signum).name

    return _on_sigterm(on_sigterm)
