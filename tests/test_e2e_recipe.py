"""Parts of the recipe that only show in a real run through the CLI: every reference-reset
cause (ProRL), and dynamic sampling that stops with one clear error instead of spinning."""

from __future__ import annotations

import json

import pytest

from prorl_async import checkpoint
from tests.conftest import cli
from tests.test_e2e import SMALL, _aim_metrics

RESETS = {  # cause -> overrides that produce it in a 6-step run, all with the optimizer state cleared
    "interval": ["algo.ref_reset_interval=3"],
    # KL to the reference grows step by step at a high learning rate: more than 1.01x the last value is a spike
    "kl_spike": ["algo.kl_coef=0.01", "train.lr=0.003", "algo.ref_kl_spike_factor=1.01", "algo.ref_kl_window=1"],
    # nothing learns at lr 0, so the held-out score never improves on the one before training
    "val_stall": ["train.lr=0", "algo.ref_val_patience=1"],
}


@pytest.mark.parametrize("cause", sorted(RESETS))
def test_each_reference_reset_cause_in_a_real_run(tmp_path, model_cache, cause):
    run_dir = tmp_path / "run"
    res = cli("train", *SMALL, *RESETS[cause], "train.total_steps=6", "train.eval_interval=2",
              "algo.ref_reset_optimizer=true", f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}",
              f"model.cache_dir={model_cache}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    key = f"ref/reset_{cause}"
    reset_steps = [h["step"] for h in history if h.get(key) == 1.0]
    assert reset_steps, [{k: v for k, v in h.items() if k.startswith(("ref/", "kl/", "val/pass@1"))} for h in history]
    for h in history:
        if h["step"] in reset_steps:  # a reset cleared AdamW's state (it is refilled by the next update)
            assert h["ref/reset"] == 1.0 and h["actor/optimizer_state_params"] == 0.0
        elif not any(h.get(f"ref/reset_{c}") for c in RESETS):
            assert h["actor/optimizer_state_params"] > 0.0
    shown = [line for line in res.stdout.splitlines() if line.startswith("reference reset at step")]
    assert shown == [f"reference reset at step {s} ({cause}): the reference and optimizer state restart from "
                     f"this step's policy" for s in reset_steps], shown
    if cause == "interval":  # every 3 policy versions: after the 3rd and the 6th update
        assert reset_steps == [3, 6]
    if cause == "val_stall":  # step 2 repeats the score before training; after the reset, step 4 is a new best
        assert reset_steps == [2]
        assert history[1]["val/pass@1"] == history[3]["val/pass@1"]
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = _aim_metrics(tmp_path / "aim", summary["aim_run_hash"])
    assert len(metrics[(key, ())]) == len(reset_steps) and all(v == 1.0 for v in metrics[(key, ())])


def test_dynamic_sampling_without_a_full_batch_stops_with_one_clear_error(tmp_path, model_cache):
    """An untrained model (no warm-up) is never right: every group is dropped as all wrong."""
    res = cli("train", *SMALL, "model.warmup_steps=0", "algo.max_refill_rounds=3", "train.eval_interval=0",
              f"run_dir={tmp_path / 'run'}", "tracking.enabled=false", f"model.cache_dir={model_cache}",
              cwd=tmp_path, timeout=300)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert "3 refill rounds (algo.max_refill_rounds=3)" in errors[0] and "never correct" in errors[0]
    assert "algo.dynamic_sampling=false" in errors[0] and "all wrong" in errors[0]
    assert "dynamic sampling: refill round 1/3, no full batch yet" in res.stdout
    run = tmp_path / "run"  # no step was trained, and the stop kept a checkpoint to resume from (step 0)
    assert not (run / "history.jsonl").exists() or not (run / "history.jsonl").read_text().strip()
    latest = checkpoint.load_latest(run)
    assert latest is not None and latest.step == 0 and (latest.path / "driver.json").exists(), latest
