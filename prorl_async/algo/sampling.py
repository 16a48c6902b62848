"""Dynamic sampling: keep only groups whose rewards carry a learning signal.

Source: DAPO (Yu et al. 2025, arXiv 2503.14476, sec. 3.2, the constraint
``0 < |{o_i : is_equivalent(a, o_i)}| < G``): a group whose samples are all correct or all
wrong has zero advantage under a group baseline and only dilutes the batch, so it is dropped
and sampling continues until the batch holds ``target`` informative groups. ProRL (Liu et al.
2025, arXiv 2505.24864) and the ProRL v2 blog (2025) use the same filter.

Deviations / choices
--------------------
* "All equal" is judged on the (shaped) scalar rewards with a tolerance
  (``max - min <= tol``, default 1e-6), not on correctness flags, so partial-credit and
  length-shaped rewards are handled the same way.
* Samples marked invalid (grading failed) are ignored in the comparison; a group with fewer
  than 2 valid samples is uninformative (nothing to compare against).
* Non-finite rewards of valid samples raise ``ValueError`` instead of deciding silently.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, Hashable, List, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["DynamicSamplingCollector", "GROUP_COUNTS", "group_counts", "informative_groups", "uninformative_reason"]

DEFAULT_TOL = 1e-6


def informative_groups(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
    tol: float = DEFAULT_TOL,
) -> torch.Tensor:
    """``keep[N]`` (bool): True for every response of a group whose valid rewards differ.

    A group is informative iff it has at least 2 valid responses and
    ``max - min > tol`` over them (DAPO, arXiv 2503.14476, sec. 3.2). The decision is per
    group: every response of an informative group is True (invalid ones included -- mask
    those separately), every response of an uninformative group False.
    """
    import torch  # here, not above: the replay buffer counts groups from this module without torch

    from ._checks import check_finite, check_ndim, check_shape, sample_mask

    fn = "informative_groups"
    check_ndim(fn, "rewards", rewards, 1)
    n = rewards.shape[0]
    check_shape(fn, "group_index", group_index, (n,))
    ok = sample_mask(fn, valid, n, rewards.device)
    check_finite(fn, "rewards", rewards, ok)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)

    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1
    r = rewards.to(torch.float64)
    hi = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((num_groups,), math.inf, dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, inverse, torch.where(ok, r, -math.inf), reduce="amax")
    lo = lo.scatter_reduce(0, inverse, torch.where(ok, r, math.inf), reduce="amin")
    count = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add(
        0, inverse, ok.long()
    )
    informative = (count >= 2) & ((hi - lo) > tol)
    return informative[inverse]


def uninformative_reason(rewards: Sequence[float], valid: Sequence[bool], tol: float) -> Optional[str]:
    """None if informative, else the reason: ``"all_equal"`` or ``"too_few_valid"``."""
    vals = [float(r) for r, v in zip(rewards, valid) if v]
    if len(vals) < 2:
        return "too_few_valid"
    if max(vals) - min(vals) <= tol:
        return "all_equal"
    return None


GROUP_COUNTS = ("groups", "signal_groups", "reward_sum", "samples", "solved_split_groups")


def group_counts(rewards: Sequence[float], valid: Sequence[bool], tol: float = DEFAULT_TOL,
                 reason: Optional[str] = "unknown") -> list:
    """One group's share of its pool's counts (:data:`GROUP_COUNTS`, what the curriculum reads):
    ``[1, has signal, sum of valid rewards, valid samples, splits solved]``. *Signal*: the valid
    rewards differ (what dynamic sampling keeps); *splits solved*: at least one valid sample is
    fully correct (reward >= 1 - tol) and at least one is not, which partial credit alone never makes.
    ``reason``: the group's :func:`uninformative_reason` where the caller has it already."""
    if reason == "unknown":
        reason = uninformative_reason(rewards, valid, tol)
    vals = [float(r) for r, v in zip(rewards, valid) if v]
    solved = sum(r >= 1.0 - tol for r in vals)
    return [1, int(reason is None), float(sum(vals)), len(vals), int(0 < solved < len(vals))]


