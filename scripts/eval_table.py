"""Per-domain held-out pass@1 / pass@k of a run at every evaluation, as a markdown table.

    python scripts/eval_table.py RUN_DIR [--k 16] [--prior]

Reads the run's ``history.jsonl`` (the ``val/*`` metrics of the in-run evaluations) and the
step-0 evaluation (``summary.json``'s ``before``, or the newest checkpoint's ``driver.json`` while
the run is still going). One row per domain (for Reasoning Gym sources ``rg:TASK@LEVEL``), one
pass@1 and one pass@k column per evaluated step, then the means over the rows whose level is
``easy``, ``hard`` and ``ood``. ``--prior``: first a column of what the run's held-out answers
alone score (``prior@1 / prior@k``, :func:`prorl_async.metrics.answer_prior`, from the rows of
its ``data.eval`` loaded again with its ``config.yaml``; no model).
docs/prorl_in_miniature.md is written from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def evaluations(run_dir: Path) -> dict[int, dict]:
    """``{step: {metric: value}}`` of every held-out evaluation of the run, step 0 included."""
    out = {}
    summary = run_dir / "summary.json"
    if summary.exists():
        before = json.loads(summary.read_text()).get("before", {})
    else:
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        before = json.loads((run_dir / "checkpoints" / latest / "driver.json").read_text()).get("before", {})
    if before:
        out[0] = before
    for line in (run_dir / "history.jsonl").read_text().splitlines():
        h = json.loads(line)
        if "val/pass@1" in h:
            out[h["step"]] = h
    if summary.exists():
        after = json.loads(summary.read_text()).get("after", {})
        steps = json.loads(summary.read_text()).get("steps")
        if after and steps is not None:
            out[steps] = {**out.get(steps, {}), **after}
    return dict(sorted(out.items()))


def prior_of(run_dir: Path, k: int) -> dict[str, float]:
    """``prior@1`` / ``prior@k`` of the run's held-out rows (its ``config.yaml``'s ``data.eval``)."""
    from prorl_async.config import load_config
    from prorl_async.data.datasets import load_source
    from prorl_async.metrics import answer_prior

    cfg = load_config(str(run_dir / "config.yaml"))
    return answer_prior(load_source(cfg.data.eval, cfg.data), k)


def table(evals: dict[int, dict], k: int, prior: dict[str, float] | None = None) -> str:
    steps = list(evals)
    domains = sorted({key.split("/", 2)[2] for e in evals.values() for key in e if key.startswith("val/pass@1/")})
    pre = f" prior@1 | prior@{k} |" if prior is not None else ""
    head = f"| domain |{pre} " + " | ".join(f"pass@1 {s} | pass@{k} {s}" for s in steps) + " |"
    rows = [head, "|---|" + "---:|" * (2 * len(steps) + (2 if prior is not None else 0))]

    def cell(e: dict, key: str) -> str:
        v = e.get(key)
        return "-" if v is None else f"{v:.3f}"

    def first(key: str) -> str:
        return "" if prior is None else f" {cell(prior, f'prior@1{key}')} | {cell(prior, f'prior@{k}{key}')} |"

    for d in domains:
        rows.append(f"| `{d}` |{first('/' + d)} " + " | ".join(
            f"{cell(evals[s], f'val/pass@1/{d}')} | {cell(evals[s], f'val/pass@{k}/{d}')}" for s in steps) + " |")
    for level in ("easy", "hard", "ood"):
        members = [d for d in domains if d.endswith(f"@{level}")]
        if not members:
            continue
        cells = []
        if prior is not None:
            for m in (1, k):
                vals = [prior[f"prior@{m}/{d}"] for d in members if f"prior@{m}/{d}" in prior]
                cells.append(f"{sum(vals) / len(vals):.3f}" if vals else "-")
        for s in steps:
            for m in (1, k):
                vals = [evals[s].get(f"val/pass@{m}/{d}") for d in members]
                vals = [v for v in vals if v is not None]
                cells.append(f"{sum(vals) / len(vals):.3f}" if vals else "-")
        rows.append(f"| mean @{level} ({len(members)}) | " + " | ".join(cells) + " |")
    rows.append(f"| all |{first('')} " + " | ".join(f"{cell(evals[s], 'val/pass@1')} | {cell(evals[s], f'val/pass@{k}')}"
                                        for s in steps) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--k", type=int, default=16, help="the k of pass@k (train.eval_samples of the run)")
    p.add_argument("--prior", action="store_true", help="first, what the held-out answers alone score (prior@1 / prior@k)")
    args = p.parse_args()
    print(table(evaluations(args.run_dir), args.k, prior_of(args.run_dir, args.k) if args.prior else None))


if __name__ == "__main__":
    main()
