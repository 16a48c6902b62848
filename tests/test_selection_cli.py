"""train.keep_best, train.stop_at and train.eval_temperature through the real CLI on the tiny model:
best/ holds the policy with the best held-out value of the run's history, loads with transformers
and ``prorl-async eval``; a reachable stop rule ends the run early with its checkpoint and final/."""

from __future__ import annotations

import json

import pytest

from prorl_async.models import load_tokenizer
from tests.conftest import cli
from tests.test_console import foreign_lines

SMALL = ["train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4", "train.eval_samples=2",
         "model.warmup_steps=200", "data.eval=builtin:arithmetic?n=16&seed=2&split=eval", "train.micro_batch_size=32",
         "ray.num_cpus=2", "algo.max_refill_rounds=0", "train.lr=2e-3"]
EVAL = ["--data", "builtin:arithmetic?n=16&seed=2&split=eval", "--samples", "2"]


def _history(run_dir):
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def best_run(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("best")
    run_dir = tmp / "run"
    res = cli("train", *SMALL, "train.total_steps=4", "train.eval_interval=1", "train.checkpoint_interval=1",
              "train.keep_last=10", "train.keep_best=val/pass@1", "train.eval_temperature=0.7", f"run_dir={run_dir}",
              f"tracking.aim_repo={tmp / 'aim'}", f"model.cache_dir={model_cache}", cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run_dir, res


def test_best_is_the_evaluation_with_the_highest_value(best_run):
    run_dir, res = best_run
    summary, history = json.loads((run_dir / "summary.json").read_text()), _history(run_dir)
    evaluated = [(0, summary["before"]["val/pass@1"])] + [(h["step"], h["val/pass@1"]) for h in history if "val/pass@1" in h]
    evaluated.append((summary["steps"], summary["after"]["val/pass@1"]))
    assert [s for s, _ in evaluated] == [0, 1, 2, 3, 4]  # before, every step, after
    top = max(v for _, v in evaluated)
    step = next(s for s, v in evaluated if v == top)  # a tie keeps the earliest
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best == {"metric": "val/pass@1", "mode": "max", "step": step, "value": top} == summary["best"]
    assert f"best: val/pass@1 {top:.3f} at step {step} ({run_dir / 'best'})" in res.stdout
    assert foreign_lines(res.stdout + res.stderr) == []  # its lines are among the project's console formats
    # best/ holds that step's weights: the checkpoint of that step (the model before training for step 0)
    if step > 0:
        ckpt = _weights(run_dir / "checkpoints" / f"step-{step:06d}" / "policy")
        assert all((ckpt[k] == v).all() for k, v in _weights(run_dir / "best").items())
    if step < summary["steps"]:  # a later policy differs from it
        final = _weights(run_dir / "final")
        assert any((final[k] != v).any() for k, v in _weights(run_dir / "best").items())
    assert not list(run_dir.glob(".tmp-*"))  # the temp folders were renamed into place


def test_best_and_final_load_with_transformers_and_eval(best_run, tmp_path, model_cache):
    import torch
    from transformers import AutoModelForCausalLM

    run_dir, _ = best_run
    for name in ("best", "final"):
        model = AutoModelForCausalLM.from_pretrained(run_dir / name)
        tok = load_tokenizer(str(run_dir / name))
        ids = torch.tensor([tok.encode("12+30=")])
        assert model(ids).logits.shape[-1] == model.config.vocab_size
    best = json.loads((run_dir / "best" / "best.json").read_text())
    res = cli("eval", "--model", str(run_dir / "best"), *EVAL, "--out", "r.json", "rollout.prompts_per_request=4",
              "train.eval_temperature=0.7", f"model.cache_dir={model_cache}", "ray.num_cpus=2", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["model"] == str(run_dir / "best") and r["prompts"] == 16
    # the same prompts, seeds and temperature as the run's evaluation of that step: the same score
    assert r["pass@1"] == pytest.approx(best["value"])


@pytest.mark.slow  # a CLI run of its own; kept out of the default suite for CI time (README: the slow tests)
def test_a_resume_keeps_a_better_best(best_run, tmp_path):
    """best.json says a value no later evaluation can beat: the resumed run leaves best/ as it is."""
    run_dir, _ = best_run
    record = run_dir / "best" / "best.json"
    best = {**json.loads(record.read_text()), "value": 1.0}
    record.write_text(json.dumps(best))
    weights = (run_dir / "best" / "model.safetensors").read_bytes()
    res = cli("train", "--resume", str(run_dir), "train.total_steps=6", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"best so far: val/pass@1 1.000 at step {best['step']}" in res.stdout
    assert "-> " + str(run_dir / "best") not in res.stdout  # never written again
    assert json.loads(record.read_text()) == best and (run_dir / "best" / "model.safetensors").read_bytes() == weights
    assert json.loads((run_dir / "summary.json").read_text())["best"] == best


@pytest.mark.slow  # a CLI run of its own; kept out of the default suite for CI time (README: the slow tests)
def test_a_reachable_stop_rule_ends_the_run_early(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    res = cli("train", *SMALL, "train.total_steps=6", "train.eval_interval=2", "train.stop_at=val/pass@1>=0",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary, history = json.loads((run_dir / "summary.json").read_text()), _history(run_dir)
    assert summary["steps"] == 2 and [h["step"] for h in history] == [1, 2]
    reason = f"val/pass@1 {history[-1]['val/pass@1']:.3f} >= 0 at step 2 (train.stop_at=val/pass@1>=0)"
    assert summary["stopped"] == reason
    assert [line for line in res.stdout.splitlines() if line.startswith("stopped early: ")] == [f"stopped early: {reason}"]
    assert "step    3/6" not in res.stdout and foreign_lines(res.stdout + res.stderr) == []
    manifest = json.loads((run_dir / "checkpoints" / "step-000002" / "manifest.json").read_text())
    assert manifest["reason"] == "stop_at" and (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert (run_dir / "final" / "config.json").is_file() and not (run_dir / "best").exists()


def test_an_unknown_metric_is_a_config_error_before_anything_starts(tmp_path):
    res = cli("train", "train.keep_best=val/accuracy", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: train.keep_best: 'val/accuracy' is not a metric the periodic evaluation logs; "
                                 "use val/pass@1 or val/pass@4")
    assert not (tmp_path / "run").exists()
