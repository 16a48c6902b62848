"""Each actor's resident size in two windows of a run's steps: does anything grow?

    python scripts/rss_table.py RUN_DIR [--windows 21-40 181-200]

Reads ``RUN_DIR/history.jsonl`` (``sys/rss_mb/<actor>``: driver, buffer, learner, generatorN, one
reading per step) and prints, per actor, the median and the minimum of each window and their
change. An actor that alternates between an idle and a busy size (the learner: a step's
activations) is read by its minimum, the idle size; the median of a window mixes the two modes.
The default windows are the first steps after warm-up and the last 20 recorded. No model, no Ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PREFIX = "sys/rss_mb/"


def window(spec: str) -> tuple[int, int]:
    a, _, b = spec.partition("-")
    lo, hi = int(a), int(b or a)
    if lo > hi:
        raise ValueError(f"window {spec!r}: first step after the last")
    return lo, hi


def readings(history: list[dict], lo: int, hi: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for h in history:
        if lo <= h.get("step", -1) <= hi:
            for k, v in h.items():
                if k.startswith(PREFIX) and isinstance(v, (int, float)) and v > 0:
                    out.setdefault(k.removeprefix(PREFIX), []).append(float(v))
    return out


def table(history: list[dict], first: tuple[int, int], last: tuple[int, int]) -> str:
    a, b = readings(history, *first), readings(history, *last)
    f, l_ = f"{first[0]}-{first[1]}", f"{last[0]}-{last[1]}"
    lines = [f"| actor | median {f} | median {l_} | change | min {f} | min {l_} | change |", "|---|---|---|---|---|---|---|"]
    for actor in sorted(set(a) & set(b)):
        ma, mb = statistics.median(a[actor]), statistics.median(b[actor])
        na, nb = min(a[actor]), min(b[actor])
        lines.append(f"| {actor} | {ma:.0f} | {mb:.0f} | {mb - ma:+.0f} | {na:.0f} | {nb:.0f} | {nb - na:+.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--windows", nargs=2, metavar=("FIRST", "LAST"), help="two step ranges, e.g. 21-40 181-200 "
                    "(default: 21-40 and the last 20 recorded steps)")
    args = ap.parse_args(argv)
    path = args.run_dir / "history.jsonl"
    if not path.is_file():
        ap.error(f"{path} not found: pass a prorl-async run directory")
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = sorted(h["step"] for h in history if "step" in h)
    try:
        first, last = (window(w) for w in args.windows) if args.windows else ((21, 40), (max(steps[-1] - 19, 1), steps[-1]))
    except (ValueError, IndexError) as e:
        ap.error(f"--windows: {e or 'the history has no steps'}")
    if not readings(history, *first) or not readings(history, *last):
        ap.error(f"no sys/rss_mb/* readings in steps {first[0]}-{first[1]} or {last[0]}-{last[1]} of {path}")
    print(table(history, first, last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
