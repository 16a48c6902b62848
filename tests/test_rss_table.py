"""``scripts/rss_table.py``: each actor's resident size in two windows of a run's history."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_rss_table_reads_growth_by_median_and_idle_minimum(tmp_path):
    history = []
    for step in range(1, 41):  # the generator grows 5 MB a step; the learner swings idle/busy without growing
        history.append({"step": step, "sys/rss_mb/generator0": 1000.0 + 5 * step,
                        "sys/rss_mb/learner": 3000.0 if step % 2 else 7000.0, "reward/mean": 0.5})
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    res = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path), "--windows", "1-10", "31-40"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "| actor | median 1-10 | median 31-40 | change | min 1-10 | min 31-40 | change |"
    assert "| generator0 | 1028 | 1178 | +150 | 1005 | 1155 | +150 |" in lines
    assert "| learner | 5000 | 5000 | +0 | 3000 | 3000 | +0 |" in lines
    # the learner's two modes, each flat; the generator's steady growth is one mode (no gap of 200 MB)
    assert "| learner | 5000 | 3000 | 3000 | +0 | 7000 | 7000 | +0 |" in lines
    assert not any(line.startswith("| generator0 | 1") for line in lines[lines.index("|---|---|---|---|---|---|---|---|"):])
    default = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert default.returncode == 0 and "| median 21-40 | median 21-40 |" in default.stdout
    bad = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path), "--windows", "50-60", "1-10"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no sys/rss_mb/* readings in steps 50-60" in bad.stderr


def test_rss_table_reads_an_actor_with_two_modes_by_each_modes_median(tmp_path):
    """A generator caught busy (+800 MB) in 3 of 10 steps at the start and 8 of 10 at the end: its median
    jumps ~800 MB with nothing held more; each mode's median reads the growth (here +0 idle, +30 busy)."""
    history = []
    for step in range(1, 41):
        busy = (step % 10 < 3) if step <= 10 else (step % 10 < 8)
        history.append({"step": step, "sys/rss_mb/generator0": (3430.0 + 30 * (step > 30)) if busy else 2600.0,
                        "sys/rss_mb/buffer": 330.0 + step % 3})
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    res = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path), "--windows", "1-10", "31-40"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert "| generator0 | 2600 | 3460 | +860 | 2600 | 2600 | +0 |" in lines  # the median mixes the modes
    assert ("| actor | split | idle median 1-10 | idle median 31-40 | change | busy median 1-10 | busy median 31-40 "
            "| change |") in lines
    assert "| generator0 | 3015 | 2600 | 2600 | +0 | 3430 | 3460 | +30 |" in lines
    assert not any(line.startswith("| buffer | 3") for line in lines[lines.index("|---|---|---|---|---|---|---|---|"):])
    # a wider --gap than the modes' distance reads one mode
    one = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path), "--windows", "1-10", "31-40",
                          "--gap", "1000"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and "two modes" not in one.stdout, one.stdout


def test_rss_table_every_reads_each_modes_trend_over_the_whole_run(tmp_path):
    """--every 20: a learner whose busy readings grow 2 MB a step and whose idle ones stay flat, and a
    buffer with one mode that does not grow: each mode's 20-step medians from step 21, and the slope."""
    history = []
    for step in range(1, 101):
        busy = step % 3 == 0
        history.append({"step": step, "sys/rss_mb/learner": 7000.0 + 2 * step if busy else 3000.0 + step % 2,
                        "sys/rss_mb/buffer": 330.0 + step % 3})
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    res = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path), "--every", "20"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    head = lines.index("| actor | mode | 21-40 | 41-60 | 61-80 | 81-100 | slope MB/step |")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[3:-1] for line in lines[head + 2:]}
    # split between 3001 and 7042; busy steps 21-40: 21, 24, ..., 39 -> median step 30 -> 7060, and so on
    busy = rows[("learner", "busy (>=5022)")]
    assert [c.strip() for c in busy] == ["7060", "7102", "7141", "7180", "+2.00"], busy
    idle = rows[("learner", "idle (<5022)")]
    assert [c.strip() for c in idle][-1] in ("+0.00", "-0.00"), idle
    assert [c.strip() for c in rows[("buffer", "all")]][-1] in ("+0.00", "-0.00", "+0.01", "-0.01")
    # without --every, no trend table
    plain = subprocess.run([sys.executable, "scripts/rss_table.py", str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "slope MB/step" not in plain.stdout
