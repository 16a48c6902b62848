"""The cost of the ledger of every trained token (``train.record_rollouts``, issue 27).

Runs the real CLI (``prorl-async train``, a subprocess with its own local Ray) on one config with
the ledger on and off, same seeds, in the order on, off, off, on (``--repeats 2``) so that drift
in the machine's load hits both alike, and reports per run

* the median step time (``history.jsonl``'s ``time`` between consecutive steps, the first step
  left out) and the learner's median ``perf/train_s``;
* with the ledger on, the median time the learner actor spends building and writing a step's
  file (``perf/ledger_s``, on the learner's path: the step's result waits for it) and the file's
  size per step and per trained token.

The results are ratios: ledger seconds / step seconds (the direct cost) and median step time
on / off (which also holds the machine's noise).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, arg_parser, machine, table, write_json


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu_sync.yaml"), help="YAML config of every run")
    p.add_argument("--steps", type=int, default=40, help="learner steps per run (train.total_steps)")
    p.add_argument("--repeats", type=int, default=2, help="runs per setting (order on, off, off, on, ...)")
    p.add_argument("--overrides", default="", help="comma-separated extra overrides, e.g. rollout.n=4")
    p.add_argument("--quick", action="store_true", help="8 steps, one run per setting")
    p.add_argument("--only", choices=("on", "off"), default=None, help="run one setting only (--repeats times)")
    return p.parse_args(argv)


def one_run(cfg: str, steps: int, record: bool, extra: list[str], tmp: Path, tag: str) -> dict:
    run_dir = tmp / tag
    exe = Path(sys.executable).with_name("prorl-async")
    args = [str(exe), "train", "--config", cfg, f"run_dir={run_dir}", f"train.total_steps={steps}",
            f"train.record_rollouts={str(record).lower()}", "train.eval_interval=0", "train.eval_samples=1",
            "data.eval=builtin:arithmetic?n=8&seed=2&split=eval", f"tracking.aim_repo={tmp / 'aim'}",
            "tracking.enabled=false", *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.time()
    res = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{tag} failed: {res.stderr[-2000:]}")
    hist = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines() if x]
    step_s = [b["time"] - a["time"] for a, b in zip(hist, hist[1:])]
    out = {"run": tag, "record": record, "wall_s": time.time() - t0, "steps": len(hist),
           "step_s": statistics.median(step_s), "train_s": statistics.median(h["perf/train_s"] for h in hist[1:])}
    if record:
        files = sorted((run_dir / "ledger").glob("step-*.parquet"))
        tokens = sum(h["perf/train_valid_tokens"] for h in hist)
        out.update({"ledger_s": statistics.median(h["perf/ledger_s"] for h in hist[1:]),
                    "ledger_s_max": max(h["perf/ledger_s"] for h in hist),
                    "file_kb": statistics.median(f.stat().st_size for f in files) / 1024,
                    "bytes_per_token": sum(f.stat().st_size for f in files) / max(tokens, 1.0),
                    "files": len(files)})
        out["ledger_frac"] = out["ledger_s"] / out["step_s"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    steps, repeats = (8, 1) if args.quick else (args.steps, args.repeats)
    extra = [o for o in args.overrides.split(",") if o]
    order = []
    for i in range(repeats):
        if args.only:
            order.append(args.only == "on")
        else:
            order += [True, False] if i % 2 == 0 else [False, True]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        for i, record in enumerate(order):
            r = one_run(args.config, steps, record, extra, Path(tmp), f"{'on' if record else 'off'}-{i}")
            rows.append(r)
            print(json.dumps(r), flush=True)
    on = [r for r in rows if r["record"]]
    off = [r for r in rows if not r["record"]]
    summary = {
        "ledger_frac_of_step": statistics.mean(r["ledger_frac"] for r in on) if on else None,
        "step_on_over_off": statistics.mean(r["step_s"] for r in on) / statistics.mean(r["step_s"] for r in off)
        if on and off else None,
        "train_s_on_over_off": statistics.mean(r["train_s"] for r in on) / statistics.mean(r["train_s"] for r in off)
        if on and off else None,
    }
    print(table(rows, [("run", "run", "{}"), ("step_s", "step s (median)", "{:.3f}"),
                       ("train_s", "learner train_s", "{:.3f}"), ("ledger_s", "ledger s", "{:.4f}"),
                       ("ledger_frac", "ledger / step", "{:.2%}"), ("file_kb", "file KiB", "{:.0f}"),
                       ("bytes_per_token", "B/token", "{:.0f}")]))
    print(f"summary: {json.dumps(summary)}")
    m = machine()
    print(f"machine: {m['cpu']}, {m['cores']} cores")
    write_json("bench_ledger", {"machine": m, "config": args.config, "steps": steps, "overrides": extra,
                                "runs": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
