"""Advantage estimators for outcome rewards (one scalar reward per sampled response).

Shapes: ``N`` responses, ``T`` response tokens (right-padded); ``mask`` is 1.0 on valid
response tokens, 0.0 on padding; ``group_index`` is an int64 group id per response (the n
samples of one prompt share an id; ids are arbitrary, not necessarily contiguous).
Every estimator returns a ``[N, T]`` tensor holding the response's advantage on each valid
token and exactly 0 on padding.

Sources, formula by formula
---------------------------
* ``reinforce_pp_baseline`` -- REINFORCE++ with a group baseline, "REINFORCE++-baseline"
  (Hu 2025, arXiv 2501.03262, and the OpenRLHF implementation it describes), the
  estimator ProRL v2 uses (NVIDIA ProRL v2 blog, 2025; ProRL, Liu et al. 2025,
  arXiv 2505.24864):

      A_i     = r_i - mean_{j in group(i)} r_j                 (local, group baseline)
      A_{i,t} = A_i for every valid token t of response i      (broadcast)
      Â_{i,t} = (A_{i,t} - mu) / sqrt(sigma^2 + eps)           (global batch whitening)

  where mu and sigma^2 are the mean and *population* variance over all valid tokens of the
  whole global batch (all learner ranks). The reduction is exposed as
  :func:`whitening_stats` / :func:`whiten` and the ``stats_reduce`` hook, so several
  data-parallel ranks reproduce exactly what one rank would compute on the whole batch:
  each rank computes ``[sum, sum_sq, count]`` in float64, the hook sums them (e.g. a
  ``torch.distributed.all_reduce``), and every rank whitens with the global moments.
* ``grpo`` -- GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, sec. 4.1.2), as used
  in ProRL (Liu et al. 2025): ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased
  (n-1) group standard deviation, broadcast to valid tokens.
* ``rloo`` -- REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024,
  arXiv 2402.14740): ``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)``.

Deviations / choices
--------------------
* Group statistics are computed in float64 and the result cast back to the reward dtype.
* A group with fewer than 2 (valid) members has no baseline to compare against: its
  advantage is 0 under all estimators (GRPO's unbiased std would be NaN; RLOO's
  leave-one-out mean undefined). REINFORCE++-baseline gives it 0 before whitening (then the
  whitening shift applies like to any other token).
* Optional ``valid[N]`` (bool): responses whose grading failed are excluded from group
  statistics and whitening and get advantage 0 everywhere; their rewards are not inspected
  (they may be NaN). This is an addition for ProRL-async's "invalid is not wrong" rule.
* A response whose mask row is all zero (e.g. filtered as overlong) still counts in its
  group's baseline (its reward is real), it just contributes no tokens -- as in DAPO's
  overlong filtering, which masks the loss and leaves the group statistics alone.
* Non-finite rewards at valid responses raise ``ValueError`` instead of propagating NaN.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ._checks import (
    check_finite,
    check_ndim,
    check_shape,
    float_dtype,
    sample_mask,
    valid_positions,
)

StatsReduce = Callable[[torch.Tensor], Optional[torch.Tensor]]

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "advantage_metrics",
    "compute_advantages",
    "grpo",
    "reinforce_pp_baseline",
    "rloo",
    "whiten",
    "whitening_stats",
]


# --------------------------------------------------------------------------------------
# shared preparation
# --------------------------------------------------------------------------------------


class _Groups:
    """Per-response group membership and float64 per-group moments over valid responses."""

    def __init__(
        self,
        fn: str,
        rewards: torch.Tensor,
        group_index: torch.Tensor,
        mask: torch.Tensor,
        valid: Optional[torch.Tensor],
    ) -> None:
        check_ndim(fn, "rewards", rewards, 1)
        n = rewards.shape[0]
        check_shape(fn, "group_index", group_index, (n,))
        if group_index.is_floating_point() or group_index.dtype == torch.bool:
            raise ValueError(
                f"{fn}: `group_index` must be an integer tensor, got {group_index.dtype}"
            )
        check_ndim(fn, "mask", mask, 2)
        if mask.shape[0] != n:
            raise ValueError(
                f"{fn}: `mask` has {mask.shape[0]} rows but `rewards` has {n} entries"
            )
        sample_valid = sample_mask(fn, valid, n, rewards.device)
        check_finite(fn, "rewards", rewards, sample_valid)

        self.out_dtype = float_dtype(rewards)
        self.sample_valid = sample_valid
        self.token_valid = valid_positions(mask) & sample_valid[:, None]
        _, self.inverse = torch.unique(group_index, return_inverse=True)
        num_groups = int(self.inverse.max().item()) + 1 if n else 0

        w = sample_valid.to(torch.float64)
        self.r = torch.where(sample_valid, rewards.to(torch.float64), 0.0)
        zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)
        self.count = zeros.index_add(0, self.inverse, w)
        self.sum = zeros.index_add(0, self.inverse, self.r)
        self.mean = self.sum / self.count.clamp(min=1.0)

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        """Gather a per-group tensor to responses."""
        return x[self.inverse]

    def broadcast(self, adv: torch.Tensor) -> torch.Tensor:
        """Per-response advantage -> ``[N, T]``, 0 on padding and invalid responses."""
        full = adv[:, None].expand(self.token_valid.shape)
        return torch.where(self.token_valid, full, 0.0).to(self.out_dtype)


# --------------------------------------------------------------------------------------
# global-batch whitening (distributable)
# --------------------------------------------------------------------------------------


def whitening_stats(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics ``tensor([sum, sum_sq, count])`` (float64) of ``values`` over valid tokens.

    Summing these across data-parallel ranks (``torch.distributed.all_reduce``, SUM) gives
    the statistics of the whole global batch; pass the sum to :func:`whiten`.
    Source: the global batch normalisation of REINFORCE++ (Hu 2025, arXiv 2501.03262).
    """
    fn = "whitening_stats"
    check_shape(fn, "mask", mask, values.shape)
    valid = valid_positions(mask)
    check_finite(fn, "values", values, valid)
    v = torch.where(valid, values.to(torch.float64), 0.0)
    return torch.stack([v.sum(), (v * v).sum(), valid.sum().to(torch.float64)])


