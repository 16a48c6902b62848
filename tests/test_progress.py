"""The console's answers to "how long" and "why no step": ETA arithmetic, refill rounds."""

from __future__ import annotations

import time

import pytest

from prorl_async.buffer import PutResult
from prorl_async.refill import RefillWatch
from prorl_async.tracking import duration, eta_s, progress_line


def test_eta_is_mean_pace_times_steps_left():
    assert eta_s(4, 10, 40.0) == pytest.approx(60.0)  # 10 s a step, 6 steps left
    assert eta_s(10, 10, 95.0) == 0.0
    assert eta_s(0, 10, 5.0) is None  # no step yet: no pace to extrapolate
    assert eta_s(12, 20, 30.0, start_step=10) == pytest.approx(120.0)  # resumed at 10: 15 s a step, 8 left


def test_duration_formats():
    assert [duration(x) for x in (None, 7.4, 65, 3600 + 125)] == ["-", "7s", "1m05s", "1h02m"]


def test_progress_line_shows_elapsed_and_time_left():
    line = progress_line(2, 4, {"reward/mean": 0.5}, time.time() - 20.0)
    assert "step    2/4" in line and "reward 0.500" in line
    assert "[20s elapsed, ~20s left]" in line


def test_progress_line_of_a_step_trained_only_on_buffered_groups_shows_the_batch_reward():
    m = {"reward/raw_mean": 0.57, "perf/train_tok_s": 300.0}  # nothing generated this step
    line = progress_line(3, 4, m, time.time() - 30.0)
    assert "reward - (none generated; trained batch 0.570)" in line and "acc -" in line
    assert "(none generated" not in progress_line(3, 4, {**m, "reward/mean": 0.4}, time.time() - 30.0)
    # samples were generated but none could be graded: said as such
    assert "reward - (none graded; trained batch 0.570)" in progress_line(3, 4, {**m, "reward/invalid": 8.0},
                                                                           time.time() - 30.0)


def _put(kept=0, all_wrong=0, all_correct=0, invalid=0) -> PutResult:
    dropped_by = {"all_wrong": all_wrong, "all_correct": all_correct, "invalid": invalid}
    return PutResult(kept=kept, dropped=sum(dropped_by.values()), dropped_by=dropped_by, invalid_samples=0,
                     invalid_reasons={}, size=kept, stats={}, pools={})


def test_refill_round_is_a_batch_of_dropped_groups_and_stops_at_the_limit():
    said = []
    w = RefillWatch(prompts_per_step=8, max_rounds=3, now=0.0, say=said.append)
    assert w.observe(_put(kept=4, all_wrong=4), 0, 1.0) is None and w.rounds == 0 and not said
    assert w.observe(_put(all_wrong=4), 0, 2.0) is None and w.rounds == 1  # 8 dropped: one round
    assert len(said) == 1 and "refill round 1/3" in said[0] and "4 groups kept, 8 dropped (8 all wrong" in said[0]
    assert w.observe(_put(all_wrong=8), 0, 3.0) is None and w.rounds == 2
    assert len(said) == 1  # at most one line per report_every_s
    err = w.observe(_put(all_wrong=8), 0, 30.0)
    assert w.rounds == 3 and "algo.max_refill_rounds=3" in err
    assert "never correct" in err and "algo.dynamic_sampling=false" in err and "rollout.temperature" in err
    assert len(said) == 2  # 27 s after the first line: a second one
    assert w.observe(_put(all_wrong=8), 0, 31.0) is None  # given once; the stop's checkpoint drains the rest


def test_step_restarts_the_count_and_zero_means_unlimited():
    w = RefillWatch(prompts_per_step=2, max_rounds=2, say=lambda _: None)
    w.observe(_put(all_correct=2), 0, 1.0)
    w.step_done(2.0)
    assert w.rounds == 0 and w.observe(_put(all_correct=2), 1, 3.0) is None
    assert "always correct" in (err := w.observe(_put(all_correct=2), 1, 4.0)) and "harder task" in err
    unlimited = RefillWatch(prompts_per_step=1, max_rounds=0, say=lambda _: None)
    assert unlimited.observe(_put(all_wrong=1000), 0, 1.0) is None and unlimited.rounds == 1000
