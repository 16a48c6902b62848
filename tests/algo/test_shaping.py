"""Tests for prorl_async.algo.shaping: cosine length reward, schedule, DAPO overlong handling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prorl_async.algo import (
    LengthPenaltySchedule,
    cosine_length_reward,
    filter_overlong,
    shape_rewards,
    soft_overlong_penalty,
)

from ._helpers import FAST

NAN = float("nan")


# --------------------------------------------------------------------------------------
# cosine length reward
# --------------------------------------------------------------------------------------


def test_cosine_length_reward_by_hand():
    # max_length 100; correct pair (1.0, 0.5), wrong pair (-0.5, 0.0)
    correct = torch.tensor([True, True, True, True, False, False, False, True, False])
    lengths = torch.tensor([0, 100, 50, 25, 0, 50, 100, 200, 200])
    got = cosine_length_reward(correct, lengths, 100)
    expected = [
        1.0,  # L = 0: v_0
        0.5,  # L = max: v_end
        0.75,  # 0.5 + 0.5 * 0.5 * (1 + cos(pi/2))
        0.5 + 0.25 * (1 + math.cos(math.pi / 4)),  # 0.92678
        -0.5,
        -0.25,  # 0 + 0.5 * (-0.5) * (1 + 0)
        0.0,
        0.5,  # beyond max_length clamps to v_end
        0.0,
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert got.dtype == torch.float32


def test_cosine_length_reward_custom_pairs_and_monotonicity():
    # Yeo et al.'s own values: correct (2, 1), wrong (-10, 0)
    lengths = torch.arange(0, 101, 10)
    pairs = dict(r_correct=(2.0, 1.0), r_wrong=(-10.0, 0.0))
    ok = cosine_length_reward(torch.ones(11, dtype=torch.bool), lengths, 100, **pairs)
    bad = cosine_length_reward(torch.zeros(11, dtype=torch.bool), lengths, 100, **pairs)
    assert ok[0] == 2.0 and ok[-1] == 1.0 and bad[0] == -10.0 and bad[-1] == 0.0
    assert (ok[1:] < ok[:-1]).all()  # shorter correct answers earn more
    assert (bad[1:] > bad[:-1]).all()  # longer wrong answers are punished less


def test_cosine_length_reward_rejects_bad_input():
    with pytest.raises(ValueError, match="max_length"):
        cosine_length_reward(torch.tensor([True]), torch.tensor([3]), 0)
    with pytest.raises(ValueError, match="lengths"):
        cosine_length_reward(torch.tensor([True]), torch.tensor([-1]), 10)
    with pytest.raises(ValueError, match="r_wrong"):
        cosine_length_reward(torch.tensor([True]), torch.tensor([1]), 10, r_wrong=(1.0,))


@FAST
@given(
    data=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), min_size=1, max_size=10),
    max_length=st.integers(1, 256),
)
def test_cosine_length_reward_matches_loop(data, max_length):
    correct = torch.tensor([c for c, _ in data])
    lengths = torch.tensor([n for _, n in data])
    want = []
    for c, n in data:
        v0, v_end = (1.0, 0.5) if c else (-0.5, 0.0)
        want.append(v_end + 0.5 * (v0 - v_end) * (1 + math.cos(math.pi * min(n, max_length) / max_length)))
    torch.testing.assert_close(cosine_length_reward(correct, lengths, max_length), torch.tensor(want))


# --------------------------------------------------------------------------------------
# schedule
# --------------------------------------------------------------------------------------


def test_schedule_cycles_on_and_off_after_start():
    s = LengthPenaltySchedule(on_steps=2, off_steps=3, start_step=1)
    #          step: 0      1     2     3      4      5      6     7     8      9
    expected = [False, True, True, False, False, False, True, True, False, False]
    assert [s.active(k) for k in range(10)] == expected


def test_schedule_off_zero_is_always_on_and_on_zero_never():
    always = LengthPenaltySchedule(on_steps=5, off_steps=0, start_step=3)
    assert [always.active(k) for k in range(8)] == [False] * 3 + [True] * 5
    never = LengthPenaltySchedule(on_steps=0, off_steps=4)
    assert not any(never.active(k) for k in range(20))


def test_schedule_state_dict_roundtrip_and_validation():
    s = LengthPenaltySchedule(on_steps=4, off_steps=6, start_step=10)
    t = LengthPenaltySchedule(on_steps=1, off_steps=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == {"on_steps": 4, "off_steps": 6, "start_step": 10}
    assert [t.active(k) for k in range(40)] == [s.active(k) for k in range(40)]
    with pytest.raises(ValueError, match="off_steps"):
        LengthPenaltySchedule(on_steps=1, off_steps=-1)


# --------------------------------------------------------------------------------------
# overlong
# --------------------------------------------------------------------------------------


def test_soft_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 80, 85, 90, 100, 120])
    got = soft_overlong_penalty(lengths, max_length=100, buffer=20, factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    got = soft_overlong_penalty(lengths, max_length=100, buffer=20, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_soft_overlong_penalty_zero_buffer_is_a_step_and_bad_buffer_raises():
    got = soft_overlong_penalty(torch.tensor([99, 100, 101]), max_length=100, buffer=0, factor=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -2.0]))
    with pytest.raises(ValueError, match="buffer"):
        soft_overlong_penalty(torch.tensor([1]), max_length=10, buffer=11)


@FAST
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=10),
    max_length=st.integers(1, 200),
    frac=st.floats(0.0, 1.0),
    factor=st.floats(0.0, 3.0),
)
def test_soft_overlong_penalty_matches_loop(lengths, max_length, frac, factor):
    buffer = int(frac * max_length)
    want = []
    for n in lengths:
        if n <= max_length - buffer:
            want.append(0.0)
        elif n <= max_length:
            want.append(((max_length - buffer) - n) / buffer * factor)
        else:
            want.append(-factor)
    got = soft_overlong_penalty(torch.tensor(lengths), max_length, buffer, factor)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_filter_overlong_zeroes_truncated_rows_only():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = filter_overlong(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert got.dtype == mask.dtype
    assert torch.equal(mask[1], torch.ones(3))  # input untouched


# --------------------------------------------------------------------------------------
# shape_rewards
# --------------------------------------------------------------------------------------


def _batch():
    raw = torch.tensor([1.0, 0.0, 1.0, NAN])
    correct = torch.tensor([True, False, True, False])
    lengths = torch.tensor([50, 50, 100, 10])
    truncated = torch.tensor([False, False, True, False])
    valid = torch.tensor([True, True, True, False])
    return raw, correct, lengths, truncated, valid


def test_shape_rewards_schedule_active_uses_cosine_reward():
    raw, correct, lengths, truncated, valid = _batch()
    sched = LengthPenaltySchedule(on_steps=1, off_steps=1)
    rewards, keep, m = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, schedule=sched, valid=valid
    )
    # cosine: correct@50 -> 0.75, wrong@50 -> -0.25, correct@100 -> 0.5; invalid keeps its raw NaN
    torch.testing.assert_close(rewards[:3], torch.tensor([0.75, -0.25, 0.5]))
    assert math.isnan(rewards[3].item())
    assert keep.tolist() == [True, True, True, False]
    assert m["len/penalty_active"] == 1.0
    assert m["len/truncated_frac"] == pytest.approx(1 / 3)
    assert m["len/mean_length"] == pytest.approx(200 / 3)
    assert m["reward/raw_mean"] == pytest.approx(2 / 3)
    assert m["reward/shaped_mean"] == pytest.approx(1.0 / 3)
    assert m["reward/invalid_frac"] == 0.25


def test_shape_rewards_schedule_inactive_keeps_raw_and_cosine_false_disables():
    raw, correct, lengths, truncated, valid = _batch()
    sched = LengthPenaltySchedule(on_steps=1, off_steps=1)
    rewards, _, m = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=1, schedule=sched, valid=valid
    )
    torch.testing.assert_close(rewards[:3], raw[:3])
    assert m["len/penalty_active"] == 0.0
    rewards, _, m = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, cosine=False, valid=valid
    )
    torch.testing.assert_close(rewards[:3], raw[:3])
    assert m["len/penalty_active"] == 0.0


def test_shape_rewards_cosine_params_dict():
    raw, correct, lengths, truncated, valid = _batch()
    rewards, _, _ = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0,
        cosine={"r_correct": (2.0, 1.0), "r_wrong": (-1.0, 0.0)}, valid=valid,
    )
    torch.testing.assert_close(rewards[:3], torch.tensor([1.5, -0.5, 1.0]))
    with pytest.raises(ValueError, match="cosine"):
        shape_rewards(
            raw, correct, lengths, truncated, max_length=100, step=0,
            cosine={"r_right": (1, 0)}, valid=valid,
        )


def test_shape_rewards_filter_and_soft_modes():
    raw, correct, lengths, truncated, valid = _batch()
    _, keep, m = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, cosine=False,
        overlong_mode="filter", valid=valid,
    )
    assert keep.tolist() == [True, True, False, False]
    assert m["len/filtered_frac"] == pytest.approx(1 / 3)

    rewards, keep, m = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, cosine=False,
        overlong_mode="soft", overlong_buffer=60, overlong_factor=1.0, valid=valid,
    )
    # penalty starts at 40: L=50 -> -10/60, L=100 -> -1 ; added to raw 1, 0, 1
    torch.testing.assert_close(rewards[:3], torch.tensor([1 - 1 / 6, -1 / 6, 0.0]))
    assert keep.tolist() == [True, True, True, False]
    assert m["len/overlong_penalty_mean"] == pytest.approx((-1 / 6 - 1 / 6 - 1) / 3)

    # cosine and soft penalty stack
    rewards, _, _ = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0,
        overlong_mode="soft", overlong_buffer=60, valid=valid,
    )
    torch.testing.assert_close(rewards[:3], torch.tensor([0.75 - 1 / 6, -0.25 - 1 / 6, -0.5]))


def test_shape_rewards_zero_mode_gives_truncated_responses_reward_zero():
    raw, correct, lengths, truncated, valid = _batch()
    rewards, keep, _ = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, cosine=False,
        overlong_mode="zero", valid=valid,
    )
    # the third response (raw 1, correct) was cut at max_length: 0; the others keep 1 and 0
    torch.testing.assert_close(rewards[:3], torch.tensor([1.0, 0.0, 0.0]))
    assert math.isnan(rewards[3].item()) and keep.tolist() == [True, True, True, False]
    # after the cosine reward too: 0.75, -0.25 as before, the truncated 0.5 becomes 0
    rewards, _, _ = shape_rewards(
        raw, correct, lengths, truncated, max_length=100, step=0, overlong_mode="zero", valid=valid,
    )
    torch.testing.assert_close(rewards[:3], torch.tensor([0.75, -0.25, 0.0]))


def test_shape_rewards_rejects_nan_raw_reward_of_valid_sample_and_bad_mode():
    raw, correct, lengths, truncated, _ = _batch()
    with pytest.raises(ValueError, match=r"shape_rewards: `raw_rewards` contains 1 non-finite"):
        shape_rewards(raw, correct, lengths, truncated, max_length=100, step=0)
    with pytest.raises(ValueError, match="valid choices: none, filter, soft, zero"):
        shape_rewards(
            raw[:3], correct[:3], lengths[:3], truncated[:3], max_length=100, step=0,
            overlong_mode="hard",
        )
