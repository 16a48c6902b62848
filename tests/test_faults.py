"""Fault injection through the real actors: a killed generator, a killed learner, a diverging
learner, and bad input a user can give. Each ends either survived or as one clear error."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter

import pytest
import torch

from tests.accounting import assert_nothing_lost_or_repeated
from tests.conftest import ROOT, cli
from tests.test_e2e import SMALL


def _cfg(tmp_path, model_cache, *extra):
    from prorl_async.config import load_config

    return load_config(None, [*SMALL, f"run_dir={tmp_path / 'run'}", f"tracking.aim_repo={tmp_path / 'aim'}",
                              f"model.cache_dir={model_cache}", "tracking.enabled=false", *extra])


def _kill_when_busy(name_suffix: str, out: dict, no_restart: bool, after_requests: int = 12):
    """Kill the named actor once generator 0 has served ``after_requests`` requests (mid-run)."""
    import ray

    deadline = time.time() + 180
    while time.time() < deadline:
        names = ray.util.list_named_actors()
        gen = [n for n in names if n.endswith("/generator-0")]
        target = [n for n in names if n.endswith(name_suffix)]
        try:
            if gen and target and ray.get(ray.get_actor(gen[0]).stats.remote(), timeout=5)["requests"] >= after_requests:
                ray.kill(ray.get_actor(target[0]), no_restart=no_restart)
                out["killed_at"] = time.time()
                return
        except Exception:
            pass
        time.sleep(0.1)


def test_killed_generator_is_restarted_resynced_and_its_prompts_reissued_once(ray_cluster, tmp_path, model_cache,
                                                                              monkeypatch):
    import ray

    from actors.driver import TrainingLoop, run
    from prorl_async.checkpoint import load_latest

    cfg = _cfg(tmp_path, model_cache, "train.total_steps=12", "train.max_staleness=1", "train.eval_interval=0",
               "rollout.num_generators=2", "rollout.generator_num_cpus=0.5", "train.learner_num_cpus=0.5",
               "algo.dynamic_sampling=false", "train.sync_timeout_s=30")
    out: dict = {}
    original = TrainingLoop._request

    def request_then_kill(self, i, rows, seed):
        original(self, i, rows, seed)
        if i == 0 and self.s.requests >= 6 and "killed_at" not in out:  # its request is in flight
            ray.kill(self.actors.generators[0], no_restart=False)
            out["killed_at"] = time.time()

    monkeypatch.setattr(TrainingLoop, "_request", request_then_kill)
    summary = run(cfg)
    assert "killed_at" in out, "the test never killed the generator"
    assert summary["steps"] == 12
    assert summary["generator_failures"] == 1 and summary["weight_resyncs"] >= 1
    groups = [g for step in (json.loads(line) for line in (tmp_path / "run" / "trained_groups.jsonl").read_text().splitlines()) for g in step]
    assert len(groups) == len(set(groups)) == 12 * 8  # no group trained twice
    prompts = Counter(g.split("/", 1)[1] for g in groups)
    assert max(prompts.values()) == 1  # less than an epoch: no prompt trained twice either
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert all(math.isfinite(h["actor/pg_loss"]) for h in history)
    # after the resync the generators serve the learner's weights: staleness stays bounded
    assert all(h["async/trained_staleness_max"] <= 1 for h in history)
    # the dead generator's prompts were re-issued and trained (or wait in the end checkpoint) exactly once
    a = assert_nothing_lost_or_repeated(cfg, load_latest(str(tmp_path / "run")).path)
    assert summary["reissued_prompts"]
    for pid in summary["reissued_prompts"]:
        assert a["trained"][pid] + a["buffered"][pid] + a["retry"][pid] == 1, pid
    assert sum(a["trained"][pid] for pid in summary["reissued_prompts"]) >= 1


def test_killed_learner_fails_the_run_fast(ray_cluster, tmp_path, model_cache):
    from actors.driver import RunError, run

    cfg = _cfg(tmp_path, model_cache, "train.total_steps=1000", "train.eval_interval=0")
    out: dict = {}
    threading.Thread(target=_kill_when_busy, args=("/learner", out, True), daemon=True).start()
    with pytest.raises(RunError, match="learner"):
        run(cfg)
    assert "killed_at" in out
    assert time.time() - out["killed_at"] < 30  # seconds, not a hang


def test_diverging_learner_skips_non_finite_updates_then_stops(ray_cluster, tmp_path, model_cache):
    from actors.driver import RunError, run

    # lr=1e30 blows the weights up after one update: every later loss is NaN and is skipped
    from safetensors.torch import load_file

    from prorl_async.checkpoint import list_checkpoints, load_latest

    # the blown-up policy is never right, so dynamic sampling refills without end: no refill bound here
    cfg = _cfg(tmp_path, model_cache, "train.total_steps=20", "train.lr=1e30", "train.max_skipped_steps=3",
               "train.mini_batches=1", "train.eval_interval=0", "train.checkpoint_interval=1", "train.keep_last=30",
               "algo.max_refill_rounds=0")
    with pytest.raises(RunError, match="non-finite"):
        run(cfg)
    # the run stopped with a checkpoint of its last state, which a resume can load
    ckpt = load_latest(str(tmp_path / "run"))
    assert 1 <= ckpt.step < 20
    history = [json.loads(line) for line in (ckpt.path / "history.jsonl").read_text().splitlines()]
    assert len(history) == ckpt.step
    applied = [h["step"] for h in history if h["actor/updates"] > 0]
    skipped = [h["step"] for h in history if h["actor/updates"] == 0]
    assert applied and skipped and max(applied) < min(skipped)  # good steps, then only skipped ones
    assert history[-1]["actor/skipped_updates"] == len(skipped)  # every skipped update is counted
    weights = {int(p.name.split("-")[1]): load_file(p / "policy" / "model.safetensors") for p in list_checkpoints(tmp_path / "run")}
    last_good = weights[max(applied)]
    assert all(torch.isfinite(t).all() for t in last_good.values())
    for step in skipped:  # a skipped update leaves the weights bitwise as they were
        assert weights[step].keys() == last_good.keys()
        assert all(torch.equal(weights[step][k], last_good[k]) for k in last_good), step
    assert any(not torch.equal(weights[max(applied)][k], weights[min(applied)][k]) for k in last_good) \
        or len(applied) == 1  # applied updates do change them


def test_grader_failure_rate_above_bound_stops_with_reasons(tmp_path, model_cache):
    from prorl_async.data import arithmetic

    rows = [r for r in arithmetic.generate(200, seed=5, split="train") if r["prompt"].split("+")[0].split("-")[0].endswith("3")]
    with open(tmp_path / "bad.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "domain": "flaky"}) + "\n")
    res = cli("train", *SMALL, f"data.train={tmp_path / 'bad.jsonl'}", "reward.extra_modules=[tests.fault_verifiers]",
              "reward.max_invalid_frac=0.5", f"run_dir={tmp_path / 'run'}", f"tracking.aim_repo={tmp_path / 'aim'}",
              f"model.cache_dir={model_cache}", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert res.returncode == 1
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "could not be graded" in err[0] and "error:RuntimeError" in err[0]


def test_bad_inputs_get_one_clear_error(tmp_path, model_cache):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"id": "a", "domain": "arithmetic", "prompt": "1+1=", "answer": "2"}\n{"id": "b", "domain": "arithmetic"}\n')
    cases = [
        (["model.path=" + str(tmp_path / "model")], "missing"),
        (["model.path=/nonexistent/model"], "is not a directory"),
        ([f"data.train={bad_rows}", "data.strict=true"], "line 2"),
        (["data.train=/nonexistent.jsonl"], "nonexistent.jsonl"),
        (["train.prompts_per_step=8", "train.mini_batches=3"], "train.mini_batches"),
    ]
    for overrides, needle in cases:
        res = cli("train", *overrides, f"run_dir={tmp_path / 'run'}", f"tracking.aim_repo={tmp_path / 'aim'}",
                  f"model.cache_dir={model_cache}", cwd=tmp_path)
        err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert res.returncode == 2, (overrides, res.stderr[-2000:])
        assert len(err) == 1 and needle in err[0], (overrides, err)
        assert "Traceback" not in res.stderr


def test_weight_sync_port_in_use_is_one_clear_error(tmp_path, model_cache):
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        res = cli("train", *SMALL, f"ray.weight_sync_port={port}", f"run_dir={tmp_path / 'run'}",
                  f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}", cwd=tmp_path)
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 1, res.stderr[-2000:]
    assert len(err) == 1 and f"port {port}" in err[0] and "already in use" in err[0]
