"""``scripts/eval_diff.py``: ``prorl-async eval --out`` files as means with standard errors, and two
evaluations of the same prompts compared prompt by prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, outcomes: dict, samples: int = 4) -> Path:
    path.write_text(json.dumps({"samples": samples, "outcomes": outcomes}))
    return path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/eval_diff.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_eval_diff_reads_levels_with_standard_errors_and_pairs_two_checkpoints(tmp_path):
    # two pools of the easy level in two files (one `prorl-async eval` call each), one hard pool
    before = [_write(tmp_path / "b_easy.json", {"a1": ["rg:a@easy", 0, 4], "a2": ["rg:a@easy", 2, 4],
                                                "b1": ["rg:b@easy", 4, 4], "b2": ["rg:b@easy", 0, 4]}),
              _write(tmp_path / "b_hard.json", {"h1": ["rg:a@hard", 0, 4], "h2": ["rg:a@hard", 0, 4]})]
    after = [_write(tmp_path / "a_easy.json", {"a1": ["rg:a@easy", 2, 4], "a2": ["rg:a@easy", 4, 4],
                                               "b1": ["rg:b@easy", 4, 4], "b2": ["rg:b@easy", 2, 4]}),
             _write(tmp_path / "a_hard.json", {"h1": ["rg:a@hard", 1, 4], "h2": ["rg:a@hard", 0, 4]})]
    alone = _run(*after)
    assert alone.returncode == 0, alone.stderr
    lines = alone.stdout.splitlines()
    assert lines[0] == "| domain | prompts | pass@1 ± se | pass@4 ± se |"
    # rg:a@easy: 0.5 and 1.0 -> 0.75 ± sqrt(0.125 / 2) = 0.25; pass@4 1 and 1 -> 1.000 ± 0
    assert "| `rg:a@easy` | 2 | 0.750 ± 0.250 | 1.000 ± 0.000 |" in lines
    # the easy mean of a (0.75 ± 0.25) and b (1.0 and 0.5: 0.75 ± 0.25): 0.750 ± sqrt(0.25² + 0.25²) / 2
    assert "| mean @easy (2) | 4 | 0.750 ± 0.177 | 1.000 ± 0.000 |" in lines
    assert "| mean @hard (1) | 2 | 0.125 ± 0.125 | 0.500 ± 0.500 |" in lines
    paired = _run(*after, "--before", *before)
    assert paired.returncode == 0, paired.stderr
    lines = paired.stdout.splitlines()
    assert lines[0].startswith("| domain | prompts | pass@1 before | after | after - before ± se |")
    # rg:a@easy: each prompt up 0.5: +0.500 with no spread; rg:b@easy: 0 and +0.5: +0.250 ± 0.250
    assert "| `rg:a@easy` | 2 | 0.250 | 0.750 | +0.500 ± 0.000 | 0.500 | 1.000 | +0.500 ± 0.500 |" in lines
    assert "| `rg:b@easy` | 2 | 0.500 | 0.750 | +0.250 ± 0.250 | 0.500 | 1.000 | +0.500 ± 0.500 |" in lines
    assert "| mean @easy (2) | 4 | 0.375 | 0.750 | +0.375 ± 0.125 | 0.500 | 1.000 | +0.500 ± 0.354 |" in lines


def test_eval_diff_refuses_what_it_cannot_pair_with_one_error_line(tmp_path):
    a = _write(tmp_path / "a.json", {"p1": ["m", 1, 4], "p2": ["m", 0, 4]})
    other = _write(tmp_path / "other.json", {"p1": ["m", 1, 4], "q9": ["m", 0, 4]})
    eight = _write(tmp_path / "eight.json", {"p1": ["m", 1, 8], "p2": ["m", 0, 8]}, samples=8)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"samples": 4, "pass@1": 0.5}))  # written before outcomes were kept
    for args, said in (((a, "--before", other), "prompts are in one evaluation and not the other"),
                       ((a, "--before", eight), "--samples 8"),
                       ((a, a), "in more than one of"),
                       ((old,), "no per-prompt outcomes")):
        res = _run(*args)
        assert res.returncode != 0 and res.stderr.startswith("error: ") and said in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