def whiten(
    values: torch.Tensor, mask: torch.Tensor, stats: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` on valid tokens, 0 on padding.

    ``stats`` is ``[sum, sum_sq, count]`` as returned by :func:`whitening_stats` (possibly
    summed over ranks); ``mean = sum / count`` and the population variance
    ``var = sum_sq / count - mean^2`` (clamped at 0 against rounding). With ``count == 0``
    the result is all zeros. Source: REINFORCE++ (Hu 2025, arXiv 2501.03262).
    """
    fn = "whiten"
    check_shape(fn, "mask", mask, values.shape)
    check_shape(fn, "stats", stats, (3,))
    if eps < 0:
        raise ValueError(f"{fn}: `eps` must be >= 0, got {eps}")
    valid = valid_positions(mask)
    stats = stats.to(device=values.device, dtype=torch.float64)
    total, total_sq, count = stats[0], stats[1], stats[2]
    if count.item() <= 0:
        return torch.zeros_like(values, dtype=float_dtype(values))
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0.0)
    out = (values.to(torch.float64) - mean) / torch.sqrt(var + eps)
    return torch.where(valid, out, 0.0).to(float_dtype(values))


# --------------------------------------------------------------------------------------
# estimators
# --------------------------------------------------------------------------------------


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    stats_reduce: Optional[StatsReduce] = None,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline, broadcast, then global-batch whitening.

    ``A_i = r_i - mean_{group(i)} r``; ``A_{i,t} = A_i`` on valid tokens; then
    ``(A - mu) / sqrt(sigma^2 + eps)`` with mu, sigma^2 the mean / population variance over
    valid tokens (Hu 2025, arXiv 2501.03262; ProRL v2 blog, 2025).

    ``stats_reduce``: optional callable applied to this rank's float64
    ``[sum, sum_sq, count]``; it must return the summed tensor or reduce in place and return
    None (``lambda s: torch.distributed.all_reduce(s)`` works as is). With it, each rank
    gets exactly the advantages one rank would compute on the concatenated batch.
    Groups must not straddle ranks (the group baseline is computed locally).
    """
    fn = "reinforce_pp_baseline"
    g = _Groups(fn, rewards, group_index, mask, valid)
    centered = torch.where(g.sample_valid, g.r - g.per_sample(g.mean), 0.0)
    x = centered[:, None].expand(g.token_valid.shape)
    stats = whitening_stats(x, g.token_valid)
    if stats_reduce is not None:
        reduced = stats_reduce(stats)
        if isinstance(reduced, torch.Tensor):
            stats = reduced
    return whiten(x, g.token_valid, stats, eps).to(g.out_dtype)


def grpo(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-6,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """GRPO: ``(r_i - mean_g) / (std_g + eps)`` with unbiased group std, broadcast to tokens.

    Shao et al. 2024 (arXiv 2402.03300), outcome supervision; used by ProRL
    (Liu et al. 2025, arXiv 2505.24864). A group with < 2 valid members gets 0.
    """
    fn = "grpo"
    g = _Groups(fn, rewards, group_index, mask, valid)
    dev = torch.where(g.sample_valid, g.r - g.per_sample(g.mean), 0.0)
    zeros = torch.zeros_like(g.count)
    sq = zeros.index_add(0, g.inverse, dev * dev)
    std = torch.where(g.count > 1, torch.sqrt(sq / (g.count - 1).clamp(min=1.0)), 0.0)
    n_per = g.per_sample(g.count)
    denom = g.per_sample(std) + eps
    # all-equal group with eps=0: dev is 0 there, report 0 rather than 0/0
    adv = torch.where((n_per > 1) & (denom > 0), dev / denom, 0.0)
    return g.broadcast(adv)


def rloo(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RLOO: ``r_i - mean of the other members of the group``, broadcast to tokens.

    Kool et al. 2019; Ahmadian et al. 2024 (arXiv 2402.14740). A group with < 2 valid
    members gets 0.
    """
    fn = "rloo"
    g = _Groups(fn, rewards, group_index, mask, valid)
    n_per = g.per_sample(g.count)
    loo_mean = (g.per_sample(g.sum) - g.r) / (n_per - 1).clamp(min=1.0)
    adv = torch.where(g.sample_valid & (n_per > 1), g.r - loo_mean, 0.0)
    return g.broadcast(adv)


ADVANTAGE_ESTIMATORS: Dict[str, Callable[..., torch.Tensor]] = {
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo": grpo,
    "rloo": rloo,
}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    **kw,
) -> torch.Tensor:
    """Dispatch to the estimator called ``name`` (see :data:`ADVANTAGE_ESTIMATORS`).

    Extra keyword arguments go to the estimator (``eps``, ``valid``, ``stats_reduce`` for
    ``reinforce_pp_baseline``). Raises ``ValueError`` naming the valid choices.
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        choices = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(
            f"compute_advantages: unknown advantage estimator {name!r}; valid choices: {choices}"
        ) from None
    return estimator(rewards, group_index, mask, **kw)


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """Logging summary over valid tokens: ``adv/mean``, ``adv/std``, ``adv/min``, ``adv/max``."""
    valid = valid_positions(mask)
    vals = advantages[valid].detach().to(torch.float64)
    if vals.numel() == 0:
        return {"adv/mean": 0.0, "adv/std": 0.0, "adv/min": 0.0, "adv/max": 0.0}
    return {
        "adv/mean": vals.mean().item(),
        "adv/std": vals.std(unbiased=False).item(),
        "adv/min": vals.min().item(),
        "adv/max": vals.max().item(),
    }
