"""What every generation engine implements (:class:`Engine`), returns and accepts.

:class:`Engine` is the whole contract between the generator actor (``actors/generator.py``)
and an engine: :class:`~prorl_async.engines.hf.HFEngine` and
:class:`~prorl_async.engines.vllm.VLLMEngine` implement every method of it, so the actor never
asks an engine what it can do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


def stop_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The token ids that end a response, for every engine alike: the tokenizer's end-of-sequence
    token and every ``eos_token_id`` of the model's ``generation_config.json`` (a model may list
    several, e.g. an end-of-turn and an end-of-text token). vLLM stops on the generation
    config's ids by itself and HF's ``generate`` only on what it is given, so both get this list."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's token alone
        extra = None
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    return sorted(ids)


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


class Engine(Protocol):
    """A generation engine: samples responses with behaviour logprobs, and receives new weights
    from the learner's weight-sync group, applied at a request boundary (or, for vLLM with
    in-flight updates, between two engine steps)."""

    tokenizer: Any            # the HF tokenizer of the engine's model (prompts are encoded with it)
    version: int              # the policy version of the weights in use
    weight_sync_ranks: int    # ranks this engine takes in the weight-sync group (vLLM: its TP size)

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` samples for each prompt: the responses of prompt ``i`` in ``out[i]``."""
        ...

    def abort(self) -> None:
        """End the requests in flight early (partial responses, ``finish_reason="abort"``);
        an engine whose request cannot be interrupted lets it run to its end."""
        ...

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                         timeout_s: float = 120.0) -> str:
        """Join the weight-sync group from ``rank`` on (``ipc``: no group, handles come with each
        update); returns the dtype the engine announces (the sender casts to it)."""
        ...

    def receive_weights(self, payload: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Receive one update (``payload``: the learner's ipc handles, else None): ``{"version",
        "seconds", "applied"}`` -- applied now, or staged for the next request boundary."""
        ...

    def weights_checksum(self) -> tuple[int, int]:
        """``(version, checksum)`` of the weights in use; staged weights are applied first."""
        ...
