"""``scripts/answer_share.py``: the most common stated answer per pool and window, from a ledger
written by :func:`prorl_async.ledger.write_step` (the writer the learner uses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from prorl_async import ledger

REPO = Path(__file__).resolve().parents[1]


def _step(run_dir: Path, step: int, samples: list[tuple[str, str]]) -> None:
    rows = [{"step": step, "row": i, "domain": dom, "response_text": text} for i, (dom, text) in enumerate(samples)]
    ledger.write_step(run_dir, pa.Table.from_pylist(rows, schema=ledger.LEDGER_SCHEMA), [])


def test_answer_share_shows_a_pool_collapsing_onto_one_answer(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2):  # varied answers on gcd; no answer at all in one sample
        _step(run, step, [("rg:gcd@easy", "6 and 4 share 2. The answer is 2."), ("rg:gcd@easy", "The answer is 3."),
                          ("rg:gcd@easy", "The answer is 2"), ("rg:gcd@easy", "I do not know\nwhat to say"),
                          ("rg:aiw@easy", "The answer is 4.")])
    for step in (3, 4):  # the same policy later: "1" whatever was asked
        _step(run, step, [("rg:gcd@easy", "The answer is 1.")] * 4 + [("rg:aiw@easy", "The answer is 5.")])
    res = subprocess.run([sys.executable, "scripts/answer_share.py", str(run), "--window", "2", "--domains", "gcd"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["| pool | steps 1-2 | steps 3-4 |", "|---|---|---|",
                                       '| rg:gcd@easy | "2" 0.67 (n=6) | "1" 1.00 (n=8) |']


def test_a_long_answer_is_one_short_cell_that_keeps_the_table_whole(tmp_path):
    run = tmp_path / "run"
    ramble = "The answer is 3 | or 4, except when the letters are counted twice over and over"
    _step(run, 1, [("rg:letter_counting@easy", ramble)] * 3 + [("rg:letter_counting@easy", "The answer is 2.")])
    res = subprocess.run([sys.executable, "scripts/answer_share.py", str(run), "--window", "5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    row = res.stdout.splitlines()[2]
    assert row == '| rg:letter_counting@easy | "3 \\| or 4, except whe..." 0.75 (n=4) |', row
    assert row.replace("\\|", "").count("|") == 3  # pool and one window: no column added by the answer


def test_answer_share_without_a_ledger_is_one_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "scripts/answer_share.py", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "train.record_rollouts=true" in res.stderr and "Traceback" not in res.stderr
