"""Both engines end a response on the same tokens (:func:`prorl_async.engines.base.stop_token_ids`):
the tokenizer's end-of-sequence token and every ``eos_token_id`` of the model's generation config.
vLLM stops on the generation config's ids by itself; HF's ``generate`` stopped only on the
tokenizer's, so a model listing two (an end-of-turn and an end-of-text token) ran past the second
in one engine and not in the other."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest

from prorl_async.engines.base import SamplingSpec, stop_token_ids
from prorl_async.models import load_tokenizer

PROMPTS = ["12+30=", "7+5=", "40+41=", "3+9="]
SPEC = SamplingSpec(n=8, temperature=1.0, max_new_tokens=12, seed=3)


def _ids(tok) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def two_stops(tiny_model, tmp_path_factory):
    """The tiny model as a folder whose generation config lists a second end token: the token its
    responses hold most often, so that both engines meet it mid-response."""
    from prorl_async.engines.hf import HFEngine

    tok = load_tokenizer(tiny_model)
    eos = tok.eos_token_id
    plain = HFEngine(tiny_model).generate(_ids(tok), SPEC)
    counts = collections.Counter(t for per in plain for c in per for t in c.token_ids[:-1] if t != eos)
    second = counts.most_common(1)[0][0]
    folder = tmp_path_factory.mktemp("two_stops") / "model"
    shutil.copytree(tiny_model, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, second]}))
    return str(folder), eos, second


def _check(completions, stops: set[int], second: int) -> int:
    """No stop token inside a response; a response that ends on one ends with "stop". Returns how
    many ended on a stop token other than the tokenizer's."""
    ended_on_second = 0
    for per in completions:
        for c in per:
            assert not stops & set(c.token_ids[:-1]), c.token_ids
            if c.token_ids and c.token_ids[-1] in stops:
                assert c.finish_reason == "stop", c
            else:
                assert c.finish_reason == "length", c
            ended_on_second += bool(c.token_ids) and c.token_ids[-1] == second
    return ended_on_second


def test_the_stop_set_is_the_tokenizers_eos_and_the_generation_configs(two_stops, tiny_model):
    folder, eos, second = two_stops
    assert stop_token_ids(folder, load_tokenizer(folder)) == sorted({eos, second})
    assert stop_token_ids(tiny_model, load_tokenizer(tiny_model)) == [eos]
    bare = Path(folder).parent / "bare"  # no generation_config.json: the tokenizer's token alone
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("generation_config.json"))
    assert stop_token_ids(str(bare), load_tokenizer(str(bare))) == [eos]


def test_hf_stops_on_every_end_token(two_stops):
    from prorl_async.engines.hf import HFEngine

    folder, eos, second = two_stops
    out = HFEngine(folder).generate(_ids(load_tokenizer(folder)), SPEC)
    assert _check(out, {eos, second}, second) > 0  # it met the second token, and stopped there


def test_vllm_stops_on_the_same_tokens(two_stops):
    pytest.importorskip("vllm")
    from prorl_async.engines.vllm import VLLMEngine

    folder, eos, second = two_stops
    v = VLLMEngine(folder, dtype="float32", seed=0, in_process=True, kv_cache_gb=0.1)
    try:
        assert v.stops == sorted({eos, second})
        out = v.generate(_ids(load_tokenizer(folder)), SPEC)
        assert _check(out, {eos, second}, second) > 0
    finally:
        v.shutdown()
