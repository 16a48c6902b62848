"""The update guard (prorl_async/learners/update_guard.py): Adam's step bound holds for any
gradients, a ruinous update is refused with weights and AdamW state bitwise unchanged, and a
healthy update is the plain AdamW step, taken without a copy."""

from __future__ import annotations

import math

import pytest
import torch

from prorl_async.learners.update_guard import UpdateGuard, adam_step_bound


def test_adam_step_bound_by_hand():
    assert adam_step_bound(0.9, 0.999, 1) == pytest.approx(1.0)  # |g (1-b1)/(1-b1)| / |g| = 1
    # t = 2: 0.1/sqrt(0.001) * sqrt(1-0.999^2)/(1-0.81) * sqrt(1 + 0.81/0.999)
    by_hand = 0.1 / math.sqrt(0.001) * math.sqrt(1 - 0.999 ** 2) / (1 - 0.9 ** 2) * math.sqrt(1 + 0.81 / 0.999)
    assert adam_step_bound(0.9, 0.999, 2) == pytest.approx(by_hand)
    # the limit: (1-b1)/sqrt(1-b2)/sqrt(1-b1^2/b2) = 7.26 for the default betas
    assert adam_step_bound(0.9, 0.999, 100_000) == pytest.approx(0.1 / math.sqrt(0.001) / math.sqrt(1 - 0.81 / 0.999))


@pytest.mark.parametrize("pattern", ["spike_after_zeros", "alternating", "random"])
def test_adamw_never_steps_past_the_bound(pattern):
    """Per coordinate, |delta| <= lr * c(t) at every step of real AdamW (wd=0), for adversarial gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0, eps=1e-12)
    for t in range(1, 60):
        if pattern == "spike_after_zeros":
            g = torch.full((64,), 1e-6) if t < 50 else torch.full((64,), 1e3)
        elif pattern == "alternating":
            g = torch.full((64,), (-1.0) ** t * (10.0 ** (t % 5)))
        else:
            g = torch.randn(64) * 10 ** torch.randint(-4, 4, (64,)).float()
        p.grad = g
        before = p.detach().clone()
        opt.step()
        assert (p.detach() - before).abs().max().item() <= 0.1 * adam_step_bound(0.9, 0.999, t) * (1 + 1e-5), t


def _model_and_opt(lr: float, wd: float = 0.01):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    return model, opt


def _grads(model, seed: int):
    torch.manual_seed(seed)
    model.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())
             if p in opt.state})


def test_a_ruinous_update_is_refused_bitwise():
    model, opt = _model_and_opt(lr=1e-2)
    guard = UpdateGuard(opt, max_update_ratio=1.0)
    _grads(model, 0)
    assert guard.step()  # a healthy first step: AdamW state now exists
    weights, state = _snapshot(model, opt)
    for g in opt.param_groups:
        g["lr"] = 1e30  # finite gradients, finite (1e30-sized) weights after a plain step
    _grads(model, 1)
    assert not guard.step()
    assert guard.refused_total == 1 and guard.copies_total == 1
    after_w, after_s = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(after_w, weights))
    assert after_s.keys() == state.keys()
    assert all(torch.equal(after_s[i][k], state[i][k]) for i in state for k in state[i])
    # what the guard prevented: the same step unguarded leaves finite weights whose next forward is not finite
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max(p.abs().max().item() for p in model.parameters()) > 1e25


def test_a_ruinous_first_update_leaves_no_optimizer_state():
    model, opt = _model_and_opt(lr=1e30)
    guard = UpdateGuard(opt, max_update_ratio=1.0)
    weights = [p.detach().clone() for p in model.parameters()]
    _grads(model, 0)
    assert not guard.step()
    assert len(opt.state) == 0  # as before the step: no moments, no step count
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_a_healthy_update_is_plain_adamw_without_a_copy():
    model, opt = _model_and_opt(lr=1e-3)
    ref_model, ref_opt = _model_and_opt(lr=1e-3)
    guard = UpdateGuard(opt, max_update_ratio=1.0)
    for step in range(30):
        _grads(model, step)
        _grads(ref_model, step)
        assert guard.step()
        ref_opt.step()
    assert guard.copies_total == 0 and guard.refused_total == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_ratio_zero_turns_the_guard_off():
    model, opt = _model_and_opt(lr=1e30)
    guard = UpdateGuard(opt, max_update_ratio=0.0)
    _grads(model, 0)
    assert guard.step() and guard.copies_total == 0
    assert max(p.abs().max().item() for p in model.parameters()) > 1e25
