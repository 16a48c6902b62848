"""Reward shaping on the scalar per-response reward, applied before advantages.

Sources, formula by formula
---------------------------
* ``cosine_length_reward`` -- the cosine length-scaling reward of Yeo et al. 2025,
  "Demystifying long chain-of-thought reasoning in LLMs" (arXiv 2502.03373, the
  "cosine length-scaling reward", function CosFn)::

      CosFn(t, T, eta_min, eta_max) = eta_min + 0.5 * (eta_max - eta_min) * (1 + cos(t * pi / T))

  with t the generation length and T the maximum length. A correct answer gets
  ``(eta_max, eta_min) = (r0_c, rL_c)`` and a wrong one ``(r0_w, rL_w)``: each pair here is
  ``(value at length 0, value at max_length)``, so::

      reward = v_end + 0.5 * (v_0 - v_end) * (1 + cos(pi * min(L, max_length) / max_length))

  Defaults ``r_correct = (1.0, 0.5)`` (shorter correct answers earn more) and
  ``r_wrong = (-0.5, 0.0)`` (a wrong answer is punished less the longer it reasons), the
  same shape as the paper's (+2, +1) / (-10, 0) on the ProRL v2 reward scale.
* ``LengthPenaltySchedule`` -- the ProRL v2 blog (NVIDIA, 2025) switches the length
  penalty on and off in cycles; here: inactive before ``start_step``, then ``on_steps`` on,
  ``off_steps`` off, repeating.
* ``soft_overlong_penalty`` -- DAPO soft overlong punishment (Yu et al. 2025,
  arXiv 2503.14476, sec. 3.4), with ``L_cache = buffer``::

      R(L) = 0                                      if L <= L_max - L_cache
           = ((L_max - L_cache) - L) / L_cache      if L_max - L_cache < L <= L_max
           = -1                                     if L > L_max

  times ``factor``. It is *added* to the verifier reward, as in DAPO.
* ``filter_overlong`` -- DAPO overlong filtering (sec. 3.4): truncated samples are loss-masked.
* overlong mode ``"zero"`` -- the ProRL v2 configs' "stop properly penalty" with coefficient 0
  (NeMo-RL ``reward_shaping.stop_properly_penalty_coef: 0.0``, OpenRLHF
  ``--stop_properly_penalty_coef 0.0``; DLER, arXiv 2510.15110): a truncated response's reward
  is scaled by the coefficient, i.e. set to 0, after any length shaping.

Deviations / choices
--------------------
* Yeo et al. give responses that hit the limit a separate "exceed" reward r_e; here
  ``cosine_length_reward`` clamps L at ``max_length`` (so a truncated response scores the
  ``v_end`` of its pair) and overlong handling is left to ``overlong_mode``.
* ``shape_rewards`` replaces the verifier reward by the cosine reward (built from the
  ``correct`` flag) only while the schedule is active; graded-invalid samples (``valid``
  False) keep their raw reward untouched, are never shaped, and get ``loss_keep`` False.
* ``soft_overlong_penalty`` with ``buffer == 0`` degenerates to a step: 0 up to
  ``max_length``, ``-factor`` beyond.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from ._checks import check_finite, check_ndim, check_shape, sample_mask, valid_positions
from .choices import OVERLONG_MODES

__all__ = [
    "LengthPenaltySchedule",
    "OVERLONG_MODES",
    "cosine_length_reward",
    "filter_overlong",
    "shape_rewards",
    "soft_overlong_penalty",
]

Pair = Tuple[float, float]


def cosine_length_reward(
    correct: torch.Tensor,
    lengths: torch.Tensor,
    max_length: int,
    r_correct: Pair = (1.0, 0.5),
    r_wrong: Pair = (-0.5, 0.0),
) -> torch.Tensor:
    """Cosine length reward of Yeo et al. 2025 (arXiv 2502.03373, CosFn), float32 ``[N]``.

    ``reward = v_end + 0.5 * (v_0 - v_end) * (1 + cos(pi * min(L, max_length) / max_length))``
    with ``(v_0, v_end) = r_correct`` where ``correct`` else ``r_wrong``.
    """
    fn = "cosine_length_reward"
    check_ndim(fn, "correct", correct, 1)
    check_shape(fn, "lengths", lengths, correct.shape)
    if max_length <= 0:
        raise ValueError(f"{fn}: `max_length` must be positive, got {max_length}")
    check_finite(fn, "lengths", lengths)
    if bool((lengths < 0).any()):
        raise ValueError(f"{fn}: `lengths` must be non-negative")
    for name, pair in (("r_correct", r_correct), ("r_wrong", r_wrong)):
        if len(pair) != 2:
            raise ValueError(
                f"{fn}: `{name}` must be a pair (value at length 0, value at max_length), "
                f"got {pair!r}"
            )
    is_correct = valid_positions(correct)
    length = lengths.to(torch.float64).clamp(max=float(max_length))
    progress = 0.5 * (1.0 + torch.cos(math.pi * length / max_length))  # 1 at L=0, 0 at L=max
    # row 0: wrong, row 1: correct; columns: (v_0, v_end)
    table = torch.tensor([list(r_wrong), list(r_correct)], dtype=torch.float64, device=lengths.device)
    v0, v_end = table[is_correct.long()].unbind(-1)
    return (v_end + (v0 - v_end) * progress).to(torch.float32)


class LengthPenaltySchedule:
    """On/off cycles for the length penalty (ProRL v2 blog, 2025).

    ``active(step)``: False before ``start_step``; then True for ``on_steps`` steps, False
    for ``off_steps`` steps, repeating. ``off_steps == 0`` means always on after the start;
    ``on_steps == 0`` means never on. The (small) state is saved with the checkpoint so a
    resumed run continues the same cycle.
    """

    def __init__(self, on_steps: int, off_steps: int, start_step: int = 0) -> None:
        for name, v in (("on_steps", on_steps), ("off_steps", off_steps), ("start_step", start_step)):
            if int(v) != v or v < 0:
                raise ValueError(
                    f"LengthPenaltySchedule: `{name}` must be a non-negative integer, got {v!r}"
                )
        self.on_steps = int(on_steps)
        self.off_steps = int(off_steps)
        self.start_step = int(start_step)

    def active(self, step: int) -> bool:
        """Whether the penalty applies at training step ``step``."""
        if step < self.start_step or self.on_steps == 0:
            return False
        if self.off_steps == 0:
            return True
        return (step - self.start_step) % (self.on_steps + self.off_steps) < self.on_steps

    def state_dict(self) -> Dict[str, int]:
        return {"on_steps": self.on_steps, "off_steps": self.off_steps, "start_step": self.start_step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        restored = LengthPenaltySchedule(state["on_steps"], state["off_steps"], state["start_step"])
        self.on_steps = restored.on_steps
        self.off_steps = restored.off_steps
        self.start_step = restored.start_step

    def __repr__(self) -> str:
        return (
            f"LengthPenaltySchedule(on_steps={self.on_steps}, off_steps={self.off_steps}, "
            f"start_step={self.start_step})"
        )


def soft_overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, sec. 3.4): float32 ``[N]`` in [-factor, 0].

    0 up to ``max_length - buffer``, then linear down to ``-factor`` at ``max_length``,
    ``-factor`` beyond.
    """
    fn = "soft_overlong_penalty"
    if max_length <= 0:
        raise ValueError(f"{fn}: `max_length` must be positive, got {max_length}")
    if not 0 <= buffer <= max_length:
        raise ValueError(f"{fn}: `buffer` must be in [0, max_length={max_length}], got {buffer}")
    check_finite(fn, "lengths", lengths)
    length = lengths.to(torch.float64)
    start = float(max_length - buffer)
    if buffer == 0:
        penalty = torch.where(length > max_length, -1.0, 0.0).to(torch.float64)
    else:
        penalty = ((start - length) / buffer).clamp(min=-1.0, max=0.0)
    return (penalty * factor).to(torch.float32)


