"""Tests for prorl_async.algo.reference: when ProRL resets the reference policy."""

from __future__ import annotations

import pytest

from prorl_async.algo import ReferenceResetPolicy


def test_interval_counts_from_the_last_reset():
    p = ReferenceResetPolicy(interval=3)
    got = [p.update(step) for step in range(1, 10)]
    assert got == [None, None, "interval", None, None, "interval", None, None, "interval"]
    assert p.metrics()["ref/resets_interval"] == 3


def test_kl_spike_needs_a_full_window_and_compares_to_its_mean():
    p = ReferenceResetPolicy(kl_spike_factor=2.0, kl_window=3)
    assert p.update(1, kl=1.0) is None
    assert p.update(2, kl=100.0) is None  # only one previous value: no judgement yet
    assert p.update(3, kl=1.0) is None
    # previous window [1, 100, 1]: mean 34 -> 60 is no spike
    assert p.update(4, kl=60.0) is None
    # previous window [100, 1, 60]: mean 53.67 -> 107.4 > 2 * 53.67 = 107.33 is a spike
    assert p.update(5, kl=107.4) == "kl_spike"
    # history restarted: a big value right after the reset is not judged
    assert p.update(6, kl=500.0) is None
    assert p.update(7, kl=1.0) is None
    assert p.update(8, kl=1.0) is None
    assert p.update(9, kl=2.0) is None  # window [500, 1, 1]: mean 167
    assert p.metrics()["ref/resets_kl_spike"] == 1


def test_kl_spike_ignores_a_zero_window():
    p = ReferenceResetPolicy(kl_spike_factor=2.0, kl_window=2)
    p.update(1, kl=0.0)
    p.update(2, kl=0.0)
    assert p.update(3, kl=1e-9) is None


def test_val_stall_after_patience_evaluations_without_new_best():
    p = ReferenceResetPolicy(val_patience=2)
    assert p.update(10, val_score=0.5) is None  # first best
    assert p.update(20, val_score=0.6) is None  # new best
    assert p.update(25) is None  # no evaluation this step: nothing counts
    assert p.update(30, val_score=0.6) is None  # equal is not better: 1
    assert p.update(40, val_score=0.55) == "val_stall"  # 2
    # after the reset the best restarts, so a low score is a fresh best
    assert p.update(50, val_score=0.1) is None
    assert p.update(60, val_score=0.1) is None
    assert p.update(70, val_score=0.05) == "val_stall"
    assert p.metrics()["ref/resets_val_stall"] == 2


def test_kl_max_resets_a_steady_climb_that_the_factor_test_never_calls_a_spike():
    # the shape of the KL between resets (the balanced config's tenth attempt, steps 151-200): it
    # grows by about a tenth a step from 0.01, so each value is ~1.7x the mean of the 10 before it
    climb = [(step, 0.01 * 1.1 ** step) for step in range(1, 60)]
    factor = ReferenceResetPolicy(kl_spike_factor=3.0, kl_window=10)
    assert [factor.update(s, kl=kl) for s, kl in climb] == [None] * len(climb)
    both = ReferenceResetPolicy(kl_spike_factor=3.0, kl_window=10, kl_max=0.5)
    fired = {s: c for s, kl in climb if (c := both.update(s, kl=kl))}
    first = next(s for s, kl in climb if kl > 0.5)  # step 42: 0.549
    # the same cause as the factor test; the level is judged every step, the history restarting
    # at each reset does not hold it back
    assert fired == {s: "kl_spike" for s, _ in climb[first - 1:]}
    assert both.metrics()["ref/resets_kl_spike"] == len(climb) - first + 1
    at = ReferenceResetPolicy(kl_max=0.5)
    assert at.update(1, kl=0.5) is None and at.update(2, kl=0.5000001) == "kl_spike"  # above, not at


def test_kl_max_comes_from_the_config_and_an_older_checkpoint_resumes_without_it():
    from prorl_async.config import load_config
    from prorl_async.learners.core import algo_state

    _, policy = algo_state(load_config(None, ["algo.ref_kl_max=0.5"]).algo)
    assert policy.kl_max == 0.5 and policy.update(1, kl=0.6) == "kl_spike"
    assert algo_state(load_config(None, []).algo)[1].kl_max == 0.0  # off by default
    old = ReferenceResetPolicy(kl_spike_factor=3.0, kl_window=2).state_dict()
    del old["kl_max"]  # what a checkpoint written before kl_max holds
    resumed = ReferenceResetPolicy(kl_max=0.5)
    resumed.load_state_dict(old)
    assert resumed.kl_max == 0.0 and resumed.update(1, kl=9.0) is None  # as that run was trained


def test_disabled_triggers_never_fire():
    off = ReferenceResetPolicy(interval=0, kl_spike_factor=-1, kl_window=3, val_patience=None, kl_max=-1)
    for p in (ReferenceResetPolicy(), off):
        for step in range(1, 50):
            assert p.update(step, kl=float(step**3), val_score=-float(step)) is None


def test_simultaneous_triggers_report_one_cause_in_priority_order_and_reset_everything():
    p = ReferenceResetPolicy(interval=4, kl_spike_factor=1.5, kl_window=1, val_patience=1, reset_optimizer=True)
    assert p.update(1, kl=1.0, val_score=0.5) is None
    assert p.update(2, kl=1.2, val_score=0.6) is None
    assert p.update(3, kl=3.0, val_score=0.4) == "kl_spike"  # val stall fired too: kl_spike wins
    assert p.update(7, kl=9.0, val_score=0.1) == "interval"  # 4 steps since step 3; nothing else judged
    m = p.metrics()
    assert (m["ref/resets_interval"], m["ref/resets_kl_spike"], m["ref/resets_val_stall"]) == (1, 1, 0)
    assert m["ref/resets_total"] == 2
    assert p.reset_optimizer is True and p.last_cause == "interval"


def test_metrics_steps_since_reset():
    p = ReferenceResetPolicy(interval=10)
    p.update(10)
    p.update(13)
    assert p.metrics()["ref/steps_since_reset"] == 3


def test_state_dict_roundtrip_continues_identically():
    def run(policy, steps):
        return [policy.update(s, kl=kl, val_score=v) for s, kl, v in steps]

    # kl 1.0 except a spike at step 5; validation every 2 steps, scores falling after step 6
    val = {2: 0.5, 4: 0.4, 6: 0.4, 8: 0.3, 10: 0.3, 12: 0.9, 14: 0.8}
    steps = [(s, 10.0 if s == 5 else 1.0, val.get(s)) for s in range(1, 18)]
    kw = dict(interval=6, kl_spike_factor=3.0, kl_window=3, val_patience=2, kl_max=50.0)
    reference = ReferenceResetPolicy(**kw)
    expected = run(reference, steps)
    fired = {s: c for (s, _, _), c in zip(steps, expected) if c}
    assert fired == {5: "kl_spike", 10: "val_stall", 16: "interval"}

    first = ReferenceResetPolicy(**kw)
    head = run(first, steps[:8])
    resumed = ReferenceResetPolicy(interval=100)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    assert head + run(resumed, steps[8:]) == expected
    assert resumed.metrics() == reference.metrics()


def test_non_finite_kl_raises():
    with pytest.raises(ValueError, match="kl"):
        ReferenceResetPolicy(kl_spike_factor=2, kl_window=2).update(1, kl=float("nan"))
