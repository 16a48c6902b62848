"""How often a run's trained samples state the same answer: per pool, per window of steps.

    python scripts/answer_share.py RUN_DIR [--window 50] [--domains REGEX]

Reads the run's ledger (``RUN_DIR/ledger/step-N.parquet``, ``train.record_rollouts``: every
trained sample's text and pool), takes each sample's answer as the Reasoning Gym grader does for
``answer=stated`` (:func:`prorl_async.rewards.reasoning_gym.extract_answer`: the text after the
last "answer is"), and prints a markdown table: one row per pool (``domain``), one column per
window of ``--window`` steps with the most common answer and its share of the samples that
stated one. A policy that collapsed onto a constant (the ninth run's "1" for every ``gcd`` and
``letter_counting`` prompt, docs/prorl_in_miniature.md) shows as a share near 1 while the pool's
gold answers vary. No model, no Ray.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

from prorl_async import ledger
from prorl_async.rewards.reasoning_gym import extract_answer


def shares(run_dir: Path, window: int, domains: str = "") -> dict[str, dict[int, tuple[str, float, int]]]:
    """``{domain: {first step of the window: (top answer, its share, samples with an answer)}}``."""
    pick = re.compile(domains) if domains else None
    counts: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for step in ledger.recorded_steps(run_dir):
        rows, _ = ledger.read_step(run_dir, step)
        start = (step - 1) // window * window + 1
        for dom, text in zip(rows.column("domain").to_pylist(), rows.column("response_text").to_pylist()):
            if pick and not pick.search(dom):
                continue
            answer = extract_answer(text or "", "stated")
            if answer is not None:
                counts[dom][start][answer] += 1
    out: dict[str, dict[int, tuple[str, float, int]]] = {}
    for dom, by_window in sorted(counts.items()):
        out[dom] = {}
        for start, c in sorted(by_window.items()):
            top, n = c.most_common(1)[0]
            total = sum(c.values())
            out[dom][start] = (top, n / total, total)
    return out


def _cell(answer: str, width: int = 24) -> str:
    """An answer as a table cell: on one line, no column break, at most ``width`` characters (a
    rambling sample's "answer" can be a paragraph)."""
    flat = " ".join(answer.split()).replace("|", "\\|")
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def table(found: dict[str, dict[int, tuple[str, float, int]]], window: int) -> str:
    starts = sorted({s for by_window in found.values() for s in by_window})
    head = "| pool | " + " | ".join(f"steps {s}-{s + window - 1}" for s in starts) + " |"
    lines = [head, "|---" * (len(starts) + 1) + "|"]
    for dom, by_window in found.items():
        cells = [f'"{_cell(by_window[s][0])}" {by_window[s][1]:.2f} (n={by_window[s][2]})' if s in by_window else "-"
                 for s in starts]
        lines.append(f"| {dom} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--window", type=int, default=50, help="steps a column (default 50)")
    ap.add_argument("--domains", default="", help="only pools whose name matches this regex, e.g. 'gcd|letter'")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    if not ledger.recorded_steps(args.run_dir):
        ap.error(f"no ledger in {args.run_dir} (its steps are recorded with train.record_rollouts=true)")
    print(table(shares(args.run_dir, args.window, args.domains), args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
