"""``prorl-async compare``: runs side by side, read back from Aim.

Each argument is a run directory (its ``summary.json`` names the Aim run hash and its
``config.yaml`` the Aim repo) or an Aim run hash (or unique prefix) in ``--repo``. Metrics,
their timestamps (wall time per point) and the hyperparameters (``run["hparams"]``, the
resolved config) come from Aim's SDK, so a run whose directory was lost still compares.

Aim's SDK reads runs through the repo's index (``.aim/meta/index``); a run that was closed
while no indexer (``aim up`` / ``aim-watcher``) was running is not in it, and
``Repo.get_run`` returns ``None`` for it. :func:`open_runs` therefore indexes the requested
runs itself first (``RepoIndexManager.index``, what ``aim up`` runs in the background).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from prorl_async.config import diff_configs


class CompareError(ValueError):
    """A run that cannot be found or read; the message says which and where we looked."""


# (metric, context, how "best" is taken) rows of the table; None context = the run-wide one
TABLE_METRICS = [
    ("reward/mean", None, "max"),
    ("reward/accuracy", None, "max"),
    ("val/pass@1", {"split": "eval"}, "max"),
    ("kl/loss_term", None, "max"),
    ("actor/approx_kl", None, "max"),
    ("len/response_mean", None, "mean"),
    ("perf/gen_tok_s", None, "mean"),
    ("perf/train_tok_s", None, "mean"),
]
# panels of the figure; the first name a run has is plotted
PLOT_PANELS = [
    ("reward", ["reward/mean"]),
    ("accuracy", ["reward/accuracy"]),
    ("KL", ["kl/loss_term", "actor/approx_kl"]),
    ("response length", ["len/response_mean", "len/generated_mean"]),
]


@dataclass
class Series:
    steps: list
    values: list
    wall: list  # seconds since the run started (Aim's per-point timestamps)


@dataclass
class RunData:
    label: str
    hash: str
    repo: str
    experiment: str
    hparams: dict
    duration_s: Optional[float]
    summary: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)  # (name, context json) -> Series

    def series(self, name: str, context: Optional[dict] = None) -> Optional[Series]:
        return self.metrics.get((name, json.dumps(context or {}, sort_keys=True)))


# ---------------------------------------------------------------------------- resolving
def _resolve(arg: str, default_repo: str) -> tuple[str, str, dict]:
    """``(repo path, run hash or prefix, summary)`` for a run directory or a hash."""
    p = Path(arg)
    if p.is_dir():
        summary_path = p / "summary.json"
        if not summary_path.is_file():
            raise CompareError(f"{arg}: run directory has no summary.json (the run did not finish); "
                               f"pass its Aim run hash instead")
        summary = json.loads(summary_path.read_text())
        run_hash = summary.get("aim_run_hash")
        if not run_hash:
            raise CompareError(f"{arg}: summary.json has no aim_run_hash (tracking was disabled)")
        repo = default_repo
        cfg_path = p / "config.yaml"
        if cfg_path.is_file():
            cfg_repo = (yaml.safe_load(cfg_path.read_text()) or {}).get("tracking", {}).get("aim_repo")
            if cfg_repo and (Path(cfg_repo) / ".aim").is_dir():
                repo = cfg_repo
        return repo, run_hash, summary
    return default_repo, arg, {}


def _open_repo(path: str):
    from aim import Repo

    if not (Path(path) / ".aim").is_dir():
        raise CompareError(f"no Aim repo at {path!r} (expected {path}/.aim); pass --repo with the "
                           f"folder of tracking.aim_repo")
    return Repo(str(path))


def refresh_index(repo, hashes: list[str], lock_timeout_s: float = 30.0) -> None:
    """Index ``hashes`` so that ``repo.get_run`` sees them even if they were closed unindexed.

    Takes the repo's index lock (waiting up to ``lock_timeout_s``); if a running ``aim up``
    holds it, its own indexer keeps the index fresh and we read what it has.
    """
    from aim.sdk.index_manager import RepoIndexManager

    try:
        index = repo._get_index_container("meta", timeout=lock_timeout_s)  # held for the index() calls below
    except Exception as e:  # the lock is held by a live indexer
        print(f"warning: could not lock the Aim index of {repo.root_path} ({type(e).__name__}); "
              f"reading it as it is", file=sys.stderr)
        return
    try:
        manager = RepoIndexManager.get_index_manager(repo)
        for h in hashes:
            manager.index(h)
    finally:
        index.close()
        repo.container_pool.clear()  # drop read views opened before the refresh


def _match_hash(repo, prefix: str, repo_path: str) -> str:
    all_runs = repo.list_all_runs()  # from the chunk folders: no index needed
    matches = [h for h in all_runs if h.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CompareError(f"no Aim run {prefix!r} in {repo_path} ({len(all_runs)} runs there); "
                           f"pass a run directory or a hash listed by `aim runs --repo {repo_path} ls`")
    raise CompareError(f"{prefix!r} matches {len(matches)} runs in {repo_path}; give more of the hash")


def _read_run(run, label: str, repo_path: str, summary: dict) -> RunData:
    start = run.creation_time
    data = RunData(label=label, hash=run.hash, repo=repo_path, experiment=run.experiment or "",
                   hparams=run.get("hparams", {}) or {}, duration_s=run.duration, summary=summary)
    for metric in run.metrics():
        if metric.name.startswith("__system__"):
            continue
        steps, (values, _epochs, stamps) = metric.data.items_list()
        key = (metric.name, json.dumps(metric.context.to_dict(), sort_keys=True))
        data.metrics[key] = Series(list(steps), [float(v) for v in values], [t - start for t in stamps])
    return data


def open_runs(args: list[str], default_repo: str = "runs") -> list[RunData]:
    resolved = [_resolve(a, default_repo) for a in args]
    repos: dict[str, object] = {}
    hashes: list[tuple[str, str, dict]] = []
    for repo_path, prefix, summary in resolved:
        if repo_path not in repos:
            repos[repo_path] = _open_repo(repo_path)
        hashes.append((repo_path, _match_hash(repos[repo_path], prefix, repo_path), summary))
    for repo_path, repo in repos.items():
        refresh_index(repo, [h for rp, h, _ in hashes if rp == repo_path])
    out = []
    for repo_path, h, summary in hashes:
        run = repos[repo_path].get_run(h)
        if run is None:
            raise CompareError(f"Aim run {h} in {repo_path} could not be read from the repo index")
        out.append(_read_run(run, run.name or h, repo_path, summary))
    return out


# ---------------------------------------------------------------------------- table
def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def _agg(values: list, how: str) -> Optional[float]:
    if not values:
        return None
    return {"max": max, "min": min, "mean": lambda v: sum(v) / len(v)}[how](values)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(runs: list[RunData]) -> list[str]:
    keys: set[str] = set()
    for r in runs[1:]:
        keys.update(diff_configs(runs[0].hparams, r.hparams))
    return sorted(keys)


def table_rows(runs: list[RunData]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("run", [r.label for r in runs]),
        ("aim hash", [r.hash for r in runs]),
        ("experiment", [r.experiment for r in runs]),
    ]
    steps = []
    for r in runs:
        s = r.series("reward/mean") or next(iter(r.metrics.values()), None)
        steps.append(_fmt(max(s.steps)) if s and s.steps else "-")
    rows.append(("steps", steps))
    rows.append(("wall time (s)", [_fmt(r.summary.get("wall_time_s", r.duration_s)) for r in runs]))
    for name, ctx, how in TABLE_METRICS:
        series = [r.series(name, ctx) for r in runs]
        if not any(series):
            continue
        rows.append((f"{name} final", [_fmt(s.values[-1]) if s and s.values else "-" for s in series]))
        rows.append((f"{name} {how}", [_fmt(_agg(s.values, how)) if s else "-" for s in series]))
    diffs = config_differences(runs)
    flat = [_flatten(r.hparams) for r in runs]
    for key in diffs:
        rows.append((f"config: {key}", [_fmt(f.get(key)) for f in flat]))
    if not diffs and len(runs) > 1:
        rows.append(("config", ["identical"] * len(runs)))
    return rows


def format_table(rows: list[tuple[str, list[str]]], max_width: int = 28) -> str:
    def cut(s: str) -> str:
        return s if len(s) <= max_width else s[: max_width - 1] + "~"

    label_w = max(len(k) for k, _ in rows)
    ncol = len(rows[0][1])
    widths = [max(len(cut(vals[i])) for _, vals in rows) for i in range(ncol)]
    lines = []
    for k, vals in rows:
        cells = "  ".join(f"{cut(v):>{w}}" for v, w in zip(vals, widths))
        lines.append(f"{k:<{label_w}}  {cells}")
        if k == "run":
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- figure
def plot(runs: list[RunData], out: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PLOT_PANELS), figsize=(4.2 * len(PLOT_PANELS), 7), squeeze=False)
    for col, (title, names) in enumerate(PLOT_PANELS):
        for r in runs:
            name = next((n for n in names if r.series(n)), None)
            if name is None:
                continue
            s = r.series(name)
            axes[0][col].plot(s.steps, s.values, marker=".", label=r.label)
            axes[1][col].plot(s.wall, s.values, marker=".", label=r.label)
        axes[0][col].set_title(f"{title} vs step")
        axes[1][col].set_title(f"{title} vs wall time")
        axes[0][col].set_xlabel("learner step")
        axes[1][col].set_xlabel("seconds since run start")
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def compare(args: list[str], repo: str = "runs", out: str = "compare.png") -> str:
    """Print-ready table of ``args`` (run dirs or hashes); writes the figure to ``out``."""
    runs = open_runs(args, repo)
    text = format_table(table_rows(runs))
    path = plot(runs, out)
    return f"{text}\n\nfigure: {path}"
