"""Each actor's resident size in two windows of a run's steps: does anything grow?

    python scripts/rss_table.py RUN_DIR [--windows 21-40 181-200] [--every 20]

Reads ``RUN_DIR/history.jsonl`` (``sys/rss_mb/<actor>``: driver, buffer, learner, generatorN, one
reading per step) and prints, per actor, the median and the minimum of each window and their
change. An actor that alternates between an idle and a busy size (the learner: a step's
activations; a generator caught mid-receive or mid-batch) is read by its minimum, the idle size,
and the median of a window mixes the two modes: it moves with how often the readings caught the
actor busy, not with what it holds. So a second table splits such an actor's readings into its two
modes and gives each mode's median per window: the split is the widest gap between the sorted
readings of both windows that is at least ``--gap`` MB (default 200, the growth the run's bound
allows) with at least a fifth of the readings on each side. The default windows are the first
steps after warm-up and the last 20 recorded. Two window medians can still differ by the chance of
when in a step each reading was taken; ``--every N`` reads the whole run instead: each mode's median
in consecutive N-step windows from step 21 (after warm-up) and the least-squares slope through
them, in MB a step. No model, no Ray.
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


def split(values: list[float], gap: float) -> float | None:
    """The size between an actor's two modes: the middle of the widest gap of at least ``gap`` MB
    between consecutive sorted readings with at least a fifth of them on each side; None if none."""
    v = sorted(values)
    least = max(1, len(v) // 5)
    gaps = [(v[i + 1] - v[i], i) for i in range(least - 1, len(v) - least)]
    widest, i = max(gaps, default=(0.0, 0))
    return (v[i] + v[i + 1]) / 2 if widest >= gap else None


def modes(history: list[dict], first: tuple[int, int], last: tuple[int, int], gap: float) -> str:
    """Per actor with two modes: each mode's median in each window and its change ('-': the window
    never caught that mode)."""
    a, b = readings(history, *first), readings(history, *last)
    f, l_ = f"{first[0]}-{first[1]}", f"{last[0]}-{last[1]}"
    lines = [f"| actor | split | idle median {f} | idle median {l_} | change | busy median {f} | busy median {l_} | change |",
             "|---|---|---|---|---|---|---|---|"]
    for actor in sorted(set(a) & set(b)):
        at = split(a[actor] + b[actor], gap)
        if at is None:
            continue
        cells = []
        for side in (lambda x: x < at, lambda x: x >= at):
            ma, mb = ([x for x in w[actor] if side(x)] for w in (a, b))
            med = [statistics.median(m) if m else None for m in (ma, mb)]
            cells += [f"{m:.0f}" if m is not None else "-" for m in med]
            cells.append(f"{med[1] - med[0]:+.0f}" if None not in med else "-")
        lines.append(f"| {actor} | {at:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def trend(history: list[dict], every: int, gap: float, start: int = 21) -> str:
    """Per actor and mode (its readings split as in :func:`modes`, over the whole run; 'all' for an
    actor with one mode): the median of each ``every``-step window from ``start`` on and the
    least-squares slope through those medians (MB a step, by each window's middle step)."""
    last = max((h["step"] for h in history if "step" in h), default=0)
    spans = [(lo, min(lo + every - 1, last)) for lo in range(start, last + 1, every)]
    run = readings(history, start, last)
    per_span = [readings(history, lo, hi) for lo, hi in spans]  # each window's readings, read once
    lines = ["| actor | mode | " + " | ".join(f"{lo}-{hi}" for lo, hi in spans) + " | slope MB/step |",
             "|---|---|" + "---|" * len(spans) + "---|"]
    for actor in sorted(run):
        at = split(run[actor], gap)
        sides = ([("all", lambda x: True)] if at is None else
                 [(f"idle (<{at:.0f})", lambda x: x < at), (f"busy (>={at:.0f})", lambda x: x >= at)])
        for name, side in sides:
            points = []
            for (lo, hi), got_span in zip(spans, per_span):
                v = [x for x in got_span.get(actor, []) if side(x)]
                points.append(((lo + hi) / 2, statistics.median(v)) if v else None)
            got = [p for p in points if p is not None]
            slope = f"{statistics.linear_regression(*zip(*got)).slope:+.2f}" if len({x for x, _ in got}) > 1 else "-"
            cells = [f"{p[1]:.0f}" if p else "-" for p in points]
            lines.append(f"| {actor} | {name} | " + " | ".join(cells) + f" | {slope} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--windows", nargs=2, metavar=("FIRST", "LAST"), help="two step ranges, e.g. 21-40 181-200 "
                    "(default: 21-40 and the last 20 recorded steps)")
    ap.add_argument("--gap", type=float, default=200.0, metavar="MB",
                    help="the least gap between an actor's idle and busy readings that splits them into two modes "
                         "(default 200)")
    ap.add_argument("--every", type=int, default=0, metavar="N",
                    help="also each mode's median in consecutive N-step windows from step 21 and the slope through them")
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
    two = modes(history, first, last, args.gap)
    if two:
        print(f"\ntwo modes (split at the widest gap of at least {args.gap:.0f} MB with a fifth of the readings "
              "on each side):\n" + two)
    if args.every > 0:
        print(f"\nover the run, {args.every}-step windows from step 21 (modes split over all its readings):\n"
              + trend(history, args.every, args.gap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
