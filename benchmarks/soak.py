"""Soak: a few hundred steps of the tiny config, sampling the RSS of the driver and of every
actor process; memory must stay flat once the run is warm.

    .venv/bin/python benchmarks/soak.py --steps 300 --bound-mb 64

Prints the RSS of each process at the first sample after warm-up and at the end, the growth,
and PASS/FAIL against ``--bound-mb``; writes benchmarks/out/soak.json and soak.png. The
sampler reads /proc (Linux): Ray names its worker processes ``ray::<ActorClass>``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
ROLES = ("GeneratorActor", "ReplayBufferActor", "LearnerActor", "GraderActor")


def rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def actor_pids() -> dict[str, int]:
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for role in ROLES:
            if cmd.startswith(f"ray::{role}"):
                found.setdefault(role, int(d))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--bound-mb", type=float, default=64.0, help="allowed RSS growth per process after warm-up")
    ap.add_argument("--warm-frac", type=float, default=0.2, help="fraction of the run treated as warm-up")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()

    from actors.driver import run
    from prorl_async.config import load_config

    tmp = Path(os.environ.get("SOAK_DIR", "/tmp/prorl-soak"))
    cfg = load_config(None, [f"train.total_steps={args.steps}", "train.prompts_per_step=32", "train.eval_interval=100",
                             f"run_dir={tmp / 'run'}", f"tracking.aim_repo={tmp / 'aim'}", *args.overrides])
    samples: list[dict] = []
    done = threading.Event()

    def sampler():
        me = os.getpid()
        while not done.is_set():
            pids = actor_pids()
            samples.append({"t": time.time(), "driver": rss_mb(me), **{r: rss_mb(p) for r, p in pids.items()}})
            done.wait(args.interval)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    t0 = time.time()
    summary = run(cfg)
    done.set()
    th.join()
    # the run's own actors are gone after run(); keep the samples taken while they lived
    live = [s for s in samples if all(r in s for r in ROLES)]
    warm = live[int(len(live) * args.warm_frac)]
    last = live[-1]
    rows, ok = [], True
    for role in ("driver", *ROLES):
        growth = last[role] - warm[role]
        ok &= growth <= args.bound_mb
        rows.append({"process": role, "rss_warm_mb": warm[role], "rss_end_mb": last[role], "growth_mb": growth})
    print(f"soak: {summary['steps']} steps in {time.time() - t0:.0f}s, {len(live)} samples")
    print(f"{'process':<20}{'warm MB':>10}{'end MB':>10}{'growth':>10}")
    for r in rows:
        print(f"{r['process']:<20}{r['rss_warm_mb']:>10.1f}{r['rss_end_mb']:>10.1f}{r['growth_mb']:>+10.1f}")
    print(f"bound {args.bound_mb:.0f} MB per process after warm-up: {'PASS' if ok else 'FAIL'}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps({"steps": summary["steps"], "bound_mb": args.bound_mb, "pass": ok,
                                               "rows": rows, "samples": samples}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for role in ("driver", *ROLES):
            pts = [(s["t"] - t0, s[role]) for s in samples if role in s]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=role)
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MB)")
        ax.set_title(f"soak: {summary['steps']} steps, tiny config")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(OUT / "soak.png", dpi=100)
    except Exception as e:  # the numbers are the point; a missing plot is not a failure
        print(f"plot skipped: {e}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
