"""Run by tests/engines/test_vllm_multiprocess.py in a fresh interpreter: vLLM's default
multiprocess engine core (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset, as in a real run) generates,
joins a gloo weight-sync group from its worker process (or, with ``ipc``, gets shared-memory
handles through ``collective_rpc``), receives weights and generates with them, then (gloo) runs
the in-flight update scenario (tests/engines/_inflight.py) on the same engine.
Prints one JSON line of findings; the test makes the assertions."""

from __future__ import annotations

import json
import os
import sys


def main(model_path: str, backend: str = "gloo") -> None:
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.vllm import VLLMEngine
    from prorl_async.weight_ipc import IpcWeightSender
    from prorl_async.weight_sync import free_port, tensor_checksum
    from tests.engines._inflight import inflight_update
    from tests.engines._weights import WeightPusher, perturbed

    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ, "the default engine must be tested"
    v = VLLMEngine(model_path, dtype="float32", seed=0, kv_cache_gb=0.25, inflight_weight_updates=True)
    try:
        core = type(v.engine.engine_core).__name__
        h = HFEngine(model_path, dtype="float32")
        prompts = [h.tokenizer(p)["input_ids"] for p in ["12+7=", "3*4=", "40-13=", "6*7="]]
        spec = SamplingSpec(n=1, greedy=True, max_new_tokens=8)
        before_ok = [a[0].token_ids == b[0].token_ids for a, b in zip(v.generate(prompts, spec), h.generate(prompts, spec))]

        learner = perturbed(model_path, seed=0, scale=0.05)
        if backend == "ipc":  # the handles travel to the worker process; the bytes stay in this one
            sender = IpcWeightSender(1)
            payload, _ = sender.send([(n, p.detach()) for n, p in learner.named_parameters()], version=1)
            v.init_weight_sync("127.0.0.1", free_port(), 1, 2, "ipc", timeout_s=120)
            info = v.receive_weights(payload)
            sender.release()
        else:
            info = WeightPusher(v).push(learner, version=1)
        version, checksum = v.weights_checksum()
        h.load_weights(learner.named_parameters())
        outs = v.generate(prompts, spec)
        after_ok = [a[0].token_ids == b[0].token_ids for a, b in zip(outs, h.generate(prompts, spec))]
        findings = {
            "engine_core": core, "engine_core_pid_differs": _core_pid(v) not in (None, os.getpid()),
            "greedy_equal_before": before_ok, "received_version": info["version"], "version": version,
            "checksum_equal": checksum == tensor_checksum([p.detach() for p in learner.parameters()]),
            "greedy_equal_after": after_ok, "policy_versions": [o[0].policy_version for o in outs],
        }
        if backend == "gloo":
            findings["inflight"] = inflight_update(v, model_path)
        print(json.dumps(findings), flush=True)
    finally:
        v.shutdown()


def _core_pid(v):
    """The engine core's process id, if vLLM exposes it (None otherwise)."""
    res = getattr(v.engine.engine_core, "resources", None)
    procs = getattr(getattr(res, "engine_manager", None), "processes", None) or []
    return procs[0].pid if procs else None


if __name__ == "__main__":  # the engine core is spawned: the guard is required
    main(*sys.argv[1:])
