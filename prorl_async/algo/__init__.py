"""Pure learner math for ProRL v2 (Liu et al. 2025, arXiv 2505.24864; NVIDIA ProRL v2 blog, 2025).

Functions over torch tensors only -- no Ray, vLLM or DeepSpeed imports -- so every formula
can be unit-tested on CPU and read next to its paper. Each module's docstring cites its
sources and lists where the code deviates from them:

* :mod:`~prorl_async.algo.advantages` -- REINFORCE++-baseline with global-batch whitening
  (Hu 2025), GRPO, RLOO;
* :mod:`~prorl_async.algo.losses` -- decoupled, importance-corrected PPO-Clip with
  Clip-Higher and token-level mean (PPO, DAPO, AReaL, TIS, IcePop), KL estimators k1/k2/k3,
  entropy / logprobs from logits;
* :mod:`~prorl_async.algo.shaping` -- scheduled cosine length reward (Yeo et al. 2025),
  DAPO overlong filtering / soft punishment;
* :mod:`~prorl_async.algo.sampling` -- DAPO dynamic sampling;
* :mod:`~prorl_async.algo.reference` -- ProRL reference-policy resets;
* :mod:`~prorl_async.algo.token_logprobs` -- token logprobs / entropy from hidden states and
  the LM head in token chunks (never the tokens x vocab fp32 logits).
* :mod:`~prorl_async.algo.mismatch` -- training/inference logprob mismatch (k3 KL, |delta logprob|,
  importance-weight band), measured every step.
* :mod:`~prorl_async.algo.choices` -- the names a config chooses among, without torch.

The names below load their module on first use (PEP 562): a process that reads only a config or
counts groups (the grader, the replay buffer) imports :mod:`~prorl_async.algo.choices` or
:mod:`~prorl_async.algo.sampling` and never torch, which costs each such actor about 5 s of CPU at
start-up on a 2-core machine and ~200 MB resident.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .advantages import (
        ADVANTAGE_ESTIMATORS,
        advantage_metrics,
        compute_advantages,
        grpo,
        reinforce_pp_baseline,
        rloo,
        whiten,
        whitening_stats,
    )
    from .losses import (
        IS_MODES,
        KL_KINDS,
        entropy_from_logits,
        kl_penalty,
        logprobs_from_logits,
        masked_mean,
        policy_loss,
    )
    from .mismatch import mismatch, mismatch_metrics, mismatch_stats
    from .reference import RESET_CAUSES, ReferenceResetPolicy
    from .sampling import DynamicSamplingCollector, informative_groups
    from .shaping import (
        OVERLONG_MODES,
        LengthPenaltySchedule,
        cosine_length_reward,
        filter_overlong,
        shape_rewards,
        soft_overlong_penalty,
    )
    from .token_logprobs import token_logprobs

_HOME = {name: module for module, names in {
    "advantages": ("ADVANTAGE_ESTIMATORS", "advantage_metrics", "compute_advantages", "grpo", "reinforce_pp_baseline",
                   "rloo", "whiten", "whitening_stats"),
    "losses": ("IS_MODES", "KL_KINDS", "entropy_from_logits", "kl_penalty", "logprobs_from_logits", "masked_mean",
               "policy_loss"),
    "mismatch": ("mismatch", "mismatch_metrics", "mismatch_stats"),
    "reference": ("RESET_CAUSES", "ReferenceResetPolicy"),
    "sampling": ("DynamicSamplingCollector", "informative_groups"),
    "shaping": ("OVERLONG_MODES", "LengthPenaltySchedule", "cosine_length_reward", "filter_overlong", "shape_rewards",
                "soft_overlong_penalty"),
    "token_logprobs": ("token_logprobs",),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


__all__ = sorted(_HOME)
