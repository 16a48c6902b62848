"""``prorl-async eval`` through the real CLI: a verl parquet and builtin:humaneval, no training."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prorl_async.checkpoint import policy_folder
from prorl_async.data.arithmetic import generate
from prorl_async.metrics import PromptOutcome, answer_prior, pass_at_k_stderr
from tests.conftest import cli, stopped_by
from tests.test_console import foreign_lines


def test_eval_a_builtin_model_on_a_verl_parquet(tmp_path, model_cache):
    records = [{"data_source": "tiny/arith", "prompt": [{"role": "user", "content": r["prompt"]}],
                "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                "extra_info": {"index": k, "split": "test"}}
               for k, r in enumerate(generate(24, 3, "eval"))]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "test.parquet")
    res = cli("eval", "--model", "builtin:tiny-arith", "--data", str(tmp_path / "test.parquet"), "--samples", "3",
              "--out", "r.json", "model.warmup_steps=200", f"model.cache_dir={model_cache}", "ray.num_cpus=2",
              f"tracking.aim_repo={tmp_path / 'aim'}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["prompts"] == 24 and r["samples"] == 3
    # the warmed-up model solves some of the problems, sampled three times each: pass@3 >= pass@1 > 0
    assert 0 < r["pass@1"] <= r["pass@3"] <= 1 and r["pass@1/arithmetic"] == r["pass@1"]
    assert "pass@1" in res.stdout and "arithmetic" in res.stdout and "wrote r.json" in res.stdout
    # beside them, what the set's answers alone score (no model), in the JSON and as columns of the table
    prior = answer_prior([{"domain": "arithmetic", "answer": rec["reward_model"]["ground_truth"]} for rec in records], 3)
    assert set(prior) == {"prior@1", "prior@3", "prior@1/arithmetic", "prior@3/arithmetic"}
    assert {key: r[key] for key in prior} == pytest.approx(prior)
    header = next(line for line in res.stdout.splitlines() if line.startswith("domain"))
    assert header.split() == ["domain", "pass@1", "pass@3", "se@1", "se@3", "prior@1", "prior@3"], res.stdout[-2000:]
    # each prompt's outcome is kept, and the means and standard errors are theirs
    outcomes = {pid: PromptOutcome(*o) for pid, o in r["outcomes"].items()}
    assert len(outcomes) == 24 and {(o.domain, o.samples) for o in outcomes.values()} == {("arithmetic", 3)}
    assert r["pass@1"] == pytest.approx(sum(o.correct / 3 for o in outcomes.values()) / 24)
    assert r["pass@3"] == pytest.approx(sum(o.correct > 0 for o in outcomes.values()) / 24)
    se = pass_at_k_stderr(outcomes, 3)
    assert set(se) == {"se@1", "se@3", "se@1/arithmetic", "se@3/arithmetic"}
    assert {key: r[key] for key in se} == pytest.approx(se)
    assert 0 < r["se@1"] < 0.5
    assert not (tmp_path / "aim").exists() and r["aim_run_hash"] is None  # no Aim run unless --aim
    assert not list(tmp_path.glob("runs*"))  # nor a training run directory
    # the console holds the project's lines only; the actors' output is in r-logs/, named at the end
    assert foreign_lines(res.stdout + res.stderr) == [], res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.rstrip().endswith(f"actors' output: {tmp_path / 'r-logs'}")
    assert {"generator-0.log", "grader.log"} <= {p.name for p in (tmp_path / "r-logs").iterdir()}


def test_eval_humaneval_with_the_tiny_model_completes(tmp_path, model_cache):
    """Without --out: the table on the console, and the actors' temporary log folder removed."""
    tmp = Path(tempfile.mkdtemp(prefix="pe-", dir="/tmp"))  # short: Ray puts its sockets under TMPDIR too
    res = cli("eval", "--model", "builtin:tiny-arith", "--data", "builtin:humaneval?n=6", "--samples", "2",
              "--max-new-tokens", "8", "model.warmup_steps=200", f"model.cache_dir={model_cache}", "ray.num_cpus=2",
              cwd=tmp_path, env={"TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # domain, pass@1, pass@2, and their standard errors
    rows = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+$",
                                                                 res.stdout, re.M)}
    assert set(rows) == {"all", "code"} and rows["all"] == rows["code"], res.stdout[-2000:]
    assert 0 <= rows["code"][0] <= rows["code"][1] <= 1
    assert "actors' output" not in res.stdout + res.stderr
    left = [p.name for p in tmp.iterdir() if p.name.startswith("prorl-eval-logs-")]
    shutil.rmtree(tmp, ignore_errors=True)
    assert left == []


def test_eval_model_may_be_a_run_directory_or_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    for d in ("final", "checkpoints/step-000002/policy", "checkpoints/step-000004/policy"):
        (run / d).mkdir(parents=True)
        (run / d / "config.json").write_text("{}")
    newest = run / "checkpoints/step-000004/policy"
    assert policy_folder(run) == newest  # the newest checkpoint's policy carries the tokenizer
    assert policy_folder(run / "checkpoints/step-000002") == run / "checkpoints/step-000002/policy"
    assert policy_folder(newest) == newest
    (tmp_path / "only_final" / "final").mkdir(parents=True)
    (tmp_path / "only_final" / "final" / "config.json").write_text("{}")
    assert policy_folder(tmp_path / "only_final") == tmp_path / "only_final" / "final"


def test_eval_bad_arguments_are_one_error_line(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = cli("eval", "--model", str(tmp_path / "nope"), "--data", "builtin:humaneval", cwd=tmp_path,
              env={"TMPDIR": str(tmp)})
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    assert "nope" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert [p for p in tmp.iterdir() if p.name.startswith("prorl-eval-logs-")] == []  # no actor started: no logs kept


def test_sigterm_stops_an_evaluation_with_one_line_and_shuts_its_ray_down(tmp_path, model_cache):
    """SIGTERM (a scheduler's stop, ``kill``) while the samples are drawn: exit status 143, one line
    saying the --out file was not written, no traceback, and the Ray cluster the evaluation started
    gone with it. Before, Ray's own signal handler printed a C stack dump and nothing of the project's."""
    import os
    import signal
    import time

    from tests import _cli_fork

    log = tmp_path / "eval.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = _cli_fork.start(["eval", "--model", "builtin:tiny-arith", "--data", "builtin:arithmetic?n=400&seed=2&split=eval",
                         "--samples", "16", "--out", "r.json", "model.warmup_steps=200", f"model.cache_dir={model_cache}",
                         "ray.num_cpus=2"], str(tmp_path), env, str(log), new_session=True)
    try:
        end = time.time() + 300
        while not re.search(r"sampled held-out evaluation", log.read_text(errors="replace")):
            assert p.poll() is None and time.time() < end, log.read_text()[-3000:]
            time.sleep(0.05)
        rc, cluster, left = stopped_by(p, lambda: os.kill(p.pid, signal.SIGTERM))  # the CLI alone, as `kill PID`
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM during the evaluation: r.json not written" in out, out[-3000:]
    assert "Traceback" not in out and "logging.cc" not in out and not (tmp_path / "r.json").exists(), out[-3000:]
    assert any("raylet" in " ".join(cmd) for cmd in cluster.values()), list(cluster.values())  # the check saw Ray
    assert left == [], f"processes of the stopped evaluation still alive: {left}"
