"""How a run stops on a signal: SIGTERM (what ``ray job stop``, Kubernetes and SLURM send before
they kill) asks the loop to stop after what is in flight, with a checkpoint (:func:`stop_on_sigterm`);
the run then ends with :class:`Stopped`, which the CLI turns into exit status 143. Outside the loop
(start-up, the preflight, the step-0 and final evaluations) SIGTERM stops the run at once
(:func:`sigterm_stops_at_once`, :class:`Terminated`), its actors and Ray shut down, also status 143."""

from __future__ import annotations

import contextlib
import signal
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


def sigterm_stops_at_once():
    """SIGTERM raises :class:`Terminated` in the main thread (the default action would kill the
    driver without its ``finally`` blocks, leaving the Ray cluster it started). Inside the loop
    :func:`stop_on_sigterm` takes the signal over and gives it back when the loop ends."""

    def on_sigterm(signum, _frame):
        raise Terminated(signal.Signals(signum).name)

    return _on_sigterm(on_sigterm)


def stop_on_sigterm(s: LoopState):
    """SIGTERM (what ``ray job stop``, Kubernetes and SLURM send before they kill) stops the run
    cleanly: the loop starts nothing new, what is in flight lands, a checkpoint is written and
    :class:`Stopped` ends the run (exit status 143); ``--resume`` continues it exactly. A second
    SIGTERM stops at once, as SIGINT does: the newest checkpoint stays. The handler only sets a
    flag, which the loop reads at least once a second."""

    def on_sigterm(signum, _frame):
        if s.signalled:
            raise KeyboardInterrupt
        s.signalled = signal.Signals(signum).name

    return _on_sigterm(on_sigterm)
