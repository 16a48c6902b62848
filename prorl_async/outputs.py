"""What a run leaves in its run directory, written from one place.

    config.yaml            the resolved config (written at the start, :func:`prorl_async.config.save_config`)
    history.jsonl          one JSON object per learner step (metrics; ``val/*`` added at evaluations);
                           rewritten atomically at every checkpoint and at the end, and the same
                           file goes into each checkpoint
    summary.json           steps, wall time, held-out metrics before/after, failure counters, last metrics
    trained_groups.jsonl   per step, the ``request_id/prompt_id`` of every group the learner trained on
    final/                 the trained policy as a HF folder (weights by the learner, tokenizer)
    best/                  with ``train.keep_best``: the evaluated policy with the best held-out value
                           (HF folder like final/, plus ``best.json``: metric, mode, step, value)
    checkpoints/           :mod:`prorl_async.checkpoint`
    ledger/                every trained token, one Parquet file per step (:mod:`prorl_async.ledger`)
    .storage-probe*        for a moment before step 1: the driver's token and each learner rank's copy
                           (:mod:`actors.storage`: the same folder on every node)

Pure: no Ray.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Optional

from prorl_async.checkpoint import TMP_PREFIX, atomic_write_text, fsync_dir, fsync_tree
from prorl_async.selection import Best

HISTORY = "history.jsonl"
SUMMARY = "summary.json"
TRAINED_GROUPS = "trained_groups.jsonl"
FINAL, BEST = "final", "best"
BEST_JSON = "best.json"


def prepare_run_dir(cfg) -> Path:
    """``cfg.run_dir``, or ``runs/<run_name>-<time>``; created if missing."""
    run_dir = Path(cfg.run_dir or Path("runs") / f"{cfg.tracking.run_name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def begin_dir(run_dir: Path, name: str) -> Path:
    """A fresh temp folder in ``run_dir`` for ``name`` (final, best); earlier leftovers removed."""
    run_dir = Path(run_dir)
    for old in run_dir.glob(f"{TMP_PREFIX}*-{name}"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = run_dir / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
    tmp.mkdir()
    return tmp


def commit_dir(tmp: Path, dest: Path) -> Path:
    """Swap the finished folder ``tmp`` in as ``dest``: every file fsynced, an old ``dest`` moved
    aside, ``tmp`` renamed, the old one removed. A reader sees the old folder or the new one."""
    fsync_tree(tmp)
    old = None
    if dest.exists():
        old = dest.with_name(f"{TMP_PREFIX}{os.getpid()}-old-{secrets.token_hex(4)}-{dest.name}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def write_best_record(folder: Path, best: Best) -> None:
    (Path(folder) / BEST_JSON).write_text(json.dumps(best.to_dict(), indent=1) + "\n")


def read_best(run_dir: Path) -> Optional[Best]:
    """What ``run_dir/best/`` holds (None when there is none)."""
    try:
        return Best.from_dict(json.loads((Path(run_dir) / BEST / BEST_JSON).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def _jsonl(rows: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_history(path: Path, history: list[dict]) -> None:
    """``history`` (one dict per step) as JSON lines at ``path``, atomically."""
    atomic_write_text(Path(path), _jsonl(history))


def read_history(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def write_final(run_dir: Path, summary: dict, history: list[dict], trained_groups: list[list[str]]) -> None:
    """The outputs of a finished run: summary, history and the groups trained on."""
    run_dir = Path(run_dir)
    (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    write_history(run_dir / HISTORY, history)
    (run_dir / TRAINED_GROUPS).write_text(_jsonl(trained_groups))


def format_table(before: dict, after: dict) -> str:
    """The held-out metrics before and after training, side by side."""
    keys = [k for k in before if k in after]
    lines = [f"{'held-out metric':<28}{'before':>10}{'after':>10}{'change':>10}"]
    for k in keys:
        lines.append(f"{k:<28}{before[k]:>10.3f}{after[k]:>10.3f}{after[k] - before[k]:>+10.3f}")
    return "\n".join(lines)


PROBE = ".storage-probe"


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def probe_rank_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"{PROBE}-rank{rank}"


def look_at_run_dir(run_dir: str, rank: int, node: str, model_path: str) -> dict:
    """What a learner rank sees on its node: the driver's token in ``run_dir`` (written back into
    its own file there) and whether ``model_path`` exists."""
    token = read_or_empty(Path(run_dir) / PROBE)
    wrote = ""
    if token:
        try:
            probe_rank_file(run_dir, rank).write_text(token)
        except OSError as e:
            wrote = f"{type(e).__name__}: {e}"
    return {"rank": rank, "node": node, "token": token, "write_error": wrote,
            "model_seen": bool(model_path) and Path(model_path).exists()}
