"""Checkpoint save and restore of a running loop, orchestrated across the actors.

A save comes after the loop's barrier (:meth:`actors.driver.TrainingLoop.barrier`: nothing new
starts; in-flight requests land in the buffer, a running train step and its weight sync finish;
:func:`barrier_wait` says how long it waits), then fills one atomic checkpoint directory
(:mod:`prorl_async.checkpoint`): the learner writes ``policy/`` and ``learner/``
(:mod:`prorl_async.learners.files`), the buffer hands over its unconsumed rows
(``buffer.parquet``), and the driver adds the saved fields of its
:class:`~actors.loop_state.LoopState` (``driver.json``), its RNG states and ``history.jsonl``.
A restore puts all of it back and gives the generators the checkpoint's weights and policy
version through one full weight sync. :func:`save_policy` writes the run directory's HF folders
(``final/``, ``best/``), each atomically.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq
import ray
import torch

from prorl_async import checkpoint
from prorl_async.config import save_config
from prorl_async.models import load_tokenizer
from prorl_async.outputs import BEST, HISTORY, begin_dir, commit_dir, read_best, read_history, write_best_record, write_history
from prorl_async.selection import Best, reconcile
from prorl_async.rng import rng_state, set_rng_state

from actors.cluster import RunError, get

DRIVER = "driver.json"
DEFAULT_DICTS = ("window", "busy_s", "invalid_by_reason")  # sums kept as defaultdict(float)


def _jsonable(x):
    """numpy scalars / arrays in dataset rows -> JSON."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def aim_hash(resume) -> Optional[str]:
    """The Aim run a resumed run continues (None for a new run)."""
    if resume is None:
        return None
    return json.loads((resume.path / DRIVER).read_text()).get("aim_run_hash")


def barrier_wait(pending: int, deadline: float, train) -> float:
    """How long the barrier waits for the next completions, ``pending`` calls still in flight; past
    ``deadline`` (``train.batch_timeout_s`` after it began) the save stops with an error."""
    if time.time() > deadline:
        raise RunError(f"checkpoint barrier: {pending} calls still pending after {train.batch_timeout_s:.0f}s "
                       f"(train.batch_timeout_s); the previous checkpoint is kept")
    return min(train.sync_timeout_s, max(deadline - time.time(), 0.1))


def state_dict(loop, buffer_counters: dict) -> dict:
    """The driver's part of a checkpoint (JSON): the saved loop state, data cursor, buffer counters."""
    s = loop.s
    return {**{k: getattr(s, k) for k in s.SAVED}, "source": loop.source.state_dict(),
            "elapsed_s": time.time() - s.t_start, "buffer_counters": buffer_counters,
            "aim_run_hash": loop.tracker.hash}


def save(loop, reason: str) -> Optional[Path]:
    """A checkpoint of the current step (``reason``: interval, end, error ...), once the loop's
    barrier left nothing in flight; a step already checkpointed is not written again. Returns the
    checkpoint directory (None without a run dir).
    """
    if loop.run_dir is None:
        return None
    s, cfg = loop.s, loop.cfg
    if s.checkpointed == s.version:
        return None
    t0 = time.time()
    buf = ray.get(loop.actors.buffer.state_dict.remote(), timeout=cfg.train.sync_timeout_s)

    def write(tmp: Path) -> dict:
        ray.get(loop.actors.learner.save_checkpoint.remote(str(tmp.resolve()), loop.model_path),
                timeout=max(cfg.train.sync_timeout_s, 600))
        save_config(cfg, tmp / "config.yaml")
        pq.write_table(buf["table"], tmp / "buffer.parquet")
        (tmp / DRIVER).write_text(json.dumps(state_dict(loop, buf["counters"]), default=_jsonable))
        torch.save(rng_state(), tmp / "driver_rng.pt")
        write_history(tmp / HISTORY, s.history)
        return {"version": s.version, "reason": reason, "groups_consumed": s.consumed,
                "prompts_drawn": loop.source.consumed, "buffered_groups": s.buffered}

    path = checkpoint.save(loop.run_dir, s.version, write, keep_last=cfg.train.keep_last,
                           interval=cfg.train.checkpoint_interval)
    s.checkpointed, s.checkpoint_t = s.version, time.time()
    write_history(loop.run_dir / HISTORY, s.history)  # the run directory's history follows the checkpoints
    print(f"checkpoint {path} ({reason}, {time.time() - t0:.1f}s)", flush=True)
    return path


