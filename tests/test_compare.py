"""``prorl-async compare`` through the real console script, on a closed, unindexed Aim repo.

Two real Aim runs are written with :class:`prorl_async.tracking.Tracker` (no Ray) plus the run
directories a training run leaves (config.yaml, summary.json, history.jsonl), and closed. No
indexer ran, so Aim's SDK cannot see them until ``compare`` refreshes the index itself.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from prorl_async.config import config_to_dict, load_config, save_config
from prorl_async.tracking import Tracker
from tests.conftest import cli

STEPS = 5


def _make_run(root, repo, name: str, staleness: int, reward_slope: float) -> dict:
    run_dir = root / name
    run_dir.mkdir()
    cfg = load_config(None, [f"train.max_staleness={staleness}", f"tracking.aim_repo={repo}",
                             f"run_dir={run_dir}", f"tracking.run_name={name}"])
    save_config(cfg, run_dir / "config.yaml")
    t = Tracker(str(repo), "compare-test", name, config_to_dict(cfg))
    history = []
    t0 = time.time()
    for step in range(1, STEPS + 1):
        m = {"reward/mean": reward_slope * step, "reward/accuracy": reward_slope * step / 2,
             "kl/loss_term": 1e-3 * step, "len/response_mean": 10.0 + step,
             "perf/gen_tok_s": 1000.0 + step, "perf/train_tok_s": 500.0}
        t.track(m, step)
        history.append({"step": step, "time": time.time() - t0, **m})
        time.sleep(0.02)
    t.track({"val/pass@1": 0.25 + staleness / 10}, STEPS, {"split": "eval"})
    summary = {"run_dir": str(run_dir), "aim_run_hash": t.hash, "steps": STEPS, "wall_time_s": 12.5 + staleness}
    t.close()
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "history.jsonl").write_text("\n".join(json.dumps(h) for h in history) + "\n")
    return {"dir": run_dir, "hash": summary["aim_run_hash"], "name": name}


@pytest.fixture(scope="module")
def closed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    repo = root / "aim"
    runs = [_make_run(root, repo, "sync-s0", 0, 0.1), _make_run(root, repo, "async-s2", 2, 0.15)]
    return root, repo, runs


def _rows(stdout: str) -> dict:
    """Table row label -> list of cells (labels may hold spaces; cells never do here)."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).split()
    return out


def _check_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > min_bytes, len(data)


def test_sdk_does_not_see_closed_runs_before_refresh(closed_runs):
    from aim import Repo

    _, repo, runs = closed_runs
    r = Repo(str(repo))
    assert sorted(r.list_all_runs()) == sorted(x["hash"] for x in runs)
    assert all(r.get_run(x["hash"]) is None for x in runs)  # the case compare must handle


def test_compare_run_dirs(closed_runs, tmp_path):
    root, repo, (a, b) = closed_runs
    png = tmp_path / "out" / "cmp.png"
    res = cli("compare", str(a["dir"]), str(b["dir"]), "--out", str(png), cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr
    rows = _rows(res.stdout)
    assert rows["run"] == ["sync-s0", "async-s2"]
    assert rows["aim hash"] == [a["hash"], b["hash"]]
    assert rows["steps"] == ["5", "5"]
    assert rows["wall time (s)"] == ["12.5", "14.5"]
    assert rows["reward/mean final"] == ["0.5", "0.75"]
    assert rows["reward/mean max"] == ["0.5", "0.75"]
    assert rows["reward/accuracy final"] == ["0.25", "0.375"]
    assert rows["val/pass@1 final"] == ["0.25", "0.45"]
    assert rows["kl/loss_term final"] == ["0.005", "0.005"]
    assert rows["len/response_mean mean"] == ["13", "13"]
    assert rows["perf/gen_tok_s final"] == ["1005", "1005"]
    assert rows["perf/train_tok_s mean"] == ["500", "500"]
    assert rows["config: train.max_staleness"] == ["0", "2"]
    assert "config: algo.clip_eps_high" not in rows  # only differences are listed
    _check_png(png)

    from aim import Repo  # compare refreshed the index: the SDK now sees both runs
    assert all(Repo(str(repo)).get_run(x["hash"]) is not None for x in (a, b))


def test_compare_by_hash_and_prefix(closed_runs, tmp_path):
    _, repo, (a, b) = closed_runs
    png = tmp_path / "h.png"
    res = cli("compare", a["hash"], b["hash"][:8], "--repo", str(repo), "--out", str(png), cwd=tmp_path,
              timeout=180)
    assert res.returncode == 0, res.stderr
    rows = _rows(res.stdout)
    assert rows["run"] == ["sync-s0", "async-s2"]
    assert rows["config: train.max_staleness"] == ["0", "2"]
    # without summary.json the wall time is Aim's run duration
    assert all(float(v) > 0 for v in rows["wall time (s)"])
    _check_png(png)


def test_unknown_hash_is_one_error_line(closed_runs, tmp_path):
    _, repo, _ = closed_runs
    res = cli("compare", "0123456789abcdef", "--repo", str(repo), "--out", str(tmp_path / "x.png"),
              cwd=tmp_path, timeout=180)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no Aim run '0123456789abcdef'"), res.stderr
    assert not (tmp_path / "x.png").exists()


def test_missing_repo_is_one_error_line(tmp_path):
    res = cli("compare", "abc", "--repo", str(tmp_path / "nope"), cwd=tmp_path, timeout=180)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: no Aim repo at") and len(res.stderr.strip().splitlines()) == 1