def filter_overlong(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: the loss mask with every row of a truncated response zeroed."""
    fn = "filter_overlong"
    check_ndim(fn, "mask", mask, 2)
    check_shape(fn, "truncated", truncated, mask.shape[:1])
    drop = valid_positions(truncated)[:, None]
    return torch.where(drop, torch.zeros((), dtype=mask.dtype, device=mask.device), mask)


def _cosine_params(cosine: Union[bool, Mapping[str, Any], None]) -> Optional[Dict[str, Pair]]:
    if cosine is None or cosine is False:
        return None
    if cosine is True:
        return {}
    if isinstance(cosine, Mapping):
        unknown = set(cosine) - {"r_correct", "r_wrong"}
        if unknown:
            raise ValueError(
                f"shape_rewards: unknown `cosine` keys {sorted(unknown)}; valid: r_correct, r_wrong"
            )
        return {k: tuple(v) for k, v in cosine.items()}
    raise ValueError(
        f"shape_rewards: `cosine` must be a bool or a dict with r_correct/r_wrong, got {cosine!r}"
    )


def shape_rewards(
    raw_rewards: torch.Tensor,
    correct: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    max_length: int,
    step: int,
    schedule: Optional[LengthPenaltySchedule] = None,
    cosine: Union[bool, Mapping[str, Any], None] = True,
    overlong_mode: str = "none",
    overlong_buffer: int = 0,
    overlong_factor: float = 1.0,
    valid: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """All reward shaping of one batch in one call: ``(rewards[N] float32, loss_keep[N] bool, metrics)``.

    1. Length penalty: if ``cosine`` is enabled (True, or a dict of ``r_correct`` /
       ``r_wrong``) and ``schedule`` is None or ``schedule.active(step)``, valid samples get
       ``cosine_length_reward(correct, lengths, max_length, ...)`` instead of their raw
       reward; otherwise the raw reward is kept.
    2. Overlong (``overlong_mode``): ``"filter"`` sets ``loss_keep`` False for truncated
       samples (apply with :func:`filter_overlong`); ``"soft"`` adds
       ``soft_overlong_penalty(lengths, max_length, overlong_buffer, overlong_factor)``;
       ``"zero"`` sets the reward of truncated samples to 0; ``"none"`` does nothing.

    ``valid`` (bool, default all True) marks samples whose grading succeeded; invalid ones
    keep their raw reward (possibly NaN), are not shaped, and get ``loss_keep`` False.
    Metrics (means over valid samples): ``len/penalty_active``, ``len/truncated_frac``,
    ``len/mean_length``, ``len/filtered_frac``, ``len/overlong_penalty_mean``,
    ``reward/raw_mean``, ``reward/shaped_mean``, ``reward/invalid_frac``.
    """
    fn = "shape_rewards"
    check_ndim(fn, "raw_rewards", raw_rewards, 1)
    n = raw_rewards.shape[0]
    check_shape(fn, "correct", correct, (n,))
    check_shape(fn, "lengths", lengths, (n,))
    check_shape(fn, "truncated", truncated, (n,))
    if overlong_mode not in OVERLONG_MODES:
        raise ValueError(
            f"{fn}: unknown overlong_mode {overlong_mode!r}; valid choices: {', '.join(OVERLONG_MODES)}"
        )
    ok = sample_mask(fn, valid, n, raw_rewards.device)
    check_finite(fn, "raw_rewards", raw_rewards, ok)
    is_truncated = valid_positions(truncated)

    params = _cosine_params(cosine)
    penalty_active = params is not None and (schedule is None or schedule.active(step))
    raw = raw_rewards.to(torch.float32)
    rewards = raw
    if penalty_active:
        cos = cosine_length_reward(correct, lengths, max_length, **params)
        rewards = torch.where(ok, cos, raw)

    overlong = torch.zeros(n, dtype=torch.float32, device=raw.device)
    if overlong_mode == "soft":
        overlong = soft_overlong_penalty(lengths, max_length, overlong_buffer, overlong_factor)
        rewards = torch.where(ok, rewards + overlong, rewards)
    elif overlong_mode == "zero":
        rewards = torch.where(ok & is_truncated, torch.zeros_like(rewards), rewards)

    loss_keep = ok.clone()
    if overlong_mode == "filter":
        loss_keep &= ~is_truncated

    n_ok = max(int(ok.sum().item()), 1)

    def mean_ok(x: torch.Tensor) -> float:
        return torch.where(ok, x.to(torch.float64), 0.0).sum().item() / n_ok

    metrics = {
        "len/penalty_active": float(penalty_active),
        "len/truncated_frac": mean_ok(is_truncated),
        "len/mean_length": mean_ok(lengths),
        "len/filtered_frac": mean_ok(ok & ~loss_keep),
        "len/overlong_penalty_mean": mean_ok(overlong),
        "reward/raw_mean": mean_ok(raw),
        "reward/shaped_mean": mean_ok(rewards),
        "reward/invalid_frac": (n - int(ok.sum().item())) / max(n, 1),
    }
    return rewards, loss_keep, metrics
