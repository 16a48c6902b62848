"""Tests for prorl_async.algo.advantages: hand-worked numbers, loop references, rank splits."""

from __future__ import annotations

import math
import socket
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prorl_async.algo import (
    ADVANTAGE_ESTIMATORS,
    advantage_metrics,
    compute_advantages,
    grpo,
    reinforce_pp_baseline,
    rloo,
    whiten,
    whitening_stats,
)

from ._helpers import FAST, group_members, loop_token_whiten, reward_batches

# --------------------------------------------------------------------------------------
# REINFORCE++-baseline, by hand
# --------------------------------------------------------------------------------------


def test_reinforce_pp_baseline_hand_worked_with_padding():
    # One group {1, 0}: mean 0.5 -> centered [0.5, -0.5]. Response 0 has 3 valid tokens,
    # response 1 has 1. Tokens: 0.5, 0.5, 0.5, -0.5 -> mean 0.25,
    # population var = (3 * 0.25^2 + 0.75^2) / 4 = 0.1875, std = sqrt(3)/4.
    # Whitened: (0.5 - 0.25) / (sqrt(3)/4) = 1/sqrt(3); (-0.5 - 0.25) / (sqrt(3)/4) = -sqrt(3).
    rewards = torch.tensor([1.0, 0.0])
    groups = torch.tensor([5, 5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = reinforce_pp_baseline(rewards, groups, mask, eps=0.0)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([[1 / s3, 1 / s3, 1 / s3], [-s3, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert adv[1, 1:].eq(0).all()  # padding is exactly 0


def test_reinforce_pp_baseline_default_eps_is_inside_the_sqrt():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 1)
    # tokens +-0.5: mean 0, var 0.25; eps = 0.75 makes the denominator sqrt(1) = 1.
    adv = reinforce_pp_baseline(rewards, torch.tensor([0, 0]), mask, eps=0.75)
    torch.testing.assert_close(adv, torch.tensor([[0.5], [-0.5]]))


def test_reinforce_pp_baseline_group_of_one_and_sparse_ids():
    # groups {7: [1, 3]} and {2: [5]} -> centered [-1, 1, 0]; tokens (T=1) mean 0,
    # var = 2/3 -> adv = x * sqrt(3/2).
    rewards = torch.tensor([1.0, 3.0, 5.0])
    groups = torch.tensor([7, 7, 2])
    adv = reinforce_pp_baseline(rewards, groups, torch.ones(3, 1), eps=0.0)
    k = math.sqrt(1.5)
    torch.testing.assert_close(adv, torch.tensor([[-k], [k], [0.0]]))


def test_reinforce_pp_baseline_all_equal_batch_gives_zero_not_nan():
    adv = reinforce_pp_baseline(torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2))
    assert torch.equal(adv, torch.zeros(4, 2))


def test_reinforce_pp_baseline_invalid_samples_are_excluded():
    # Sample 2 is invalid (NaN reward): the group {1, 0, NaN} behaves like {1, 0}.
    rewards = torch.tensor([1.0, 0.0, float("nan")])
    valid = torch.tensor([True, True, False])
    mask = torch.ones(3, 1)
    adv = reinforce_pp_baseline(rewards, torch.tensor([0, 0, 0]), mask, eps=0.0, valid=valid)
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0], [0.0]]))


# --------------------------------------------------------------------------------------
# GRPO and RLOO, by hand
# --------------------------------------------------------------------------------------


def test_grpo_hand_worked():
    # group {1, 0, 0}: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3)
    # -> (2/3) * sqrt(3) = 1.1547, -(1/3) * sqrt(3) = -0.57735. Group {9: [3.0]} has size 1 -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([4, 4, 4, 9])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    adv = grpo(rewards, groups, mask, eps=0.0)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([[2 / s3, 2 / s3], [-1 / s3, 0.0], [-1 / s3, -1 / s3], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert torch.isfinite(grpo(torch.tensor([2.0]), torch.tensor([0]), torch.ones(1, 3))).all()


