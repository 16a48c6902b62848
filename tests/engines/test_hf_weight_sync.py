"""Weight sync into the default transformers engine through real receivers (a gloo group with
the learner's side in a thread, and the same-device ``ipc`` handles): a NaN or an infinity is
refused with :class:`WeightSyncError` and the previous weights keep serving."""

from __future__ import annotations

import threading

import pytest

from prorl_async.engines.base import SamplingSpec
from prorl_async.weight_ipc import IpcWeightSender
from prorl_async.weight_sync import WeightSyncError, WeightSyncGroup, free_port, tensor_checksum

from tests.conftest import nudged_model

BAD = [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))]


def _learner(tiny_model):
    return [(n, p.detach()) for n, p in nudged_model(tiny_model).named_parameters()]


def _poisoned(named, value):
    out = [(n, t.clone()) for n, t in named]
    out[len(out) // 2][1].view(-1)[7] = value
    return out


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_non_finite_update_is_refused_and_the_previous_version_keeps_serving(tiny_model, backend):
    from prorl_async.engines.hf import HFEngine

    engine = HFEngine(tiny_model, dtype="float32")
    named = _learner(tiny_model)
    updates = [named] + [_poisoned(named, v) for _, v in BAD]  # versions 1, 2, 3, 4
    port = free_port()
    if backend == "ipc":
        sender = IpcWeightSender(1)
        payloads = [sender.send(u, v)[0] for v, u in enumerate(updates, start=1)]
    else:
        payloads = [None] * len(updates)

        def learner_side():
            g = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
            for version, u in enumerate(updates, start=1):
                g.send(u, version)

        th = threading.Thread(target=learner_side)
        th.start()
    engine.init_weight_sync("127.0.0.1", port, 1, 2, backend, timeout_s=60)
    assert engine.receive_weights(payloads[0])["version"] == 1
    ids = [engine.tokenizer(p)["input_ids"] for p in ["12+7=", "3*4=", "40-13="]]
    spec = SamplingSpec(n=1, greedy=True, max_new_tokens=6)
    before = engine.generate(ids, spec)
    assert engine.weights_checksum() == (1, tensor_checksum([t for _, t in named]))
    for version, (label, _) in enumerate(BAD, start=2):
        with pytest.raises(WeightSyncError, match=f"version {version} hold non-finite values"):
            engine.receive_weights(payloads[version - 1])
        after = engine.generate(ids, spec)
        assert [g[0].token_ids for g in after] == [g[0].token_ids for g in before], label
        assert [g[0].logprobs for g in after] == [g[0].logprobs for g in before], label
        assert all(g[0].policy_version == 1 for g in after)
        assert engine.weights_checksum() == (1, tensor_checksum([t for _, t in named])), label
    if backend == "gloo":
        th.join(60)


def test_an_engine_outside_the_group_refuses_an_update_with_one_clear_error(tiny_model):
    """A generator that Ray restarted has a fresh engine that joined no group; a sync reaching it
    before the driver re-forms the group says so (it raised AttributeError on None before)."""
    from prorl_async.engines.hf import HFEngine

    engine = HFEngine(tiny_model, dtype="float32")
    with pytest.raises(WeightSyncError, match="has not joined the weight-sync group .*re-formed"):
        engine.receive_weights()
    assert engine.version == 0  # nothing staged: the engine keeps serving its weights
