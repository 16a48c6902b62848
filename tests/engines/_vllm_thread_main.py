"""Run by tests/engines/test_vllm_generator_cpu.py in a fresh interpreter (OpenMP reads
``OMP_NUM_THREADS`` once, at load): an in-process vLLM engine created with 1 torch thread on a
machine with more cores generates from the creating thread, then from a fresh thread, as the
generator actor's thread pool does. Prints one JSON line; the test makes the assertions."""

from __future__ import annotations

import json
import os
import sys
import threading


def main(model_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.vllm import VLLMEngine

    e = VLLMEngine(model_path, dtype="float32", seed=0, in_process=True, kv_cache_gb=0.1)
    ids = [e.tokenizer(p)["input_ids"] for p in ("12+7=", "3*4=")]
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=8)
    out = {"cores": os.cpu_count(), "main": sum(len(c.token_ids) for g in e.generate(ids, spec) for c in g)}

    def fresh() -> None:
        try:
            out["fresh"] = sum(len(c.token_ids) for g in e.generate(ids, spec) for c in g)
            out["fresh_threads"] = torch.get_num_threads()
        except Exception as exc:  # reported, so the test shows what failed
            out["fresh_error"] = f"{type(exc).__name__}: {exc}"[:300]

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    print(json.dumps(out), flush=True)
    e.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
