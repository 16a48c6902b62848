"""Policy-gradient loss, KL penalty, and logit utilities for the learner.

Shapes: ``[N, T]`` per-token tensors (N responses, T right-padded response tokens);
``mask`` is 1.0 on valid response tokens. Padding may hold anything (NaN, inf): it is
excluded with ``torch.where`` (never by multiplying, which would turn ``nan * 0`` into NaN)
and never inspected by the non-finite checks.

Sources, formula by formula
---------------------------
``policy_loss`` -- importance-corrected PPO-Clip with Clip-Higher and token-level mean:

* PPO-Clip surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7), per token::

      ratio_t = exp(logp_theta_t - logp_old_t)
      l_t     = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)

* Clip-Higher, ``eps_high > eps_low`` (DAPO, Yu et al. 2025, arXiv 2503.14476, sec. 3.1),
  kept by ProRL (Liu et al. 2025, arXiv 2505.24864) and ProRL v2 (NVIDIA blog, 2025); the
  recipe this project follows uses eps_low = 0.2, eps_high = 0.27 (the defaults here).
* Token-level aggregation: ``sum_t mask_t * l_t / num_tokens`` (DAPO sec. 3.3),
  with ``num_tokens`` the valid-token count of the whole *global* batch when the learner
  passes it, so micro-batches and ranks add up to the token mean of the batch.
* Decoupled behaviour correction: rollouts come from a behaviour policy mu (an inference
  engine holding possibly stale weights), so the proximal/old policy pi_old and mu differ.
  Each token is weighted by the detached ``w_t = exp(logp_old_t - logp_mu_t)``, as in the
  decoupled PPO objective of AReaL (Fu et al. 2025, arXiv 2505.24298, "decoupled PPO objective":
  ``pi_prox / pi_behav`` times the clipped surrogate against ``pi_prox``, where our
  ``old_logprobs`` play pi_prox and ``behavior_logprobs`` pi_behav), with

  - ``is_mode="tis"``: truncated importance sampling, ``w <- clamp(w, is_low, is_high)``
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training", where the weight is truncated from above at C);
  - ``is_mode="icepop"``: ``w <- w if is_low <= w <= is_high else 0`` -- tokens whose
    training/inference mismatch falls outside the band are dropped from the gradient
    (IcePop, Ling team 2025, described in the Ring-1T report "Every Step
    Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model");
  - ``is_mode="none"``: ``w = 1`` (plain PPO against pi_old).

``kl_penalty`` -- per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta
(Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), with
``log_r = logp_ref - logp``:

* ``k1 = -log_r = logp - logp_ref``
* ``k2 = 0.5 * log_r^2``
* ``k3 = exp(log_r) - log_r - 1``

ProRL (Liu et al. 2025) keeps a KL penalty to a periodically reset reference;
the recipe this project follows uses k2 with coefficient 1e-4. The learner adds
``kl_coef * masked_mean(kl_penalty(...), mask, num_tokens)``.

Deviations / choices
--------------------
* ``log ratio`` (and ``log_r`` in k3) is clamped to [-20, 20] before ``exp``, so a wildly
  off token cannot overflow to ``inf`` and turn the backward pass into NaN (``0 * inf``).
  This only changes values for ratios beyond e^20 ~ 4.9e8.
* Tokens zeroed by icepop still count in ``num_tokens`` (the denominator stays the number
  of valid tokens, so masking a token removes its gradient without re-weighting others).
* The IS weight is computed under ``no_grad``: no gradient reaches ``behavior_logprobs``;
  gradients reach ``old_logprobs`` only through ``ratio`` if the caller lets them.
* ``is_weight_mean`` / ``is_weight_max`` report the *raw* weight ``exp(old - behavior)``
  before truncation/masking (the diagnostic of train/inference mismatch); without
  ``behavior_logprobs`` they are 1.0.
* Non-finite inputs at valid positions raise ``ValueError`` naming the tensor.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from ._checks import check_finite, check_shape, valid_positions
from .choices import IS_MODES, KL_KINDS

__all__ = [
    "IS_MODES",
    "KL_KINDS",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "policy_loss",
]

_LOG_RATIO_CLAMP = 20.0

NumTokens = Optional[Union[int, float, torch.Tensor]]


def _denominator(fn: str, mask: torch.Tensor, num_tokens: NumTokens) -> torch.Tensor:
    """Token count to divide by: the local valid count (min 1) or the caller's global count."""
    if num_tokens is None:
        return valid_positions(mask).sum().clamp(min=1).to(torch.float32)
    denom = torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device)
    if denom.numel() != 1 or not bool(denom.reshape(()) > 0):
        raise ValueError(
            f"{fn}: `num_tokens` must be a positive scalar, got {num_tokens!r}"
        )
    return denom.reshape(())


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, num_tokens: NumTokens = None
) -> torch.Tensor:
    """``sum(x * mask) / num_tokens`` (token-level mean; DAPO, arXiv 2503.14476, sec. 3.3).

    ``num_tokens`` defaults to the number of valid tokens in ``mask`` (at least 1, so an
    empty mask gives 0, not NaN). Padding is dropped with ``torch.where``, so garbage there
    never leaks in.
    """
    fn = "masked_mean"
    check_shape(fn, "mask", mask, x.shape)
    valid = valid_positions(mask)
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / _denominator(fn, mask, num_tokens).to(total.dtype)


