"""Refuse an AdamW update that would wreck the weights, before anything sees them.

The non-finite rule (:mod:`prorl_async.learners.core`) skips an update whose loss or gradient
norm is not finite. A finite gradient can still give a ruinous update: with ``train.lr=1e30``
AdamW moves every weight by about 1e30, the weights stay finite, and only the *next* step's
loss is NaN, so the "last good" weights a stop would keep are already wrecked. This guard
refuses such an update in the step that makes it, before it is broadcast or checkpointed.

The rule, and why it is cheap:

* Adam's per-coordinate step is bounded by scalars known before the step. With
  ``m_t = (1-b1) sum_i b1^(t-i) g_i`` and ``v_t = (1-b2) sum_i b2^(t-i) g_i^2``, Cauchy-Schwarz gives
  ``|m_hat/sqrt(v_hat)| <= c(t) = (1-b1)/sqrt(1-b2) * sqrt(1-b2^t)/(1-b1^t) * sqrt(sum_{k<t} (b1^2/b2)^k)``
  (the bias-corrected form of Kingma & Ba 2015, section 2.1, "the effective step is bounded";
  c(1) = 1, c(inf) = 7.3 for the default betas). With AdamW's decoupled decay (Loshchilov &
  Hutter 2019), ``||delta|| <= lr * (c(t) * sqrt(P) + wd * ||theta||)`` over the P parameters.
* Only when that bound exceeds ``max_update_ratio * ||theta||`` can the step be ruinous; then,
  and only then, the weights and the optimizer state are copied before the step, the exact
  ``||delta||`` is measured after it, and a step that moved the weights by more than
  ``max_update_ratio * ||theta||`` (or made one non-finite) is undone from the copy: weights
  and AdamW state bitwise as before, counted as a skipped update. In a healthy run (bound /
  norm about 1e-4 to 1e-2) nothing is copied; ``||theta||`` is a lower bound kept without a
  pass over the weights (it shrinks by at most the bound per step) and measured again, one
  norm pass, only when it has fallen to half of the last measured value (AdamW's decay term
  uses an upper bound kept the same way).

Deviation: the guard covers ``torch.optim.AdamW`` / ``Adam`` (the torch learner's optimizer);
the DeepSpeed learner's engine step is not guarded (its skipped steps follow DeepSpeed's
overflow check only).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """``c(t)``: a strict bound on ``|m_hat / sqrt(v_hat)|`` at Adam step ``t`` (1-based), any gradients."""
    r = beta1 * beta1 / beta2
    geo = float(t) if abs(r - 1.0) < 1e-12 else (1.0 - r ** t) / (1.0 - r)
    return (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t) * math.sqrt(geo)


def params_norm(params: list[torch.Tensor]) -> float:
    """Global L2 norm of a list of tensors (one read pass)."""
    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in params])))


class UpdateGuard:
    """Wraps ``optimizer.step()``: :meth:`step` returns False (and leaves weights and optimizer
    state as they were) for an update larger than ``max_update_ratio`` times the weights' norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_update_ratio: float):
        self.opt, self.ratio = optimizer, max_update_ratio
        self.norm_lb: Optional[float] = None    # a lower bound of ||theta|| (None: measure it)
        self.norm_ub: float = 0.0               # an upper bound of ||theta||
        self.measured: float = 0.0              # the last measured ||theta||
        self.refused_total = 0
        self.copies_total = 0                   # steps that needed the pre-step copy

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def forget_norm(self) -> None:
        """The weights changed outside the optimizer (a checkpoint load): measure again."""
        self.norm_lb = None

    def bound(self) -> float:
        """Upper bound of the coming step's ``||delta||``, from scalars only (see the module docstring)."""
        total = 0.0
        for g in self.opt.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            if not ps:
                continue
            st = self.opt.state.get(ps[0], {})
            t = int(st["step"]) + 1 if "step" in st else 1
            b1, b2 = g["betas"]
            n = sum(p.numel() for p in ps)
            total += g["lr"] * (adam_step_bound(b1, b2, t) * math.sqrt(n) + g.get("weight_decay", 0.0) * self.norm_ub)
        return total

    def step(self) -> bool:
        """One optimizer step, or none: True if applied."""
        if self.ratio <= 0:
            self.opt.step()
            return True
        if self.norm_lb is None or self.norm_lb < 0.5 * self.measured or self.norm_ub > 2.0 * self.measured:
            self.measured = self.norm_lb = self.norm_ub = params_norm(self.params())
        bound, limit = self.bound(), self.ratio * self.norm_lb
        if math.isfinite(bound) and bound <= limit:  # cannot be ruinous: no copy
            self.opt.step()
            self.norm_lb, self.norm_ub = max(0.0, self.norm_lb - bound), self.norm_ub + bound
            return True
        return self._checked_step(limit)

    @torch.no_grad()
    def _checked_step(self, limit: float) -> bool:
        self.copies_total += 1
        params = self.params()
        before = [p.detach().clone() for p in params]
        state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.opt.state[p].items()}
                 for p in params if p in self.opt.state}
        self.opt.step()
        delta = params_norm([p.detach() - b for p, b in zip(params, before)])
        if math.isfinite(delta) and delta <= limit:
            self.measured = self.norm_lb = self.norm_ub = params_norm(params)
            return True
        for p, b in zip(params, before):  # undo: weights and optimizer state bitwise as before
            p.copy_(b)
        for p in params:
            if p in state:
                self.opt.state[p] = state[p]
            else:
                self.opt.state.pop(p, None)
        self.refused_total += 1
        return False
