"""Atomic checkpoints of a run, and what an exact resume needs to find them.

Layout, under a run directory (the one holding ``config.yaml``)::

    checkpoints/
      step-000010/          one complete checkpoint (see below)
      step-000020/
      latest                "step-000020" — written last, atomically
      .tmp-<pid>-<step>-<token>/   a save in progress (or one a killed process left behind)

A save writes everything into a fresh temp directory, writes ``manifest.json`` (every file
with its size) last, fsyncs every file and directory, renames the directory to
``step-NNNNNN`` and only then replaces ``latest`` (temp file + fsync + rename + fsync of
the folder). A process killed at any point leaves either the previous ``latest`` or the new
one, never a pointer to a partial directory; leftover temp directories are ignored by
:func:`load_latest` and removed by the next save. Old checkpoints are pruned to ``keep_last``.

What a checkpoint holds (written by the driver and the learner, read back by
``prorl-async train --resume``)::

    manifest.json     step, policy version, reason, files and sizes (last file written)
    config.yaml       the resolved config of the run
    policy/           the policy as a HF folder (safetensors weights, config, tokenizer);
                      generators of the resumed run start from it
    learner/          reference weights (safetensors), optimizer + LR-scheduler state,
                      length-penalty schedule, reference-reset policy, skipped-step
                      counters, the learner process's python/numpy/torch RNG states
                      (``state.pt``; with DeepSpeed instead DeepSpeed's own checkpoint in
                      ``learner/deepspeed/``, ZeRO-partitioned per rank, RNG states per rank)
    driver.json       loop counters (step, policy version, groups consumed, request counter
                      that seeds generation), data cursor, rollout stats since the last step,
                      cumulative timings, replay-buffer counters, Aim run hash
    driver_rng.pt     the driver process's python/numpy/torch RNG states
    buffer.parquet    the replay buffer's unconsumed rows (rollout schema)
    history.jsonl     per-step metrics so far

Pure: no Ray. The writers of the pieces live with their owners: the learner's files
(``policy/``, ``learner/``) in :mod:`prorl_async.learners.files`, the buffer's rows in
``ReplayBuffer.state_dict``, the driver's part in ``actors/checkpointing.py``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d{6,})$")

# Fields a resumed run may change: they do not touch the math, the data or the sampling.
RESUME_MUTABLE = (
    "run_dir", "train.total_steps", "train.checkpoint_interval", "train.checkpoint_every_s", "train.keep_last", "train.eval_interval",
    "train.eval_samples", "train.eval_temperature", "train.keep_best", "train.keep_best_mode", "train.stop_at",
    "train.batch_timeout_s", "train.sync_timeout_s", "train.record_rollouts", "reward.num_workers",
    "model.cache_dir", "tracking.", "ray.",
    "rollout.generator_resources.", "train.learner_resources.", "reward.grader_resources.",  # which node runs what
)


class CheckpointError(ValueError):
    """No usable checkpoint / not a run / refused resume; the message says which and why."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    manifest: dict

    @property
    def version(self) -> int:
        return int(self.manifest.get("version", self.step))


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------- durability
def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (deepest first), then ``root``."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            fsync_file(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------- saving
def checkpoints_dir(run_dir) -> Path:
    return Path(run_dir) / CHECKPOINTS