def importance_weight(raw: torch.Tensor, is_mode: str, is_low: float, is_high: float) -> torch.Tensor:
    """The weight of a token's loss from its raw weight ``exp(old - behaviour)``: truncated to
    [is_low, is_high] (``tis``), zeroed outside it (``icepop``), or 1 (``none``)."""
    if is_mode == "none":
        return torch.ones_like(raw)
    if is_mode == "tis":
        return raw.clamp(is_low, is_high)
    return torch.where((raw < is_low) | (raw > is_high), torch.zeros_like(raw), raw)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.27,
    behavior_logprobs: Optional[torch.Tensor] = None,
    is_mode: str = "tis",
    is_low: float = 0.0,
    is_high: float = 2.0,
    num_tokens: NumTokens = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Importance-corrected PPO-Clip with Clip-Higher, token-level mean.

    Per valid token (see the module docstring for sources)::

        ratio = exp(logprobs - old_logprobs)
        l     = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        w     = exp(old_logprobs - behavior_logprobs)   # detached; 1 if no behaviour logprobs
        w     = clamp(w, is_low, is_high)               # "tis"
              | w * [is_low <= w <= is_high]            # "icepop"
              | 1                                       # "none"
        loss  = sum(w * l over valid tokens) / num_tokens

    Returns ``(loss, metrics)``; metrics are python floats, masked means over the valid
    tokens of this call: ``clipfrac_low`` (ratio < 1 - eps_low and A < 0: the clipped
    branch is active below), ``clipfrac_high`` (ratio > 1 + eps_high and A > 0),
    ``approx_kl`` (mean of ``(ratio - 1) - log ratio``, the k3 estimator of
    KL(pi_old || pi_theta)), ``ratio_mean``, ``ratio_max``, ``is_weight_mean``,
    ``is_weight_max`` (raw weight), ``is_masked_frac`` (fraction clamped by tis / zeroed by
    icepop).
    """
    fn = "policy_loss"
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"{fn}: `logprobs` must be [N, T], got shape {tuple(shape)}")
    check_shape(fn, "old_logprobs", old_logprobs, shape)
    check_shape(fn, "advantages", advantages, shape)
    check_shape(fn, "mask", mask, shape)
    if behavior_logprobs is not None:
        check_shape(fn, "behavior_logprobs", behavior_logprobs, shape)
    if is_mode not in IS_MODES:
        raise ValueError(
            f"{fn}: unknown is_mode {is_mode!r}; valid choices: {', '.join(IS_MODES)}"
        )
    if clip_eps_low < 0 or clip_eps_high < 0 or clip_eps_low >= 1:
        raise ValueError(
            f"{fn}: need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, "
            f"got clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high}"
        )
    if is_low > is_high:
        raise ValueError(f"{fn}: need is_low <= is_high, got is_low={is_low}, is_high={is_high}")

    valid = valid_positions(mask)
    check_finite(fn, "logprobs", logprobs, valid)
    check_finite(fn, "old_logprobs", old_logprobs, valid)
    check_finite(fn, "advantages", advantages, valid)
    if behavior_logprobs is not None:
        check_finite(fn, "behavior_logprobs", behavior_logprobs, valid)
    denom = _denominator(fn, mask, num_tokens)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    old = torch.where(valid, old_logprobs.to(logprobs.dtype), zero)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero)
    log_ratio = torch.where(valid, logprobs, zero) - old
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)

    with torch.no_grad():
        if behavior_logprobs is None:
            raw_w = torch.ones_like(ratio)
        else:
            beh = torch.where(valid, behavior_logprobs.to(logprobs.dtype), zero)
            raw_w = torch.exp(old.detach().to(torch.float64) - beh.to(torch.float64))
        outside = (raw_w < is_low) | (raw_w > is_high)
        if behavior_logprobs is None or is_mode == "none":
            weight = torch.ones_like(ratio)
            masked = torch.zeros_like(valid)
        else:
            weight = importance_weight(raw_w, is_mode, is_low, is_high).to(ratio.dtype)
            masked = outside & valid

    weighted = torch.where(valid, per_token * weight, zero)
    loss = weighted.sum() / denom.to(weighted.dtype)

    with torch.no_grad():
        n_valid = max(int(valid.sum().item()), 1)

        def frac(b: torch.Tensor) -> float:
            return (b & valid).sum().item() / n_valid

        def vmean(x: torch.Tensor) -> float:
            return torch.where(valid, x.to(torch.float64), 0.0).sum().item() / n_valid

        def vmax(x: torch.Tensor) -> float:
            if not bool(valid.any()):
                return 0.0
            return x.to(torch.float64)[valid].max().item()

        metrics = {
            "clipfrac_low": frac((ratio < 1.0 - clip_eps_low) & (adv < 0)),
            "clipfrac_high": frac((ratio > 1.0 + clip_eps_high) & (adv > 0)),
            "approx_kl": vmean((ratio - 1.0) - log_ratio),
            "ratio_mean": vmean(ratio),
            "ratio_max": vmax(ratio),
            "is_weight_mean": vmean(raw_w),
            "is_weight_max": vmax(raw_w),
            "is_masked_frac": frac(masked),
        }
    return loss, metrics


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k2",
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate, same shape as ``logprobs``.

    With ``log_r = ref_logprobs - logprobs`` (Schulman 2020, "Approximating KL
    divergence"): ``k1 = logprobs - ref_logprobs``, ``k2 = 0.5 * log_r^2``,
    ``k3 = exp(log_r) - log_r - 1``. If ``mask`` is given, padding positions are returned as 0
    and only valid positions are checked for non-finite values; without it every position is
    checked. ``log_r`` is clamped to [-20, 20] in k3 against overflow.
    """
    fn = "kl_penalty"
    if kind not in KL_KINDS:
        raise ValueError(f"{fn}: unknown kind {kind!r}; valid choices: {', '.join(KL_KINDS)}")
    check_shape(fn, "ref_logprobs", ref_logprobs, logprobs.shape)
    valid = None
    if mask is not None:
        check_shape(fn, "mask", mask, logprobs.shape)
        valid = valid_positions(mask)
    check_finite(fn, "logprobs", logprobs, valid)
    check_finite(fn, "ref_logprobs", ref_logprobs, valid)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp, ref = logprobs, ref_logprobs.to(logprobs.dtype)
    if valid is not None:
        lp = torch.where(valid, lp, zero)
        ref = torch.where(valid, ref, zero)
    log_r = ref - lp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1.0