def save_policy(loop, name: str, best: Optional[Best] = None) -> Path:
    """The learner's current policy as the HF folder ``run_dir/name`` (weights, the model's
    tokenizer; ``best.json`` for ``best``), written to a temp folder and renamed into place."""
    tmp = begin_dir(loop.run_dir, name)
    try:
        ray.get(loop.actors.learner.save_model.remote(str(tmp.resolve())), timeout=max(loop.cfg.train.sync_timeout_s, 600))
        try:
            load_tokenizer(loop.model_path).save_pretrained(tmp)
        except (OSError, ValueError):
            pass  # a model folder without a tokenizer (as in a checkpoint's policy/)
        if best is not None:
            write_best_record(tmp, best)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_dir(tmp, loop.run_dir / name)


def restore_best(loop) -> None:
    """``train.keep_best`` at a resume: the better of the checkpoint's record and ``best/best.json``
    (written after the checkpoint, e.g. at the final evaluation), so a worse policy never replaces it."""
    t, s = loop.cfg.train, loop.s
    best = reconcile(Best.from_dict(s.best), read_best(loop.run_dir), t.keep_best, t.keep_best_mode) if t.keep_best else None
    s.best = best.to_dict() if best else {}
    if best:
        print(f"best so far: {best.metric} {best.value:.3f} at step {best.step} ({loop.run_dir / BEST})", flush=True)


def restore(loop, ckpt) -> None:
    """Back to checkpoint ``ckpt``: learner, buffer, data cursor, loop state, RNG states, history;
    generators get the checkpoint's weights and version through one full weight sync."""
    d = json.loads((ckpt.path / DRIVER).read_text())
    actors, s = loop.actors, loop.s
    version = get(actors.learner.load_checkpoint.remote(str(ckpt.path.resolve())), 600, "restoring the learner")
    if version != d["version"]:
        raise RunError(f"checkpoint {ckpt.path}: learner version {version} != driver version {d['version']}")
    table = pq.read_table(ckpt.path / "buffer.parquet")
    n = ray.get(actors.buffer.load_state_dict.remote({"table": table, "counters": d["buffer_counters"]}))
    if n != d["buffered"]:
        raise RunError(f"checkpoint {ckpt.path}: buffer holds {n} groups, the driver counted {d['buffered']}")
    s.gen_version = actors.sync_all(loop.cfg, "weight sync of the restored policy")
    gen_busy_s = s.gen_busy_s
    for k in s.SAVED:
        v = d.get(k, getattr(s, k))  # a field added since the checkpoint keeps its fresh value
        setattr(s, k, defaultdict(float, v) if k in DEFAULT_DICTS else v)
    if len(s.gen_busy_s) != len(gen_busy_s):  # a different number of generators starts from zero
        s.gen_busy_s = gen_busy_s
    s.retry = [(rows, seed) for rows, seed in s.retry]
    loop.source.load_state_dict(d["source"])
    s.checkpointed = d["version"]
    s.history = read_history(ckpt.path / HISTORY)
    s.t_start = time.time() - d["elapsed_s"]
    s.t_last_step = s.last_progress = time.time()
    set_rng_state(torch.load(ckpt.path / "driver_rng.pt", weights_only=False))
    print(f"resumed from {ckpt.path} at step {s.version} ({s.consumed} groups trained, "
          f"{loop.source.consumed} prompts drawn, {s.buffered} groups buffered)", flush=True)
    restore_best(loop)
