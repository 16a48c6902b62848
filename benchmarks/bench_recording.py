"""What recording a run costs (issue 27): the ledger of every trained token
(``--setting ledger``: ``train.record_rollouts``) or Aim tracking (``--setting aim``:
``tracking.enabled``).

Runs the real CLI (``prorl-async train``, a subprocess with its own local Ray) on one config with
the setting on and off, same seeds, in the order on, off, off, on (``--repeats 2``) so that drift
in the machine's load hits both alike, and reports per run

* the median step time (``history.jsonl``'s ``time`` between consecutive steps, the first step
  left out) and the learner's median ``perf/train_s``;
* with the setting on, its own time, measured where it is paid: the ledger's ``perf/ledger_s``
  (the learner actor building and writing a step's file, on the learner's path: the step's result
  waits for it) and the file's size per step and per trained token; Aim's ``perf/tracking_s`` (the
  driver's seconds in ``aim.Run.track`` per step line, between steps, which holds up the next
  dispatch) and the size of the Aim repo.

The results are ratios: own seconds / step seconds (the direct cost) and median step time
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
    p.add_argument("--setting", choices=("ledger", "aim"), default="ledger", help="what is switched on and off")
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu_sync.yaml"), help="YAML config of every run")
    p.add_argument("--steps", type=int, default=40, help="learner steps per run (train.total_steps)")
    p.add_argument("--repeats", type=int, default=2, help="runs per setting (order on, off, off, on, ...)")
    p.add_argument("--overrides", default="", help="comma-separated extra overrides, e.g. rollout.n=4")
    p.add_argument("--quick", action="store_true", help="8 steps, one run per setting")
    p.add_argument("--only", choices=("on", "off"), default=None, help="run one setting only (--repeats times)")
    return p.parse_args(argv)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def one_run(cfg: str, steps: int, setting: str, on: bool, extra: list[str], tmp: Path, tag: str) -> dict:
    run_dir, aim_repo = tmp / tag, tmp / f"aim-{tag}"
    exe = Path(sys.executable).with_name("prorl-async")
    ledger, aim = (on, False) if setting == "ledger" else (False, on)
    args = [str(exe), "train", "--config", cfg, f"run_dir={run_dir}", f"train.total_steps={steps}",
            f"train.record_rollouts={str(ledger).lower()}", "train.eval_interval=0", "train.eval_samples=1",
            "data.eval=builtin:arithmetic?n=8&seed=2&split=eval", f"tracking.aim_repo={aim_repo}",
            f"tracking.enabled={str(aim).lower()}", *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.time()
    res = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{tag} failed: {res.stderr[-2000:]}")
    hist = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines() if x]
    step_s = [b["time"] - a["time"] for a, b in zip(hist, hist[1:])]
    out = {"run": tag, "on": on, "wall_s": time.time() - t0, "steps": len(hist),
           "step_s": statistics.median(step_s), "train_s": statistics.median(h["perf/train_s"] for h in hist[1:])}
    if aim:
        out.update({"own_s": statistics.median(h["perf/tracking_s"] for h in hist[1:]),
                    "own_s_max": max(h["perf/tracking_s"] for h in hist),
                    "repo_mb": dir_bytes(aim_repo) / 2**20})
        out["own_frac"] = out["own_s"] / out["step_s"]
    if ledger:
        files = sorted((run_dir / "ledger").glob("step-*.parquet"))
        tokens = sum(h["perf/train_valid_tokens"] for h in hist)
        out.update({"own_s": statistics.median(h["perf/ledger_s"] for h in hist[1:]),
                    "own_s_max": max(h["perf/ledger_s"] for h in hist),
                    "file_kb": statistics.median(f.stat().st_size for f in files) / 1024,
                    "bytes_per_token": sum(f.stat().st_size for f in files) / max(tokens, 1.0),
                    "files": len(files)})
        out["own_frac"] = out["own_s"] / out["step_s"]
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
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.setting}-") as tmp:
        for i, on in enumerate(order):
            r = one_run(args.config, steps, args.setting, on, extra, Path(tmp), f"{'on' if on else 'off'}-{i}")
            rows.append(r)
            print(json.dumps(r), flush=True)
    on_runs = [r for r in rows if r["on"]]
    off_runs = [r for r in rows if not r["on"]]
    summary = {
        "setting": args.setting,
        "own_frac_of_step": statistics.mean(r["own_frac"] for r in on_runs) if on_runs else None,
        "step_on_over_off": statistics.mean(r["step_s"] for r in on_runs) / statistics.mean(r["step_s"] for r in off_runs)
        if on_runs and off_runs else None,
        "train_s_on_over_off": statistics.mean(r["train_s"] for r in on_runs) / statistics.mean(r["train_s"] for r in off_runs)
        if on_runs and off_runs else None,
    }
    own = "perf/ledger_s" if args.setting == "ledger" else "perf/tracking_s"
    size = [("file_kb", "file KiB", "{:.0f}"), ("bytes_per_token", "B/token", "{:.0f}")] if args.setting == "ledger" \
        else [("repo_mb", "Aim repo MiB", "{:.1f}")]
    print(table(rows, [("run", "run", "{}"), ("step_s", "step s (median)", "{:.3f}"),
                       ("train_s", "learner train_s", "{:.3f}"), ("own_s", f"{own} (median)", "{:.4f}"),
                       ("own_s_max", "max", "{:.4f}"), ("own_frac", "own / step", "{:.2%}"), *size]))
    print(f"summary: {json.dumps(summary)}")
    m = machine()
    print(f"machine: {m['cpu']}, {m['cores']} cores")
    write_json(f"bench_{args.setting}", {"machine": m, "config": args.config, "steps": steps, "overrides": extra,
                                         "runs": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