def _row_starts(fn: str, rows: int, chunk_size: int) -> range:
    if chunk_size <= 0:
        raise ValueError(f"{fn}: `chunk_size` must be positive, got {chunk_size}")
    return range(0, rows, chunk_size)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum softmax(z) * z`` over the last dim.

    Works on ``chunk_size`` rows at a time (upcast to float32 per chunk), so at most one
    chunk-sized temporary exists besides ``logits``; differentiable. Returns float32 of
    shape ``logits.shape[:-1]``.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for start in _row_starts("entropy_from_logits", flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].float()
        lse = torch.logsumexp(z, dim=-1)
        probs = torch.softmax(z, dim=-1)
        parts.append(lse - (probs * z).sum(dim=-1))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(lead)


def logprobs_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """``log_softmax(logits)[..., token_ids]`` as ``gather(logits, ids) - logsumexp(logits)``.

    Never materialises the full log-softmax; rows are processed ``chunk_size`` at a time in
    float32. ``token_ids`` has shape ``logits.shape[:-1]``; returns float32 of that shape.
    """
    fn = "logprobs_from_logits"
    check_shape(fn, "token_ids", token_ids, logits.shape[:-1])
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1, 1).long()
    parts = []
    for start in _row_starts(fn, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size]
        picked = chunk.gather(-1, ids[start : start + chunk_size]).squeeze(-1).float()
        parts.append(picked - torch.logsumexp(chunk.float(), dim=-1))
    if not parts:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(lead)
