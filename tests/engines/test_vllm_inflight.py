"""In-flight weight updates with vLLM's in-process engine (``rollout.inflight_weight_updates``):
a long request receives new weights mid-generation without being aborted, and each token's
version and behaviour logprob match the weights it was sampled under (tests/engines/_inflight.py;
the multiprocess engine runs the same scenario in tests/engines/test_vllm_multiprocess.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from prorl_async.engines.base import SamplingSpec  # noqa: E402
from tests.engines._inflight import check_inflight, inflight_update  # noqa: E402
from tests.engines._weights import WeightPusher, perturbed  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from prorl_async.engines.vllm import VLLMEngine

    v = VLLMEngine(tiny_model, dtype="float32", seed=0, in_process=True, kv_cache_gb=0.25,
                   inflight_weight_updates=True)
    yield v
    v.shutdown()


def test_inflight_update_lands_mid_request_in_process(engine, tiny_model):
    summary = check_inflight(inflight_update(engine, tiny_model))
    print(f"in-process in-flight update: {summary}")


def test_without_inflight_updates_weights_wait_for_the_request_boundary(engine, tiny_model):
    """The default: a broadcast received mid-request is staged, not applied; the request
    finishes under one version and the next request runs under the new one."""
    import threading

    prompt = [engine.tokenizer("12+7=")["input_ids"]]
    pusher = WeightPusher(engine)
    start = engine.version
    engine.inflight_weight_updates = False
    real_step, box, first = engine.engine.step, {}, threading.Event()

    def step():
        outs = real_step()
        if any(c.token_ids for o in outs for c in o.outputs):
            first.set()
        return outs

    engine.engine.step = step
    try:
        spec = SamplingSpec(n=2, temperature=1.0, ignore_eos=True, max_new_tokens=40)
        gen = threading.Thread(target=lambda: box.update(out=engine.generate(prompt, spec)))
        gen.start()
        sender = pusher.send_async(perturbed(tiny_model, seed=3, scale=0.1), start + 1)
        assert first.wait(300)
        info = engine.receive_weights()
        sender.join(120)
        gen.join(600)
    finally:
        engine.engine.step = real_step
        engine.inflight_weight_updates = True
    assert not info["applied"] and info["version"] == start + 1, info
    assert all(c.token_versions == [start] * 40 for c in box["out"][0])
    assert engine.version == start  # staged only
    after = engine.generate(prompt, SamplingSpec(n=1, greedy=True, max_new_tokens=4))
    assert after[0][0].policy_version == after[0][0].policy_version_end == start + 1 == engine.version
