"""Tests for prorl_async.algo.losses: every branch by hand, plus loop and gradient properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from prorl_async.algo import (
    IS_MODES,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
)

from ._helpers import FAST

E = math.e
NAN = float("nan")
INF = float("inf")


def _one(logp, old, adv, **kw):
    """policy_loss on a single valid token; returns (loss, d loss / d logp, metrics)."""
    lp = torch.tensor([[logp]], requires_grad=True)
    loss, metrics = policy_loss(lp, torch.tensor([[old]]), torch.tensor([[adv]]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


# --------------------------------------------------------------------------------------
# PPO-Clip with Clip-Higher, one branch per test
# --------------------------------------------------------------------------------------


def test_ratio_e_positive_advantage_is_clipped_high():
    # ratio = e > 1.27, A = +1: -min(e, 1.27) = -1.27, and no gradient through the clip.
    loss, grad, m = _one(0.0, -1.0, 1.0, clip_eps_low=0.2, clip_eps_high=0.27)
    assert loss == pytest.approx(-1.27)
    assert grad == 0.0
    assert (m["clipfrac_high"], m["clipfrac_low"]) == (1.0, 0.0)
    assert m["approx_kl"] == pytest.approx(E - 2.0)  # (e - 1) - 1
    assert m["ratio_mean"] == pytest.approx(E)


def test_clip_higher_is_asymmetric():
    # the same ratio with eps_high = 0.2 clips at 1.2: the two epsilons are separate knobs
    loss, _, _ = _one(0.0, -1.0, 1.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss == pytest.approx(-1.2)


def test_ratio_inv_e_negative_advantage_is_clipped_low():
    # ratio = 1/e < 0.8, A = -1: -min(-1/e, -0.8) = 0.8, no gradient.
    loss, grad, m = _one(-1.0, 0.0, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert (m["clipfrac_low"], m["clipfrac_high"]) == (1.0, 0.0)


def test_ratio_one_is_not_clipped():
    # ratio = 1, A = 2: loss -2, d(-ratio * A)/dlogp = -ratio * A = -2
    loss, grad, m = _one(-0.5, -0.5, 2.0)
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx(-2.0)
    assert m["clipfrac_low"] == m["clipfrac_high"] == 0.0
    assert m["approx_kl"] == 0.0


def test_ratio_e_negative_advantage_takes_the_unclipped_pessimistic_branch():
    # ratio = e, A = -1: -min(-e, -1.27) = e, gradient -A * ratio = e still flows
    loss, grad, m = _one(0.0, -1.0, -1.0)
    assert loss == pytest.approx(E)
    assert grad == pytest.approx(E)
    assert m["clipfrac_low"] == m["clipfrac_high"] == 0.0


def test_ratio_inv_e_positive_advantage_is_unclipped():
    # ratio = 1/e, A = +1: -min(1/e, 0.8) = -1/e
    loss, grad, _ = _one(-1.0, 0.0, 1.0)
    assert loss == pytest.approx(-1 / E)
    assert grad == pytest.approx(-1 / E)


def _five_branch_batch():
    # rows: the five single-token cases above, padded to T=2 with garbage in the padding
    logp = torch.tensor([[0.0, NAN], [-1.0, INF], [-0.5, 0.0], [0.0, -INF], [-1.0, 3.0]])
    old = torch.tensor([[-1.0, 0.0], [0.0, NAN], [-0.5, INF], [-1.0, 0.0], [0.0, 0.0]])
    adv = torch.tensor([[1.0, NAN], [-1.0, 1.0], [2.0, 0.0], [-1.0, INF], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0]] * 5)
    per_token = [-1.27, 0.8, -2.0, E, -1 / E]
    return logp, old, adv, mask, per_token


def test_token_mean_ignores_padding_garbage_and_uses_num_tokens():
    logp, old, adv, mask, per_token = _five_branch_batch()
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(per_token) / 5)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[:, 1].eq(0).all()
    assert m["clipfrac_high"] == pytest.approx(1 / 5) and m["clipfrac_low"] == pytest.approx(1 / 5)
    # a learner passes the global token count: this micro-batch is 5 of 20 tokens
    loss_global, _ = policy_loss(logp, old, adv, mask, num_tokens=20)
    assert loss_global.item() == pytest.approx(sum(per_token) / 20)
    loss_t, _ = policy_loss(logp, old, adv, mask, num_tokens=torch.tensor(10))
    assert loss_t.item() == pytest.approx(sum(per_token) / 10)


def test_micro_batches_with_global_count_sum_to_whole_batch_loss():
    logp, old, adv, mask, _ = _five_branch_batch()
    whole, _ = policy_loss(logp, old, adv, mask)
    parts = [policy_loss(logp[s], old[s], adv[s], mask[s], num_tokens=5)[0] for s in (slice(0, 2), slice(2, 5))]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def test_empty_mask_gives_zero_loss_and_bad_num_tokens_raises():
    loss, m = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2))
    assert loss.item() == 0.0 and m["clipfrac_high"] == 0.0
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), num_tokens=0)


# --------------------------------------------------------------------------------------
# behaviour-policy importance weights: tis / icepop / none
# --------------------------------------------------------------------------------------


def _is_batch():
    # two tokens with ratio 1 and A = +1 (per-token loss -1 before weighting);
    # raw weights w = exp(old - behavior) = 3 and 0.5
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    behavior = torch.tensor([[-math.log(3.0), math.log(2.0)]])
    return logp, old, torch.ones(1, 2), torch.ones(1, 2), behavior


@pytest.mark.parametrize(
    "mode, lo, hi, weights, masked_frac",
    [
        ("tis", 0.0, 2.0, [2.0, 0.5], 0.5),  # 3 clamped to 2
        ("tis", 0.6, 2.0, [2.0, 0.6], 1.0),  # both clamped
        ("icepop", 0.0, 2.0, [0.0, 0.5], 0.5),  # 3 outside [0, 2] -> dropped
        ("icepop", 0.6, 2.0, [0.0, 0.0], 1.0),  # both outside [0.6, 2]
        ("icepop", 0.49, 3.01, [3.0, 0.5], 0.0),  # both inside the band
        ("none", 0.0, 2.0, [1.0, 1.0], 0.0),
    ],
)
def test_importance_weight_modes_by_hand(mode, lo, hi, weights, masked_frac):
    logp, old, adv, mask, behavior = _is_batch()
    loss, m = policy_loss(logp, old, adv, mask, behavior_logprobs=behavior, is_mode=mode, is_low=lo, is_high=hi)
    assert loss.item() == pytest.approx(-sum(weights) / 2)
    loss.backward()
    # d loss / d logp_t = -w_t * ratio * A / num_tokens = -w_t / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-w / 2 for w in weights]]))
    assert m["is_masked_frac"] == pytest.approx(masked_frac)
    # raw weight statistics, whatever the mode
    assert m["is_weight_mean"] == pytest.approx((3.0 + 0.5) / 2)
    assert m["is_weight_max"] == pytest.approx(3.0)


def test_icepop_band_is_inclusive():
    # w = exp(0) = 1 exactly; a band [1, 1] keeps it (a strict test would drop it)
    loss, m = policy_loss(
        torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
        behavior_logprobs=torch.zeros(1, 1), is_mode="icepop", is_low=1.0, is_high=1.0,
    )
    assert loss.item() == -1.0 and m["is_masked_frac"] == 0.0


def test_importance_weight_is_detached():
    logp, old, adv, mask, behavior = _is_batch()
    behavior.requires_grad_(True)
    old.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, behavior_logprobs=behavior, is_mode="tis")
    loss.backward()
    assert behavior.grad is None
    # old_logprobs only enters through the ratio: d/dold = -d/dlogp
    torch.testing.assert_close(old.grad, -logp.grad)


def test_no_behavior_logprobs_reports_unit_weights():
    _, _, m = _one(0.0, 0.0, 1.0)
    assert (m["is_weight_mean"], m["is_weight_max"], m["is_masked_frac"]) == (1.0, 1.0, 0.0)


def test_bad_is_mode_and_bounds_raise():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="valid choices: tis, icepop, none"):
        policy_loss(*args, is_mode="clip")
    with pytest.raises(ValueError, match="is_low <= is_high"):
        policy_loss(*args, is_low=3.0, is_high=2.0)


# --------------------------------------------------------------------------------------
# non-finite inputs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "advantages", "behavior_logprobs"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_at_valid_positions_raises_naming_the_tensor(name, bad):
    tensors = {k: torch.zeros(2, 3) for k in ("logprobs", "old_logprobs", "advantages", "behavior_logprobs")}
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tensors[name][0, 1] = bad
    tensors[name][1, 0] = bad
    tensors[name][1, 2] = bad  # padding: not counted
    msg = rf"policy_loss: `{name}` contains 2 non-finite values \(nan/inf\) at valid positions"
    with pytest.raises(ValueError, match=msg):
        policy_loss(
            tensors["logprobs"], tensors["old_logprobs"], tensors["advantages"], mask,
            behavior_logprobs=tensors["behavior_logprobs"],
        )


def test_extreme_log_ratio_gives_finite_loss_and_gradient():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, -200.0]])  # exp(200) would overflow float32
    loss, m = policy_loss(lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert math.isfinite(m["approx_kl"])


# --------------------------------------------------------------------------------------
# KL estimators and masked_mean
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [
        # logp - ref = +1 (log_r = -1) and -1 (log_r = +1)
        ("k1", [1.0, -1.0]),
        ("k2", [0.5, 0.5]),
        ("k3", [math.exp(-1) + 1 - 1, E - 1 - 1]),  # exp(log_r) - log_r - 1
    ],
)
def test_kl_estimators_by_hand(kind, expected):
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor([expected]))


def test_kl_with_mask_zeroes_padding_and_checks_valid_positions_only():
    logp = torch.tensor([[-1.0, NAN]])
    ref = torch.tensor([[-2.0, INF]])
    out = kl_penalty(logp, ref, "k3", mask=torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[math.exp(-1)], [0.0]]).T)
    with pytest.raises(ValueError, match=r"kl_penalty: `ref_logprobs` contains 1 non-finite"):
        kl_penalty(torch.zeros(1, 2), ref, "k2")
    with pytest.raises(ValueError, match="valid choices: k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_k3_is_nonnegative_and_zero_at_equality():
    logp = torch.linspace(-5, 0, 11).reshape(1, -1)
    ref = logp.flip(-1)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert kl_penalty(logp, logp, "k3").eq(0).all()


def test_masked_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, NAN], [INF, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, mask, num_tokens=6).item() == pytest.approx(1.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


# --------------------------------------------------------------------------------------
# logits utilities
# --------------------------------------------------------------------------------------


def test_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((3,), math.log(2.0)))
    # p = (3/4, 1/4): H = -(3/4 ln 3/4 + 1/4 ln 1/4)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropy_from_logits(torch.tensor([[math.log(3.0), 0.0]])).item() == pytest.approx(h)


def test_entropy_chunked_matches_naive_values_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    got = entropy_from_logits(logits, chunk_size=4)  # 15 rows -> 4 chunks
    logp = torch.log_softmax(logits, -1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_want,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g_got, g_want)


def test_logprobs_from_logits_by_hand_and_against_log_softmax():
    logits = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])
    got = logprobs_from_logits(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(got, torch.tensor([math.log(0.75), math.log(0.25)]))

    torch.manual_seed(1)
    logits = torch.randn(2, 7, 13)
    ids = torch.randint(0, 13, (2, 7))
    want = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, ids, chunk_size=3), want)
    bf = logprobs_from_logits(logits.bfloat16(), ids)
    assert bf.dtype == torch.float32
    torch.testing.assert_close(bf, want, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="token_ids"):
        logprobs_from_logits(logits, ids[:, :3])


# --------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------


@st.composite
def token_batches(draw, max_n=4, max_t=5):
    n = draw(st.integers(1, max_n))
    t = draw(st.integers(1, max_t))
    size = n * t
    fl = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_subnormal=False, width=32)  # noqa: E731
    old = draw(st.lists(fl(-4.0, 0.0), min_size=size, max_size=size))
    delta = draw(st.lists(fl(-1.0, 1.0), min_size=size, max_size=size))
    beh_delta = draw(st.lists(fl(-1.5, 1.5), min_size=size, max_size=size))
    adv = draw(st.lists(fl(-3.0, 3.0), min_size=size, max_size=size))
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    old_t = torch.tensor(old).reshape(n, t)
    logp = old_t + torch.tensor(delta).reshape(n, t)
    behavior = old_t - torch.tensor(beh_delta).reshape(n, t)
    mask = torch.tensor([[1.0 if j < length else 0.0 for j in range(t)] for length in lengths])
    return logp, old_t, torch.tensor(adv).reshape(n, t), mask, behavior


def _loop_policy_loss(logp, old, adv, mask, eps_low, eps_high, behavior, mode, lo, hi):
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if mask[i, j] == 0:
                continue
            count += 1
            ratio = math.exp(logp[i, j].item() - old[i, j].item())
            a = adv[i, j].item()
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            token = -min(ratio * a, clipped * a)
            w = 1.0
            if behavior is not None and mode != "none":
                w = math.exp(old[i, j].item() - behavior[i, j].item())
                if mode == "tis":
                    w = min(max(w, lo), hi)
                elif not lo <= w <= hi:
                    w = 0.0
            total += w * token
    return total / max(count, 1)


@FAST
@given(
    batch=token_batches(),
    mode=st.sampled_from(IS_MODES),
    lo=st.sampled_from([0.0, 0.5]),
    hi=st.sampled_from([1.5, 2.0]),
)
def test_policy_loss_matches_python_loop(batch, mode, lo, hi):
    logp, old, adv, mask, behavior = batch
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.27, behavior, mode, lo, hi)
    want = _loop_policy_loss(logp, old, adv, mask, 0.2, 0.27, behavior, mode, lo, hi)
    assert loss.item() == pytest.approx(want, rel=1e-4, abs=1e-5)


@FAST
@given(batch=token_batches(), mode=st.sampled_from(IS_MODES))
def test_behavior_equal_to_old_is_plain_ppo(batch, mode):
    logp, old, adv, mask, _ = batch
    with_is, m = policy_loss(
        logp, old, adv, mask, behavior_logprobs=old.clone(), is_mode=mode, is_low=0.5, is_high=2.0
    )
    plain, _ = policy_loss(logp, old, adv, mask)
    assert with_is.item() == pytest.approx(plain.item(), rel=1e-6, abs=1e-7)
    assert m["is_masked_frac"] == 0.0


@FAST
@given(batch=token_batches())
def test_gradient_is_zero_exactly_on_clipped_tokens(batch):
    logp, old, adv, mask, _ = batch
    eps_low, eps_high = 0.2, 0.27
    ratio = torch.exp(logp - old)
    valid = mask.bool()
    clipped = valid & (((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps_low) & (adv < 0)))
    live = valid & ~clipped & (adv.abs() > 1e-6)
    assume(clipped.any())
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, eps_low, eps_high)
    loss.backward()
    assert lp.grad[clipped].eq(0).all()
    assert lp.grad[live].ne(0).all()
    # unclipped tokens get the plain surrogate gradient -ratio * A / n
    n = valid.sum()
    torch.testing.assert_close(lp.grad[live], (-ratio * adv / n)[live])
    assert m["clipfrac_low"] + m["clipfrac_high"] == pytest.approx(clipped.sum().item() / n.item())
