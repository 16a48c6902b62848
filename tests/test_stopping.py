"""SIGTERM outside the training loop (actors/stopping.py): the signal stops the run even when the
exception its handler raised is lost before it reaches the driver. A CI run SIGTERMed while its
actors started trained both steps and exited 0 (tests/test_checkpoint.py::
test_sigterm_before_step_one_stops_at_once_and_shuts_its_ray_down, 2026-12-03): Ray's C code runs
Python's signal handlers from inside its waits and passes their exception on only as a pending
``SystemError``. Here a real SIGTERM is taken inside ``__del__``, where Python itself reports the
handler's exception as unraisable and drops it, as a C caller may."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from actors.loop_state import LoopState
from actors.stopping import Terminated, raise_if_terminated, sigterm_stops_at_once, stop_on_sigterm


class _SignalledInDel:
    """Sends this process a SIGTERM from ``__del__``: the handler runs there, and its exception
    goes to ``sys.unraisablehook`` instead of the caller."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the main thread's next bytecodes run the pending handler
            pass


@pytest.fixture
def lost_sigterm(monkeypatch):
    """A SIGTERM taken under the at-once handler whose exception was dropped; what the unraisable hook saw."""
    dropped: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    return dropped


def test_a_sigterm_whose_exception_was_lost_stops_the_run_at_the_next_wait(lost_sigterm):
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_stops_at_once():
        _SignalledInDel()  # dropped at once: its __del__ runs here
        assert lost_sigterm == [Terminated]  # the handler ran and its exception went nowhere
        with pytest.raises(Terminated, match="stopped by SIGTERM outside the training loop"):
            raise_if_terminated()  # what actors.cluster.get and actors.evaluation.gather call after a wait
        with pytest.raises(Terminated):  # nor does the loop start
            stop_on_sigterm(LoopState())
    assert signal.getsignal(signal.SIGTERM) is before  # the handler this process had is back


def test_cleanup_runs_to_its_end_and_a_new_run_starts_clean(lost_sigterm):
    """While an exception is handled (the ``finally`` blocks that shut actors and Ray down) the
    recorded signal is not raised again; the next ``sigterm_stops_at_once`` starts with none."""
    with sigterm_stops_at_once():
        _SignalledInDel()
        assert lost_sigterm == [Terminated]
        cleaned = False
        with pytest.raises(ValueError):
            try:
                raise ValueError("the run's own stop")
            finally:
                raise_if_terminated()  # a wait inside the cleanup
                cleaned = True
        assert cleaned
    with sigterm_stops_at_once():
        raise_if_terminated()  # nothing taken since this one was installed
        with stop_on_sigterm(LoopState()):
            pass