def begin(run_dir, step: int) -> Path:
    """A fresh temp directory for a save of ``step`` (clean up stale ones first)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(run_dir)
    tmp = root / f"{TMP_PREFIX}{os.getpid()}-{step}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _manifest(tmp: Path, step: int, extra: dict) -> dict:
    files = {}
    for dirpath, _dirs, names in os.walk(tmp):
        for n in names:
            p = Path(dirpath) / n
            files[str(p.relative_to(tmp))] = p.stat().st_size
    return {"format": 1, "step": step, "created": time.time(), **extra, "files": dict(sorted(files.items()))}


def commit(run_dir, tmp: Path, step: int, keep_last: int, extra: Optional[dict] = None, interval: int = 0) -> Path:
    """Seal ``tmp`` as checkpoint ``step``: manifest, fsync, rename, ``latest``, prune (``interval``: see :func:`prune`)."""
    root = checkpoints_dir(run_dir)
    tmp = Path(tmp)
    manifest = _manifest(tmp, step, extra or {})
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
    fsync_tree(tmp)
    final = root / step_name(step)
    old = None
    if final.exists():  # a re-save of the same step (e.g. after an error stop), or one `latest` never named
        old = root / f"{TMP_PREFIX}{os.getpid()}-old-{secrets.token_hex(4)}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    prune(run_dir, keep_last, interval)
    return final


def save(run_dir, step: int, write: Callable[[Path], Optional[dict]], keep_last: int = 2, interval: int = 0) -> Path:
    """``write(tmp_dir)`` fills a temp directory (may return manifest extras); then :func:`commit`."""
    tmp = begin(run_dir, step)
    try:
        extra = write(tmp) or {}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(run_dir, tmp, step, keep_last, extra, interval)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(run_dir) -> list[str]:
    """Remove temp directories left by saves whose process is gone (or by this process)."""
    root = checkpoints_dir(run_dir)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        try:
            pid = int(p.name[len(TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            pid = -1
        if pid == os.getpid() or pid < 0 or not _pid_alive(pid):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def _numbered(run_dir) -> list[tuple[int, Path]]:
    """(step, directory) of each checkpoint directory, oldest first (temp directories never match)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir())


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoint directories, oldest first (temp directories are never listed)."""
    return [p for _, p in _numbered(run_dir)]


def _reason(ckpt: Path) -> str:
    try:
        return str(json.loads((ckpt / MANIFEST).read_text()).get("reason", ""))
    except (OSError, ValueError):
        return ""


def prune(run_dir, keep_last: int, interval: int = 0) -> list[str]:
    """Keep the newest ``keep_last`` checkpoints (never the one ``latest`` names). A timed one
    (``train.checkpoint_every_s``, reason "timed") is a safety net: it goes once a newer checkpoint
    exists, so the interval checkpoints kept for evaluation are not crowded out -- unless its step
    is a multiple of ``interval`` (``train.checkpoint_interval``): the timer fired a step early and
    the barrier landed the interval step, which stays like any interval checkpoint."""
    root = checkpoints_dir(run_dir)
    latest = _read_latest(root)
    numbered = _numbered(run_dir)
    superseded = [p for step, p in numbered[:-1]
                  if _reason(p) == "timed" and not (interval > 0 and step % interval == 0)]
    ckpts = [p for _, p in numbered if p not in superseded]
    doomed = superseded + (ckpts[:-keep_last] if keep_last > 0 else ckpts)
    removed = []
    for p in doomed:
        if p.name == latest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if removed:
        fsync_dir(root)
    return removed


# ---------------------------------------------------------------------------- loading
def _read_latest(root: Path) -> Optional[str]:
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    return name if _STEP_RE.match(name) else None


def _verify(path: Path) -> Optional[dict]:
    """The manifest of a complete checkpoint directory, or None if it is not one."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for rel, size in manifest["files"].items():
            if (path / rel).stat().st_size != size:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_run_dir(run_dir) -> bool:
    return (Path(run_dir) / "config.yaml").is_file()


def load_latest(run_dir) -> Checkpoint:
    """The newest complete checkpoint of ``run_dir``.

    ``latest`` names it; if the pointer is missing or names something that is not a complete
    checkpoint (deleted by hand), the newest complete ``step-*`` directory is used instead.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a prorl-async run: no such directory")
    if not is_run_dir(run_dir):
        raise CheckpointError(f"{run_dir} is not a prorl-async run: no config.yaml")
    root = checkpoints_dir(run_dir)
    name = _read_latest(root)
    if name is not None and (manifest := _verify(root / name)) is not None:
        return Checkpoint(root / name, int(manifest["step"]), manifest)
    for p in reversed(list_checkpoints(run_dir)):
        if (manifest := _verify(p)) is not None:
            return Checkpoint(p, int(manifest["step"]), manifest)
    raise CheckpointError(f"no checkpoint in {run_dir} (expected {root}/{LATEST}; "
                          f"set train.checkpoint_interval to save during a run)")


# ---------------------------------------------------------------------------- resume config
def resume_mutable(key: str) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in RESUME_MUTABLE)


def resume_config(ckpt: Checkpoint, run_dir, overrides: list[str]):
    """The checkpoint's resolved config plus ``overrides``; refuses fields that change the math."""
    from prorl_async.config import config_to_dict, diff_configs, load_config

    saved = load_config(str(ckpt.path / "config.yaml"))
    cfg = load_config(str(ckpt.path / "config.yaml"), [*overrides, f"run_dir={Path(run_dir)}"])
    refused = [k for k in diff_configs(config_to_dict(saved), config_to_dict(cfg)) if not resume_mutable(k)]
    if refused:
        raise CheckpointError(
            f"cannot resume {run_dir} with a different {', '.join(refused)} (the checkpoint was trained with "
            f"other values); a resumed run may change only {', '.join(m.rstrip('.') + ('.*' if m.endswith('.') else '') for m in RESUME_MUTABLE)}")
    return cfg


def policy_folder(path) -> Path:
    """The HF model folder a path names, for ``prorl-async eval --model``: an HF folder itself, a
    checkpoint (its ``policy/``), or a run directory (its newest checkpoint's ``policy/``, which
    carries the tokenizer; else its ``final/``). Other paths come back unchanged."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / "policy" / "config.json").is_file():
        return p / "policy"
    for ckpt in reversed(list_checkpoints(p)):
        if (ckpt / "policy" / "config.json").is_file():
            return ckpt / "policy"
    return p / "final" if (p / "final" / "config.json").is_file() else p
