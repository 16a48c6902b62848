"""The ledger of every trained token and ``prorl-async replay`` / ``prorl-async ledger``
(prorl_async/ledger.py, prorl_async/replay.py, actors/cli.py).

* in-process: a torch learner's ledger rows rebuild its batches exactly (a second learner
  trained on the rebuilt batches logs the same numbers bit for bit), and the per-token columns
  hold what the learner computed;
* one synchronous fp32 CLI run (module scope: 4 steps, checkpoints at 2 and 4, reference resets
  every 2 steps, evaluations every 2): the ledger rows are the trained batches (groups, token
  counts, policy versions); replay reproduces step 1 (from the initial model) and step 4 (from
  checkpoint 2, step 3 re-applied from the ledger) to 1e-6 relative; ``prorl-async ledger
  --reset 2`` names the step before the second reset; bad inputs give one ``error:`` line, exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli

RTOL = 1e-6
LOSS_KEYS = ("actor/pg_loss", "kl/loss_term", "actor/grad_norm")


def _rel(a: float, b: float) -> float:
    return 0.0 if abs(a - b) <= 1e-12 else abs(a - b) / max(abs(a), abs(b))


# ---------------------------------------------------------------------------- in-process
def test_ledger_rows_rebuild_the_batch_exactly(tmp_path, tiny_model):
    import numpy as np
    import pyarrow.compute as pc
    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.torch_learner import TorchLearner
    from prorl_async.ledger import batch_table, read_step, write_step
    from tests.learners._batches import graded_table

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4",
                             "train.mini_batches=2", "train.lr=1e-3", "algo.kl_coef=0.01"])
    straight, metrics = TorchLearner(cfg, tiny_model), []
    tables = [graded_table(groups=4, n=4, seed=s) for s in (1, 2)]
    for k, t in enumerate(tables):
        metrics.append(straight.train_step(t, k))
        write_step(tmp_path, straight.ledger_rows(), [{"step": k, "score": 0.5, "cause": None, "checkpointed": False}])
    again = TorchLearner(cfg, tiny_model)
    for k, t in enumerate(tables, start=1):
        rows, observed = read_step(tmp_path, k)
        assert observed == [{"step": k - 1, "score": 0.5, "cause": None, "checkpointed": False}]
        assert rows.num_rows == t.num_rows and rows.column("row").to_pylist() == list(range(t.num_rows))
        assert rows.column("sample_id").to_pylist() == t.column("sample_id").to_pylist()
        lens = rows.column("response_len").to_numpy()
        for col in ("behavior_logprobs", "learner_logprobs", "ref_logprobs", "is_weights", "advantages"):
            assert pc.list_value_length(rows.column(col)).to_numpy().tolist() == lens.tolist(), col
        # the importance weight is exp(learner - behaviour) truncated to [is_low, is_high] (tis)
        lp = pc.list_flatten(rows.column("learner_logprobs")).to_numpy()
        beh = pc.list_flatten(rows.column("behavior_logprobs")).to_numpy()
        w = pc.list_flatten(rows.column("is_weights")).to_numpy()
        assert np.allclose(w, np.clip(np.exp(lp.astype(np.float64) - beh), cfg.algo.is_low, cfg.algo.is_high), rtol=1e-5)
        m = again.train_step(batch_table(rows), k - 1)
        for key in LOSS_KEYS:
            assert m[key] == metrics[k - 1][key], (k, key)


# ---------------------------------------------------------------------------- one synchronous CLI run
RUN = ["train.total_steps=4", "train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4",
       "train.max_staleness=0", "train.mini_batches=2", "train.checkpoint_interval=2", "train.keep_last=3",
       "train.eval_interval=2", "train.eval_samples=1", "data.eval=builtin:arithmetic?n=4&seed=2&split=eval",
       "model.warmup_steps=200", "model.dtype=float32", "algo.kl_coef=0.01", "algo.ref_reset_interval=2",
       "algo.ref_val_patience=1", "algo.max_refill_rounds=0", "train.record_rollouts=true", "ray.num_cpus=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("ledger")
    run_dir = tmp / "run"
    res = cli("train", *RUN, f"run_dir={run_dir}", f"model.cache_dir={model_cache}",
              f"tracking.aim_repo={tmp / 'aim'}", cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    history = {h["step"]: h for h in map(json.loads, (run_dir / "history.jsonl").read_text().splitlines())}
    groups = [json.loads(x) for x in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "tmp": tmp, "history": history, "groups": groups}


def test_ledger_rows_are_the_trained_batches(run):
    import pyarrow.compute as pc

    from prorl_async.ledger import read_step, recorded_steps

    assert recorded_steps(run["dir"]) == [1, 2, 3, 4]
    for step in range(1, 5):
        rows, _ = read_step(run["dir"], step)
        h = run["history"][step]
        assert rows.num_rows == 8 * 4 and rows.column("step").to_pylist() == [step] * 32
        # the groups the driver handed the learner for this step, and nothing else
        ids = {f"{r}/{p}" for r, p in zip(rows.column("request_id").to_pylist(), rows.column("prompt_id").to_pylist())}
        assert ids == set(run["groups"][step - 1])
        # synchronous: every token was sampled by the weights the step started from
        assert set(rows.column("policy_version").to_pylist()) == {step - 1}
        assert set(rows.column("policy_version_end").to_pylist()) == {step - 1}
        # the loss's token count is the ledger's tokens in the loss
        lens = rows.column("response_len").to_numpy()
        in_loss = rows.column("in_loss").to_numpy(zero_copy_only=False)
        assert float(lens[in_loss].sum()) == h["perf/train_valid_tokens"]
        assert pc.list_value_length(rows.column("response_ids")).to_numpy().tolist() == lens.tolist()
        assert set(rows.column("verdict").to_pylist()) <= {"correct", "wrong", "invalid"}
        # kl_sum is the k2 estimator over the sample's tokens, from its learner and reference logprobs
        for r in rows.slice(0, 4).to_pylist():
            k2 = sum(0.5 * (q - p) ** 2 for p, q in zip(r["learner_logprobs"], r["ref_logprobs"])) if r["in_loss"] else 0.0
            assert r["kl_sum"] == pytest.approx(k2, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("step,start,reapplied", [(1, "initial model", []), (4, "step-000002", [3])])
def test_replay_reproduces_the_logged_step(run, step, start, reapplied):
    out = run["tmp"] / f"replay-{step}.json"
    res = cli("replay", str(run["dir"]), "--step", str(step), "--out", str(out), cwd=run["tmp"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["start"].endswith(start) and got["reapplied"] == reapplied
    logged = run["history"][step]
    for key in LOSS_KEYS:
        c = got["compared"][key]
        assert c["logged"] == logged[key]
        assert _rel(c["replayed"], logged[key]) <= RTOL, (key, c)
    assert got["worst_reapplied_rel"] <= RTOL
    assert f"step {step} reproduced" in res.stdout


def test_ledger_names_the_samples_before_a_reset(run):
    from prorl_async.ledger import reset_steps

    resets = reset_steps([run["history"][k] for k in sorted(run["history"])])
    assert len(resets) >= 2 and resets[0] == (2, "interval")
    step, cause = resets[1]
    res = cli("ledger", str(run["dir"]), "--reset", "2", "--top", "3", cwd=run["tmp"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"reset 2 ({cause}) came after step {step}: 32 samples trained")
    assert len(lines) == 2 + 3 and all("%" in x for x in lines[2:])


def test_bad_replay_inputs_give_one_error_line_and_exit_2(run):
    from prorl_async.ledger import LedgerError
    from prorl_async.replay import replay, reset_step

    no_ledger = run["tmp"] / "no-ledger"
    no_ledger.mkdir(exist_ok=True)
    shutil.copy(run["dir"] / "config.yaml", no_ledger / "config.yaml")
    cases = [  # through the CLI (each call pays the torch import: three of them)
        (["replay", str(run["dir"]), "--step", "99"], "step 99 is not in the ledger of", "(recorded steps: 1..4)"),
        (["replay", str(run["tmp"] / "missing"), "--step", "1"], "is not a prorl-async run: no such directory", ""),
        (["ledger", str(no_ledger), "--step", "1"], "has no ledger", "train.record_rollouts=true"),
    ]
    for args, expected, fix in cases:
        res = cli(*args, cwd=run["tmp"])
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0] and fix in lines[0], \
            (args, res.stderr)
    with pytest.raises(LedgerError, match=r"--reset 9: .* logged \d+ reference reset\(s\) \(at steps 2 \(interval\), 4"):
        reset_step(run["dir"], 9)
    with pytest.raises(LedgerError, match="--step must be >= 1"):
        replay(run["dir"], 0)
