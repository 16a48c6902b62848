"""The Engine protocol is the whole contract: every engine defines each of its methods itself
(no capability is probed with hasattr), and a real engine has each of its attributes."""

from __future__ import annotations

from prorl_async.engines import make_engine
from prorl_async.engines.base import Engine
from prorl_async.engines.hf import HFEngine
from prorl_async.engines.vllm import VLLMEngine
from tests.offline import assert_defines_every_method, public_methods

METHODS = {"generate", "abort", "init_weight_sync", "receive_weights", "weights_checksum"}
ATTRIBUTES = {"tokenizer", "version", "weight_sync_ranks"}


def test_the_protocol_lists_what_the_generator_actor_calls():
    methods = public_methods(Engine)
    assert methods == METHODS
    assert set(Engine.__annotations__) == ATTRIBUTES


def test_every_engine_defines_every_method_with_the_protocols_parameters():
    assert_defines_every_method(Engine, (HFEngine, VLLMEngine), METHODS)


def test_an_hf_engine_has_the_attributes_and_its_abort_is_a_no_op(tiny_model):
    from prorl_async.engines.base import SamplingSpec

    engine = make_engine("hf", tiny_model)
    for name in ATTRIBUTES:
        assert hasattr(engine, name), name
    assert (engine.version, engine.weight_sync_ranks) == (0, 1)
    engine.abort()  # nothing in flight, nothing to interrupt: the next request is whole
    [[c]] = engine.generate([engine.tokenizer("1+1=")["input_ids"]], SamplingSpec(max_new_tokens=4, greedy=True))
    assert c.finish_reason in ("stop", "length") and c.token_ids
