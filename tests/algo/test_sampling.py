"""Tests for prorl_async.algo.sampling: DAPO dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prorl_async.algo import DynamicSamplingCollector, informative_groups

from ._helpers import FAST, group_members

NAN = float("nan")


def test_informative_groups_by_hand():
    # group 40: all correct (drop); 7: mixed (keep); 3: all wrong (drop); 9: one sample (drop)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([40, 40, 7, 7, 7, 3, 3, 3, 3, 9])
    rewards[5:9] = 0.0
    keep = informative_groups(rewards, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, True, False, False, False, False, False]


def test_informative_groups_tolerance():
    rewards = torch.tensor([0.5, 0.5 + 1e-7, 0.5, 0.5 + 1e-3])
    groups = torch.tensor([0, 0, 1, 1])
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True]
    assert informative_groups(rewards, groups, tol=1e-2).tolist() == [False] * 4


def test_informative_groups_ignores_invalid_samples():
    # group 0: valid rewards {1, 1} + an invalid NaN -> all equal; group 1: {1, 0} + invalid -> keep;
    # group 2: only one valid sample -> uninformative even though the invalid one differs
    rewards = torch.tensor([1.0, 1.0, NAN, 1.0, 0.0, 5.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    valid = torch.tensor([True, True, False, True, True, False, True, False])
    keep = informative_groups(rewards, groups, valid=valid)
    assert keep.tolist() == [False, False, False, True, True, True, False, False]


def test_informative_groups_rejects_nan_at_valid_sample():
    with pytest.raises(ValueError, match=r"informative_groups: `rewards` contains 1 non-finite"):
        informative_groups(torch.tensor([1.0, NAN]), torch.tensor([0, 0]))


@FAST
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 4), st.booleans()), min_size=1, max_size=12
    )
)
def test_informative_groups_matches_loop(data):
    rewards = torch.tensor([r for r, _, _ in data])
    groups = torch.tensor([g * 11 for _, g, _ in data])
    valid = torch.tensor([v for _, _, v in data])
    want = [False] * len(data)
    for idx in group_members(groups.tolist()).values():
        vals = [rewards[i].item() for i in idx if valid[i]]
        informative = len(vals) >= 2 and max(vals) - min(vals) > 1e-6
        for i in idx:
            want[i] = informative
    assert informative_groups(rewards, groups, valid=valid).tolist() == want


# --------------------------------------------------------------------------------------
# collector
# --------------------------------------------------------------------------------------


def test_collector_keeps_informative_groups_fifo_and_counts_drops():
    c = DynamicSamplingCollector(target_groups=2)
    assert c.add("p1", [1.0, 1.0, 1.0]) is False  # all correct
    assert c.add("p2", [1.0, 0.0, 1.0]) is True
    assert not c.ready
    assert c.add("p3", [0.0, 0.0]) is False  # all wrong
    assert c.add("p4", torch.tensor([0.0, 1.0])) is True
    assert c.add("p5", [0.2, 0.7], valid=[True, True]) is True
    assert c.add("p6", [1.0, 0.0, NAN], valid=[True, False, False]) is False  # one valid sample
    assert c.ready
    assert c.pop() == ["p2", "p4"]
    assert not c.ready and c.num_pending == 1
    m = c.metrics()
    assert m["dynsamp/groups_seen"] == 6
    assert m["dynsamp/groups_kept"] == 3
    assert m["dynsamp/groups_dropped"] == 2
    assert m["dynsamp/groups_dropped_too_few_valid"] == 1
    assert m["dynsamp/samples_seen"] == 15
    assert m["dynsamp/samples_invalid"] == 2
    assert m["dynsamp/batches_popped"] == 1
    assert m["dynsamp/keep_rate"] == pytest.approx(0.5)
    assert m["dynsamp/pending"] == 1


def test_collector_pop_before_ready_raises_and_pop_is_exactly_target():
    c = DynamicSamplingCollector(target_groups=3)
    with pytest.raises(RuntimeError, match="1 of 3|0 of 3"):
        c.pop()
    for k in range(7):
        c.add(k, [0.0, 1.0])
    assert c.pop() == [0, 1, 2]
    assert c.pop() == [3, 4, 5]
    assert not c.ready


def test_collector_rejects_bad_input():
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingCollector(0)
    c = DynamicSamplingCollector(1)
    with pytest.raises(ValueError, match="non-finite"):
        c.add("g", [1.0, math.inf])
    with pytest.raises(ValueError, match="validity flags"):
        c.add("g", [1.0, 0.0], valid=[True])
    assert c.groups_seen == 0  # rejected input is not counted


def test_collector_state_dict_roundtrip():
    c = DynamicSamplingCollector(target_groups=2)
    c.add("a", [1.0, 0.0])
    c.add("b", [1.0, 1.0])
    state = c.state_dict()
    d = DynamicSamplingCollector(target_groups=5)
    d.load_state_dict(state)
    assert d.state_dict() == state
    assert d.target_groups == 2 and d.groups_dropped == 1
    d.add("c", [0.0, 0.3])
    assert d.pop() == ["a", "c"]