def test_grpo_eps_added_to_std_and_all_equal_group_is_zero():
    # group {2, 0}: mean 1, unbiased std sqrt(2); eps = 1 - sqrt(2) + 1 makes std + eps = 2.
    eps = 2.0 - math.sqrt(2.0)
    adv = grpo(torch.tensor([2.0, 0.0, 4.0, 4.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1), eps=eps)
    torch.testing.assert_close(adv, torch.tensor([[0.5], [-0.5], [0.0], [0.0]]))


def test_rloo_hand_worked():
    # group {1, 0, 0}: leave-one-out means 0, 0.5, 0.5 -> 1, -0.5, -0.5; size-1 group -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([4, 4, 4, 9])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv = rloo(rewards, groups, mask)
    expected = torch.tensor([[1.0, 1.0], [-0.5, -0.5], [-0.5, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_grpo_and_rloo_respect_valid():
    rewards = torch.tensor([1.0, 0.0, float("inf"), 1.0, float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, False, True, False])
    mask = torch.ones(5, 1)
    # group 0 behaves like {1, 0}; group 1 has one valid member -> 0.
    torch.testing.assert_close(
        rloo(rewards, groups, mask, valid=valid), torch.tensor([[1.0], [-1.0], [0.0], [0.0], [0.0]])
    )
    r2 = 1 / math.sqrt(2.0)  # (1 - 0.5) / std(1, 0) with std = sqrt(0.5)
    torch.testing.assert_close(
        grpo(rewards, groups, mask, eps=0.0, valid=valid),
        torch.tensor([[r2], [-r2], [0.0], [0.0], [0.0]]),
    )


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_raises_naming_the_tensor(name, bad):
    rewards = torch.tensor([1.0, bad, 0.0])
    with pytest.raises(ValueError, match=rf"{name}: `rewards` contains 1 non-finite"):
        compute_advantages(name, rewards, torch.tensor([0, 0, 0]), torch.ones(3, 2))


def test_float_group_index_and_shape_mismatch_raise():
    with pytest.raises(ValueError, match="group_index"):
        grpo(torch.zeros(2), torch.tensor([0.0, 1.0]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="mask"):
        rloo(torch.zeros(2), torch.tensor([0, 1]), torch.ones(3, 1))


def test_compute_advantages_dispatches_and_rejects_unknown_names():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 3, 3])
    mask = torch.ones(4, 2)
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        torch.testing.assert_close(compute_advantages(name, rewards, groups, mask), fn(rewards, groups, mask))
    torch.testing.assert_close(
        compute_advantages("grpo", rewards, groups, mask, eps=0.0), grpo(rewards, groups, mask, eps=0.0)
    )
    assert set(ADVANTAGE_ESTIMATORS) == {"reinforce_pp_baseline", "grpo", "rloo"}
    with pytest.raises(ValueError, match="valid choices: grpo, reinforce_pp_baseline, rloo"):
        compute_advantages("ppo_gae", rewards, groups, mask)


def test_advantage_metrics():
    adv = torch.tensor([[1.0, -1.0, float("nan")], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    m = advantage_metrics(adv, mask)
    assert m["adv/mean"] == pytest.approx(1.0)
    assert m["adv/std"] == pytest.approx(math.sqrt(8.0 / 3.0))
    assert (m["adv/min"], m["adv/max"]) == (-1.0, 3.0)


# --------------------------------------------------------------------------------------
# whitening stats and the split across ranks
# --------------------------------------------------------------------------------------


def test_whitening_stats_hand_worked_ignores_padding_garbage():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    stats = whitening_stats(values, mask)
    assert stats.dtype == torch.float64
    assert stats.tolist() == [7.0, 21.0, 3.0]
    # mean 7/3, var = 21/3 - 49/9 = 14/9
    out = whiten(values, mask, stats, eps=0.0)
    std = math.sqrt(14.0 / 9.0)
    expected = torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_whiten_empty_mask_gives_zeros():
    values = torch.randn(2, 3)
    mask = torch.zeros(2, 3)
    assert torch.equal(whiten(values, mask, whitening_stats(values, mask)), torch.zeros(2, 3))


def _split_batch():
    # 6 responses, 3 groups; "rank A" holds groups 10 and 11, "rank B" group 12.
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.5, -1.0])
    groups = torch.tensor([10, 10, 11, 11, 12, 12])
    mask = torch.tensor(
        [
            [1, 1, 1, 1],
            [1, 1, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    return rewards, groups, mask


def test_two_ranks_with_hand_summed_stats_equal_the_whole_batch():
    rewards, groups, mask = _split_batch()
    whole = reinforce_pp_baseline(rewards, groups, mask)
    a, b = slice(0, 4), slice(4, 6)

    seen = {}

    def record(key):
        def fn(stats):
            seen[key] = stats.clone()
            return stats

        return fn

    local_a = reinforce_pp_baseline(rewards[a], groups[a], mask[a], stats_reduce=record("a"))
    reinforce_pp_baseline(rewards[b], groups[b], mask[b], stats_reduce=record("b"))
    total = seen["a"] + seen["b"]
    assert total[2].item() == mask.sum().item()

    # a reducer that returns the sum ...
    adv_a = reinforce_pp_baseline(rewards[a], groups[a], mask[a], stats_reduce=lambda s: s + seen["b"])

    # ... and one that reduces in place and returns None, like dist.all_reduce
    def inplace_b(stats):
        stats += seen["a"]

    adv_b = reinforce_pp_baseline(rewards[b], groups[b], mask[b], stats_reduce=inplace_b)
    torch.testing.assert_close(torch.cat([adv_a, adv_b]), whole)
    # without the reduction the local result differs: the test above is not vacuous
    assert not torch.allclose(local_a, whole[a])


@FAST
@given(batch=reward_batches(), cut=st.integers(0, 8))
def test_random_group_aligned_split_equals_whole(batch, cut):
    rewards, groups, mask, _ = batch
    # put each group wholly on one rank: groups with id-rank below the cut go to rank A
    uniq = torch.unique(groups)
    on_a = torch.isin(groups, uniq[: cut % (len(uniq) + 1)])
    parts = [on_a, ~on_a]
    stats = [whitening_stats(*_centered(rewards[p], groups[p], mask[p])) for p in parts]
    total = stats[0] + stats[1]
    whole = reinforce_pp_baseline(rewards, groups, mask)
    for p in parts:
        if p.any():
            got = reinforce_pp_baseline(rewards[p], groups[p], mask[p], stats_reduce=lambda s: total)
            torch.testing.assert_close(got, whole[p], rtol=1e-5, atol=1e-5)


def _centered(rewards, groups, mask):
    """Group-centered rewards broadcast over valid tokens (test-side, plain loops)."""
    members = group_members(groups.tolist())
    r = rewards.tolist()
    x = torch.zeros(mask.shape, dtype=torch.float64)
    for idx in members.values():
        mean = sum(r[i] for i in idx) / len(idx)
        for i in idx:
            x[i] = r[i] - mean
    return x, mask


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_process_gloo_all_reduce_equals_single_rank():
    import torch.multiprocessing as mp

    from . import _dist_worker

    rewards, groups, mask = _split_batch()
    whole = reinforce_pp_baseline(rewards, groups, mask)
    shards = [(rewards[:4], groups[:4], mask[:4]), (rewards[4:], groups[4:], mask[4:])]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker.rank_main, args=(2, _free_port(), tmp, shards), nprocs=2, join=True)
        got = torch.cat([torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)])
    torch.testing.assert_close(got, whole)


# --------------------------------------------------------------------------------------
# properties: loop references and whitening invariants
# --------------------------------------------------------------------------------------


def _loop_reinforce_pp(rewards, groups, lengths, t, eps):
    r = rewards.tolist()
    centered = [0.0] * len(r)
    for idx in group_members(groups.tolist()).values():
        mean = sum(r[i] for i in idx) / len(idx)
        for i in idx:
            centered[i] = r[i] - mean
    return loop_token_whiten(centered, lengths, t, eps)


def _loop_grpo(rewards, groups, lengths, t, eps):
    r = rewards.tolist()
    out = [[0.0] * t for _ in r]
    for idx in group_members(groups.tolist()).values():
        if len(idx) < 2:
            continue
        mean = sum(r[i] for i in idx) / len(idx)
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in idx) / (len(idx) - 1))
        for i in idx:
            for j in range(lengths[i]):
                out[i][j] = (r[i] - mean) / (std + eps)
    return out


def _loop_rloo(rewards, groups, lengths, t):
    r = rewards.tolist()
    out = [[0.0] * t for _ in r]
    for idx in group_members(groups.tolist()).values():
        if len(idx) < 2:
            continue
        for i in idx:
            others = [r[k] for k in idx if k != i]
            for j in range(lengths[i]):
                out[i][j] = r[i] - sum(others) / len(others)
    return out


@FAST
@given(batch=reward_batches())
def test_estimators_match_python_loops(batch):
    rewards, groups, mask, lengths = batch
    t = mask.shape[1]
    cases = [
        (reinforce_pp_baseline(rewards, groups, mask), _loop_reinforce_pp(rewards, groups, lengths, t, 1e-8)),
        (grpo(rewards, groups, mask), _loop_grpo(rewards, groups, lengths, t, 1e-6)),
        (rloo(rewards, groups, mask), _loop_rloo(rewards, groups, lengths, t)),
    ]
    for got, want in cases:
        # grpo divides by std + 1e-6, which amplifies float32 rounding of near-equal rewards
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-4, atol=1e-3)


@FAST
@given(batch=reward_batches())
def test_whitened_advantages_have_zero_mean_unit_std_over_valid_tokens(batch):
    rewards, groups, mask, _ = batch
    x, _ = _centered(rewards, groups, mask)
    valid = mask.bool()
    assume(valid.sum() >= 2 and x[valid].var(unbiased=False) > 1e-3)
    adv = reinforce_pp_baseline(rewards, groups, mask).double()
    vals = adv[valid]
    assert abs(vals.mean().item()) < 1e-5
    assert vals.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert adv[~valid].eq(0).all()
