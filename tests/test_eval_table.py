"""``scripts/eval_table.py``: a run's in-run evaluations as a markdown table, with ``--prior``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_async.config import load_config, save_config
from prorl_async.metrics import answer_prior

REPO = Path(__file__).resolve().parents[1]


def test_eval_table_puts_what_the_answers_alone_score_before_the_runs_evaluations(tmp_path):
    answers = ["1", "1", "1", "2"]  # always answering 1 passes 3 of 4 prompts (leave-one-out)
    rows = [{"id": f"q{i}", "prompt": f"What is {a} + 0?", "answer": a, "domain": "math:count@easy"} for i, a in enumerate(answers)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_config(load_config(None, [f"data.eval={tmp_path / 'eval.jsonl'}"]), tmp_path / "config.yaml")
    (tmp_path / "summary.json").write_text(json.dumps({"before": {"val/pass@1": 0.25, "val/pass@1/math:count@easy": 0.25,
                                                                  "val/pass@2/math:count@easy": 0.5}}))
    (tmp_path / "history.jsonl").write_text(json.dumps({"step": 5, "val/pass@1": 0.75, "val/pass@1/math:count@easy": 0.75,
                                                        "val/pass@2/math:count@easy": 1.0}) + "\n")
    run = lambda *extra: subprocess.run([sys.executable, "scripts/eval_table.py", str(tmp_path), "--k", "2", *extra],  # noqa: E731
                                        cwd=REPO, capture_output=True, text=True, timeout=120)
    plain, with_prior = run(), run("--prior")
    assert plain.returncode == 0 and with_prior.returncode == 0, plain.stderr[-2000:] + with_prior.stderr[-2000:]
    assert plain.stdout.splitlines()[0] == "| domain | pass@1 0 | pass@2 0 | pass@1 5 | pass@2 5 |"
    lines = with_prior.stdout.splitlines()
    assert lines[0] == "| domain | prior@1 | prior@2 | pass@1 0 | pass@2 0 | pass@1 5 | pass@2 5 |"
    prior = answer_prior(rows, 2)
    assert prior["prior@1/math:count@easy"] == pytest.approx(0.75)
    row = f"| `math:count@easy` | 0.750 | {prior['prior@2/math:count@easy']:.3f} | 0.250 | 0.500 | 0.750 | 1.000 |"
    assert row in lines and f"| mean @easy (1) | 0.750 | {prior['prior@2/math:count@easy']:.3f} |" in with_prior.stdout
