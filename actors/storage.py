"""Where the learner writes, checked before step 1: the run directory and the model must be the
same folders on every learner rank's node as on the driver's.

The learner ranks write the checkpoints' weights and the ledger into ``run_dir`` and load the
model from its path; the driver reads both. On one machine that always holds. On a cluster a
``run_dir`` or ``model.cache_dir`` on a node's own disk (a relative path resolves against the
driver's working directory, which under ``ray job submit`` is a temporary folder on the head)
would let a run train for hours and then find its checkpoints on another node's disk. So the
driver writes a probe file with a fresh token into ``run_dir``; every rank reads it, writes the
token back into a file of its own and reports whether the model's folder exists
(:func:`prorl_async.outputs.look_at_run_dir`, run inside the learner actor); the driver reads the ranks' files
(:func:`open_run_dir`). Anything not seen is one :class:`~actors.cluster.RunError` naming the path,
the rank and its node, and the fix. The Aim repo is written by the driver only and needs no check.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import ray

from prorl_async.outputs import PROBE, probe_rank_file, read_or_empty

from actors.cluster import RunError


def problems(run_dir: Path, token: str, reports: list[dict], model_path: str, configured_run_dir: str) -> list[str]:
    """What a rank did not see, one sentence each, with the fix ([] when every rank sees both)."""
    relative = "" if Path(configured_run_dir).is_absolute() else \
        f" (run_dir={configured_run_dir} is relative: it resolved against the driver's working directory)"
    out = []
    for r in reports:
        where = f"learner rank {r['rank']} on node {r['node']}"
        if r["token"] != token:
            out.append(f"run_dir {run_dir} is not the driver's folder on {where}{relative}: checkpoints and the "
                       f"ledger would be written where the driver cannot read them; put run_dir on storage every "
                       f"node mounts at the same path (run_dir=/shared/runs/NAME)")
        elif r["write_error"] or read_or_empty(probe_rank_file(run_dir, r["rank"])) != token:
            out.append(f"run_dir {run_dir} is read-only or another folder for writes on {where} "
                       f"({r['write_error'] or 'its file did not reach the driver'}); make it writable from every node")
        if not r["model_seen"]:
            out.append(f"the model {model_path} does not exist on {where}; put model.cache_dir (built-in models) or "
                       f"model.path on storage every node mounts at the same path")
    return out


def open_run_dir(cfg, learner, run_dir: str | Path, model_path: str) -> int:
    """Every learner rank sees ``run_dir`` and the model as the driver does (or one RunError), then
    the ledger is opened there (``train.record_rollouts``); the number of ranks checked.
    ``learner``: a LearnerActor or LearnerGroup handle."""
    run_dir = Path(run_dir).resolve()
    token = secrets.token_hex(16)
    (run_dir / PROBE).write_text(token)
    try:
        got = ray.get(learner.look_at_run_dir.remote(str(run_dir), model_path))
        reports = got if isinstance(got, list) else [got]
        found = problems(run_dir, token, reports, model_path, cfg.run_dir or str(run_dir))
    finally:
        for f in run_dir.glob(f"{PROBE}*"):
            f.unlink(missing_ok=True)
    if found:
        raise RunError("; ".join(found))
    if cfg.train.record_rollouts:  # the ledger of every trained token (prorl_async.ledger)
        ray.get(learner.record_ledger.remote(str(run_dir)))
    return len(reports)
