"""Held-out pass@1 / pass@k with standard errors, and two evaluations compared prompt by prompt.

    python scripts/eval_diff.py AFTER.json [AFTER2.json ...] [--before BEFORE.json [...]]

Reads what ``prorl-async eval --out`` writes (one file per call; several calls of one model, e.g.
one per level, are read as one evaluation) and prints a markdown table: per domain (for Reasoning
Gym sources ``rg:TASK@LEVEL``) pass@1 and pass@k, each with one standard error over its prompts,
then the unweighted mean over the domains of each level (``easy``, ``hard``, ``frontier``,
``ood``), its standard error from the domains' (:func:`prorl_async.metrics.mean_of`). With
``--before`` (a base model or an earlier checkpoint evaluated on the same ``--data``): both, and
the difference after - before with the standard error of the per-prompt differences
(:func:`prorl_async.metrics.paired_difference`), which is smaller than the two evaluations'
errors combined wherever a prompt's difficulty carries over from one to the other.

The standard errors count the choice of prompts and samples only: a second training run of the
same config lands elsewhere by its own spread, which only more runs measure
(docs/prorl_in_miniature.md, "The tenth config, draw by draw").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prorl_async.metrics import Difference, PromptOutcome, mean_of, paired_difference  # noqa: E402

LEVELS = ("easy", "hard", "frontier", "ood")


def load(paths: list[Path]) -> tuple[dict[str, PromptOutcome], int]:
    """The prompts' outcomes of one or more ``--out`` files of one model, and their samples a prompt."""
    outcomes: dict[str, PromptOutcome] = {}
    ks = set()
    for path in paths:
        result = json.loads(path.read_text())
        if "outcomes" not in result:
            raise SystemExit(f"error: {path} has no per-prompt outcomes: evaluate again with this version's "
                             "prorl-async eval --out")
        ks.add(result["samples"])
        for pid, (domain, correct, samples) in result["outcomes"].items():
            if pid in outcomes:
                raise SystemExit(f"error: prompt {pid} is in more than one of {[str(p) for p in paths]}: "
                                 "give each evaluation's files once")
            outcomes[pid] = PromptOutcome(domain, int(correct), int(samples))
    if len(ks) != 1:
        raise SystemExit(f"error: {[str(p) for p in paths]} were evaluated with different --samples {sorted(ks)}")
    return outcomes, ks.pop()


def standalone(after: dict[str, PromptOutcome], pids: list[str], any_correct: bool) -> Difference:
    """One evaluation's mean over ``pids`` and its standard error, in a :class:`Difference`'s shape
    (against a model that solves nothing: ``before`` 0, ``diff`` the mean) so that :func:`mean_of`
    combines domains alike."""
    return paired_difference({p: PromptOutcome(after[p].domain, 0, 1) for p in pids}, after, pids, any_correct)


def rows_of(after: dict[str, PromptOutcome], before: dict[str, PromptOutcome] | None, k: int) -> list[str]:
    """The table's lines: one per domain, then one per level's mean."""
    domains = sorted({o.domain for o in after.values()})
    pids = {d: [p for p, o in after.items() if o.domain == d] for d in domains}
    per = {(d, any_): (standalone(after, pids[d], any_) if before is None else
                       paired_difference(before, after, pids[d], any_))
           for d in domains for any_ in (False, True)}
    if before is None:
        out = [f"| domain | prompts | pass@1 ± se | pass@{k} ± se |", "|---|---:|---:|---:|"]
    else:
        out = [f"| domain | prompts | pass@1 before | after | after - before ± se | pass@{k} before | after | "
               "after - before ± se |", "|---|---:|" + "---:|" * 6]

    def cells(d1: Difference, dk: Difference) -> str:
        if before is None:
            return f"{d1.after:.3f} ± {d1.se:.3f} | {dk.after:.3f} ± {dk.se:.3f}"
        return " | ".join(f"{d.before:.3f} | {d.after:.3f} | {d.diff:+.3f} ± {d.se:.3f}" for d in (d1, dk))

    out += [f"| `{d}` | {len(pids[d])} | {cells(per[d, False], per[d, True])} |" for d in domains]
    for level in LEVELS:
        members = [d for d in domains if d.endswith(f"@{level}")]
        if members:
            out.append(f"| mean @{level} ({len(members)}) | {sum(len(pids[d]) for d in members)} | "
                       f"{cells(mean_of([per[d, False] for d in members]), mean_of([per[d, True] for d in members]))} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("after", type=Path, nargs="+", help="prorl-async eval --out files of one model")
    p.add_argument("--before", type=Path, nargs="+", help="the same --data evaluated with another model")
    args = p.parse_args(argv)
    after, k = load(args.after)
    before = None
    if args.before:
        before, k0 = load(args.before)
        if k0 != k:
            raise SystemExit(f"error: --before was evaluated with --samples {k0}, the others with {k}")
        missing = sorted(set(after) ^ set(before))
        if missing:
            raise SystemExit(f"error: {len(missing)} prompts are in one evaluation and not the other (e.g. "
                             f"{missing[:3]}): compare evaluations of the same --data")
    print("\n".join(rows_of(after, before, k)))


if __name__ == "__main__":
    main()
