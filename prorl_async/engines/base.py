"""What every generation engine returns and accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

#: ``rollout.vllm_engine_core`` choices (prorl_async.engines.vllm.inline_engine_core)
VLLM_ENGINE_CORES = ("auto", "inline", "process")


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    greedy: bool = False
    ignore_eos: bool = False  # vLLM only: always generate max_new_tokens (benchmarks, in-flight update tests)


@dataclass
class Completion:
    """One sampled response. ``logprobs[i]`` is log pi_mu(token_ids[i]) under the sampling
    distribution at the engine's temperature (the behaviour policy of the importance correction)."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int = 0       # weights version of the first (= oldest) response token
    policy_version_end: int = 0   # ... and of the last (differs only with in-flight weight updates)
    token_versions: list[int] = field(default_factory=list)  # per token, where the engine reports it
