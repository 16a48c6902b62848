"""Tests for prorl_async.algo.mismatch: numbers worked out by hand, padding ignored, additivity."""

from __future__ import annotations

import math

import pytest
import torch

from prorl_async.algo import mismatch, mismatch_metrics, mismatch_stats

LN2 = math.log(2.0)
NAN = float("nan")


def test_equal_logprobs_have_zero_mismatch():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    m = mismatch(lp, lp.clone(), torch.ones(1, 3))
    assert m["mismatch/tokens"] == 3
    assert m["mismatch/kl_k3"] == 0.0 and m["mismatch/logprob_abs_diff_mean"] == 0.0
    assert m["mismatch/logprob_abs_diff_max"] == 0.0 and m["mismatch/is_outside_frac"] == 0.0


def test_by_hand_two_tokens_and_padding():
    # token 1: learner = behaviour + ln 2 -> r = 2, k3 = 2 - ln2 - 1 = 1 - ln2, |d| = ln2
    # token 2: learner = behaviour - ln 2 -> r = 1/2, k3 = 1/2 + ln2 - 1 = ln2 - 1/2, |d| = ln2
    # token 3 is padding holding NaN: ignored
    beh = torch.tensor([[-1.0, -1.0, NAN]])
    learner = torch.tensor([[-1.0 + LN2, -1.0 - LN2, NAN]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch(learner, beh, mask, is_low=0.6, is_high=2.01)
    assert m["mismatch/tokens"] == 2
    assert m["mismatch/kl_k3"] == pytest.approx(((1 - LN2) + (LN2 - 0.5)) / 2, abs=1e-6)  # = 0.25 (fp32 inputs)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(LN2, abs=1e-6)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(LN2, abs=1e-6)
    # w = 2 is inside [0.6, 2.01], w = 0.5 is below 0.6
    assert m["mismatch/is_outside_frac"] == pytest.approx(0.5)
    m = mismatch(learner, beh, mask, is_low=0.0, is_high=1.5)  # now w = 2 is above, w = 0.5 inside
    assert m["mismatch/is_outside_frac"] == pytest.approx(0.5)
    m = mismatch(learner, beh, mask, is_low=0.0, is_high=2.5)
    assert m["mismatch/is_outside_frac"] == 0.0


def test_rows_restrict_and_no_tokens_reports_only_the_count():
    beh = torch.tensor([[-1.0], [-1.0]])
    learner = torch.tensor([[-1.0], [-1.0 + LN2]])
    m = mismatch(learner, beh, torch.ones(2, 1), rows=torch.tensor([True, False]), prefix="mismatch/cur_")
    assert m["mismatch/cur_tokens"] == 1 and m["mismatch/cur_kl_k3"] == 0.0
    m = mismatch(learner, beh, torch.ones(2, 1), rows=torch.tensor([False, False]))
    assert m == {"mismatch/tokens": 0.0}  # not a 0 KL that would read as agreement


def test_stats_add_across_splits_like_ranks():
    g = torch.Generator().manual_seed(0)
    learner = -torch.rand(6, 5, generator=g) * 3
    beh = learner + torch.randn(6, 5, generator=g) * 0.3
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = mismatch_stats(learner, beh, mask, 0.5, 1.5)
    a, b = mismatch_stats(learner[:2], beh[:2], mask[:2], 0.5, 1.5), mismatch_stats(learner[2:], beh[2:], mask[2:], 0.5, 1.5)
    summed = torch.cat([(a + b)[:4], torch.maximum(a, b)[4:]])
    torch.testing.assert_close(summed, whole, rtol=1e-12, atol=1e-12)
    assert mismatch_metrics(summed) == pytest.approx(mismatch_metrics(whole))


def test_non_finite_valid_logprob_and_bad_band_are_clear_errors():
    with pytest.raises(ValueError, match="learner_logprobs"):
        mismatch_stats(torch.tensor([[NAN]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match="is_low <= is_high"):
        mismatch_stats(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1), is_low=2.0, is_high=1.0)