class DynamicSamplingCollector:
    """Accumulates informative group ids until a batch of ``target_groups`` is full (DAPO).

    ``add(group_id, rewards, valid=None)`` judges one finished group and returns whether it
    was kept; ``ready`` says a batch is available; ``pop()`` returns exactly
    ``target_groups`` ids, oldest first. Pure python: the replay buffer owns the samples,
    this object only decides and counts. Counters: ``groups_seen``, ``groups_kept``,
    ``groups_dropped`` (all-equal rewards), ``groups_dropped_too_few_valid``,
    ``samples_seen``, ``samples_invalid``, ``batches_popped``.
    """

    _COUNTERS = (
        "groups_seen",
        "groups_kept",
        "groups_dropped",
        "groups_dropped_too_few_valid",
        "samples_seen",
        "samples_invalid",
        "batches_popped",
    )

    def __init__(self, target_groups: int, tol: float = DEFAULT_TOL) -> None:
        if int(target_groups) != target_groups or target_groups <= 0:
            raise ValueError(
                "DynamicSamplingCollector: `target_groups` must be a positive integer, "
                f"got {target_groups!r}"
            )
        self.target_groups = int(target_groups)
        self.tol = float(tol)
        self._pending: Deque[Hashable] = deque()
        for name in self._COUNTERS:
            setattr(self, name, 0)

    def add(
        self,
        group_id: Hashable,
        rewards: Sequence[float],
        valid: Optional[Sequence[bool]] = None,
    ) -> bool:
        """Judge one group; keep its id if informative. Returns True when kept."""
        rewards = [float(r) for r in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
        if valid is None:
            flags = [True] * len(rewards)
        else:
            flags = [bool(v) for v in (valid.tolist() if hasattr(valid, "tolist") else valid)]
            if len(flags) != len(rewards):
                raise ValueError(
                    f"DynamicSamplingCollector.add: group {group_id!r} has {len(rewards)} rewards "
                    f"but {len(flags)} validity flags"
                )
        n_bad = sum(1 for r, v in zip(rewards, flags) if v and not math.isfinite(r))
        if n_bad:
            raise ValueError(
                f"DynamicSamplingCollector.add: `rewards` of group {group_id!r} contains "
                f"{n_bad} non-finite values (nan/inf) at valid positions"
            )
        self.groups_seen += 1
        self.samples_seen += len(rewards)
        self.samples_invalid += flags.count(False)
        reason = uninformative_reason(rewards, flags, self.tol)
        if reason == "all_equal":
            self.groups_dropped += 1
            return False
        if reason == "too_few_valid":
            self.groups_dropped_too_few_valid += 1
            return False
        self.groups_kept += 1
        self._pending.append(group_id)
        return True

    @property
    def ready(self) -> bool:
        """True when at least ``target_groups`` informative groups are waiting."""
        return len(self._pending) >= self.target_groups

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pop(self) -> List[Hashable]:
        """Remove and return the oldest ``target_groups`` kept ids; ``RuntimeError`` if not ready."""
        if not self.ready:
            raise RuntimeError(
                f"DynamicSamplingCollector.pop: only {len(self._pending)} of "
                f"{self.target_groups} informative groups collected; check `ready` first"
            )
        self.batches_popped += 1
        return [self._pending.popleft() for _ in range(self.target_groups)]

    def metrics(self) -> Dict[str, float]:
        """Counters plus ``dynsamp/keep_rate`` (kept / seen) and ``dynsamp/pending``."""
        out: Dict[str, float] = {f"dynsamp/{k}": float(getattr(self, k)) for k in self._COUNTERS}
        out["dynsamp/keep_rate"] = self.groups_kept / self.groups_seen if self.groups_seen else 0.0
        out["dynsamp/pending"] = float(len(self._pending))
        return out

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {k: getattr(self, k) for k in self._COUNTERS}
        state.update(target_groups=self.target_groups, tol=self.tol, pending=list(self._pending))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.target_groups = int(state["target_groups"])
        self.tol = float(state["tol"])
        self._pending = deque(state["pending"])
        for name in self._COUNTERS:
            setattr(self, name, int(state[name]))
