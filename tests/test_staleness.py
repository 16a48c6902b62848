"""Admission control: the driver's request plan (pure; shared with the scale simulation)."""

from prorl_async.staleness import admission_budget, plan_requests


def test_sync_plan_fills_exactly_one_step():
    # max_staleness=0, 4 prompts per step, requests of up to 3: 3 + 1, then nothing
    assert plan_requests([0, 0, 0], [False] * 3, 0, 4, 3, consumed=0, live=0) == [(0, 3), (1, 1)]


def test_busy_generators_are_skipped_and_live_counts():
    assert plan_requests([0, 0], [True, False], 0, 4, 3, consumed=0, live=3) == [(1, 1)]
    assert plan_requests([0, 0], [False, False], 0, 4, 3, consumed=0, live=4) == []


def test_staleness_slack_and_generator_version():
    # version 0 with max_staleness=1 may run two steps ahead of consumption: 8 prompts
    assert plan_requests([0, 0, 0], [False] * 3, 1, 4, 3, 0, 0) == [(0, 3), (1, 3), (2, 2)]
    # a generator still on old weights gets no budget once the learner has consumed ahead of it
    assert plan_requests([0, 1], [False, False], 0, 4, 4, consumed=4, live=0) == [(1, 4)]


def test_plan_matches_budget_rule_step_by_step():
    versions, busy = [2, 0, 1, 3, 2], [False, False, True, False, False]
    consumed, live = 9, 3
    plan = plan_requests(versions, busy, 2, 5, 4, consumed, live)
    expected = []
    for i, (v, b) in enumerate(zip(versions, busy)):
        budget = admission_budget(v, 2, 5, consumed, live)
        if not b and budget >= 1:
            expected.append((i, min(4, budget)))
            live += min(4, budget)
    assert plan == expected


def test_no_group_is_planned_beyond_the_runs_last_step():
    # 3 steps of 4 prompts, max_staleness=1: at consumed=8 (version 2) the slack would allow 8 more,
    # the run needs only its last 4; a dropped group (live back to 3) makes room for its refill
    assert plan_requests([2, 2], [False, False], 1, 4, 3, consumed=8, live=0) == [(0, 3), (1, 3)]
    assert plan_requests([2, 2], [False, False], 1, 4, 3, consumed=8, live=0, max_groups=12) == [(0, 3), (1, 1)]
    assert plan_requests([2], [False], 1, 4, 3, consumed=8, live=4, max_groups=12) == []
    assert plan_requests([2], [False], 1, 4, 3, consumed=8, live=3, max_groups=12) == [(0, 1)]
