"""Training/inference mismatch: how far the learner's logprobs of the sampled tokens are from
the behaviour logprobs the inference engine reported for them.

Measured every step as a correctness gate (LESSONS: mismatch that grows silently; NeMo-RL
#4243, verl #2996, TRL #6789). For tokens sampled from the engine's distribution mu and
scored by the learner's pi, with ``log_r = logp_pi - logp_mu``:

* ``kl_k3``: the k3 estimator of KL(mu || pi) from samples of mu, ``exp(log_r) - log_r - 1``
  (Schulman 2020, "Approximating KL divergence"), token mean; 0 iff the two agree;
* ``logprob_abs_diff_mean`` / ``_max``: mean and max of ``|log_r|``;
* ``is_outside_frac``: fraction of tokens whose importance weight ``exp(log_r)`` falls
  outside ``[is_low, is_high]`` (the band of ``policy_loss``'s tis / icepop correction).

When both sides hold the same weights (the sample's ``policy_version`` equals the learner's
version) any mismatch is numerical (kernels, dtype, sampling post-processing), not
off-policyness; the learner reports those tokens separately from all tokens.

:func:`mismatch_stats` returns additive sufficient statistics so data-parallel ranks can
sum them (and take the max of the max) before :func:`mismatch_metrics` forms the means.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from prorl_async.algo._checks import check_finite, check_shape, valid_positions

_LOG_RATIO_CLAMP = 20.0


def mismatch_stats(learner_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                   is_low: float = 0.0, is_high: float = 2.0) -> torch.Tensor:
    """``float64 [tokens, k3_sum, abs_diff_sum, outside_count, abs_diff_max]`` over valid tokens.

    The first four add across micro-batches and ranks; the last combines by max. Padding may
    hold anything. ``log_r`` is clamped to [-20, 20] inside k3 against overflow.
    """
    fn = "mismatch_stats"
    check_shape(fn, "behavior_logprobs", behavior_logprobs, learner_logprobs.shape)
    check_shape(fn, "mask", mask, learner_logprobs.shape)
    if is_low > is_high:
        raise ValueError(f"{fn}: need is_low <= is_high, got is_low={is_low}, is_high={is_high}")
    valid = valid_positions(mask)
    check_finite(fn, "learner_logprobs", learner_logprobs, valid)
    check_finite(fn, "behavior_logprobs", behavior_logprobs, valid)
    zero = torch.zeros((), dtype=torch.float64, device=learner_logprobs.device)
    log_r = torch.where(valid, learner_logprobs.to(torch.float64) - behavior_logprobs.to(torch.float64), zero)
    clamped = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = torch.where(valid, torch.exp(clamped) - clamped - 1.0, zero)
    w = torch.exp(log_r)
    outside = ((w < is_low) | (w > is_high)) & valid
    absd = log_r.abs()
    return torch.stack([valid.sum().to(torch.float64), k3.sum(), absd.sum(), outside.sum().to(torch.float64),
                        absd.max() if absd.numel() else zero])


def mismatch_metrics(stats: torch.Tensor, prefix: str = "mismatch/") -> Dict[str, float]:
    """Metrics from (possibly summed) :func:`mismatch_stats`: ``{prefix}tokens``, ``kl_k3``,
    ``logprob_abs_diff_mean``, ``logprob_abs_diff_max``, ``is_outside_frac``. With no tokens
    only ``tokens`` (= 0) is reported: nothing was measured, and a 0 would read as agreement."""
    check_shape("mismatch_metrics", "stats", stats, (5,))
    tokens, k3, absd, outside, absmax = (float(x) for x in stats.tolist())
    if not tokens:
        return {f"{prefix}tokens": 0.0}
    return {
        f"{prefix}tokens": tokens,
        f"{prefix}kl_k3": k3 / tokens,
        f"{prefix}logprob_abs_diff_mean": absd / tokens,
        f"{prefix}logprob_abs_diff_max": absmax,
        f"{prefix}is_outside_frac": outside / tokens,
    }


def mismatch(learner_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
             is_low: float = 0.0, is_high: float = 2.0, prefix: str = "mismatch/",
             rows: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """:func:`mismatch_metrics` of one batch; ``rows`` (bool ``[N]``) restricts it to some samples."""
    if rows is not None:
        mask = mask * rows.to(mask.device)[:, None].to(mask.dtype)
    return mismatch_metrics(mismatch_stats(learner_logprobs, behavior_logprobs, mask, is_low, is_high), prefix)
