"""End-to-end throughput: synchronous (max_staleness=0) vs asynchronous (1, 2) training.

Runs the real driver (``actors.driver.run``) once per mode, in one process and one local Ray
cluster (own temp dir, shut down at the end), on the same model, task, seed and number of
trained samples (``train.total_steps * train.prompts_per_step * rollout.n``). Per mode it reports

* trained samples/s and train tokens/s over the training loop's wall time (evaluation pauses
  excluded; they are reported separately), plus generated samples/s (dynamic sampling drops
  all-equal groups, so more samples are generated than trained);
* the time breakdown from the driver's cumulative ``time/*`` metrics: generate, grade, train,
  weight sync and evaluation seconds, and the idle fraction of the learner, generator(s) and grader;
* trained staleness (mean/max) and the wall-clock time to a target held-out pass@1
  (``val/pass@1`` at every ``train.eval_interval`` steps; ``--target-acc auto`` = halfway
  between the starting accuracy and the lowest best accuracy any mode reached, so every mode
  reaches it; if some mode never beats its start, start + 0.01 and that mode shows "-").

With ``--repeats 2`` the modes run in the order 0,1,2,2,1,0 so that drift in machine load
(other jobs) hits every mode alike; figures are then means over repeats.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import OUT_DIR, arg_parser, machine, plt, start_ray, table, write_json

PHASES = ("generate", "grade", "train", "sync", "eval")


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--config", default=None, help="YAML config every mode starts from (default: the built-in tiny one)")
    p.add_argument("--steps", type=int, default=30, help="learner steps per mode (train.total_steps)")
    p.add_argument("--modes", default="0,1,2", help="comma-separated train.max_staleness values")
    p.add_argument("--eval-interval", type=int, default=5, help="train.eval_interval")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode (order alternates to cancel drift)")
    p.add_argument("--target-acc", default="auto", help="held-out pass@1 target, a number or 'auto'")
    p.add_argument("--cache-dir", default=os.environ.get("PRORL_ASYNC_CACHE", "/tmp/prorl-cache"),
                   help="model.cache_dir (the built-in model is warmed up once and reused)")
    p.add_argument("--override", action="append", default=[],
                   help="extra config override applied to every mode, e.g. rollout.n=8 (repeatable)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


def run_mode(staleness: int, args, work: Path, tag: str) -> dict:
    from actors.driver import run
    from prorl_async.config import load_config

    run_dir = work / f"s{staleness}-{tag}"
    cfg = load_config(args.config, [f"train.total_steps={args.steps}", f"train.max_staleness={staleness}",
                             f"train.eval_interval={args.eval_interval}", f"run_dir={run_dir}",
                             f"tracking.aim_repo={work / 'aim'}", f"model.cache_dir={args.cache_dir}",
                             *args.override])
    t0 = time.time()
    summary = run(cfg)
    wall = time.time() - t0
    hist = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line]
    last = hist[-1]
    loop_s = last["time"]
    eval_s = last.get("time/eval_s", 0.0)
    busy_loop_s = loop_s - eval_s  # training-loop wall time without the evaluation pauses
    trained_samples = args.steps * cfg.samples_per_step
    train_tokens = sum(h["perf/train_tok_s"] * h["perf/train_s"] for h in hist)
    generated = sum(h["perf/samples_s"] * h["perf/step_s"] for h in hist)
    curve = [(0, 0.0, 0.0, summary["before"]["val/pass@1"])]  # (step, wall s, wall s without eval, pass@1)
    for h in hist:
        if "val/pass@1" in h:
            curve.append((h["step"], h["time"], h["time"] - h.get("time/eval_s", 0.0), h["val/pass@1"]))
    curve.append((last["step"], loop_s, busy_loop_s, summary["after"]["val/pass@1"]))
    res = {
        "max_staleness": staleness, "tag": tag, "steps": summary["steps"], "run_wall_s": wall,
        "loop_s": loop_s, "loop_no_eval_s": busy_loop_s,
        "trained_samples": trained_samples, "generated_samples": generated,
        "samples_s": trained_samples / busy_loop_s, "gen_samples_s": generated / busy_loop_s,
        "train_tok_s": train_tokens / busy_loop_s, "learner_tok_s": train_tokens / max(last["time/train_s"], 1e-9),
        "learner_idle": 1.0 - last["time/train_s"] / busy_loop_s,
        "generator_idle": 1.0 - last["time/generate_s"] / (busy_loop_s * cfg.rollout.num_generators),
        "grader_idle": 1.0 - last["time/grade_s"] / busy_loop_s,
        "staleness_mean": sum(h["async/trained_staleness_mean"] for h in hist) / len(hist),
        "staleness_max": max(h["async/trained_staleness_max"] for h in hist),
        "val_before": summary["before"]["val/pass@1"], "val_after": summary["after"]["val/pass@1"],
        # the generator's own speed while generating (steps 2..: step 1 includes its warm-up)
        "gen_engine_tok_s": sum(h.get("perf/gen_engine_tok_s", 0.0) for h in hist[1:] or hist) / len(hist[1:] or hist),
        "step_s": [h["perf/step_s"] for h in hist],
        "curve": curve,
    }
    for ph in PHASES:
        res[f"{ph}_s"] = last.get(f"time/{ph}_s", 0.0)
    return res


def time_to(curve, target: float):
    """(wall s, wall s without eval pauses) of the first evaluation at or above target."""
    for step, t, t_noeval, acc in curve:
        if step > 0 and acc >= target - 1e-12:
            return t, t_noeval
    return None, None


def mean_by_mode(results: list[dict]) -> list[dict]:
    out = []
    for s in dict.fromkeys(r["max_staleness"] for r in results):
        rs = [r for r in results if r["max_staleness"] == s]
        m = {k: sum(r[k] for r in rs) / len(rs) for k, v in rs[0].items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
        m["max_staleness"], m["repeats"], m["curves"] = s, len(rs), [r["curve"] for r in rs]
        m["staleness_max"] = max(r["staleness_max"] for r in rs)
        out.append(m)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = [int(m) for m in args.modes.split(",")]
    order = []
    for r in range(args.repeats):
        order += [(m, f"r{r}") for m in (modes if r % 2 == 0 else modes[::-1])]
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-e2e-", dir="/tmp"))
    ray_tmp = start_ray()
    import ray

    results = []
    try:
        for s, tag in order:
            print(f"=== max_staleness={s} ({tag}) ===", flush=True)
            results.append(run_mode(s, args, work, tag))
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    modes_avg = mean_by_mode(results)

    if args.target_acc == "auto":
        start = min(m["val_before"] for m in modes_avg)
        best = min(max(p[3] for c in m["curves"] for p in c) for m in modes_avg)
        # halfway to the lowest best accuracy; if some mode never beat the start, a target it cannot reach
        target = start + 0.5 * (best - start) if best > start else start + 0.01
    else:
        target = float(args.target_acc)
    sync = next((m for m in modes_avg if m["max_staleness"] == 0), modes_avg[0])
    for m in modes_avg:
        ts = [time_to(c, target) for c in m["curves"]]
        reached = [t for t in ts if t[0] is not None]
        m["time_to_target_s"] = sum(t[0] for t in reached) / len(reached) if len(reached) == len(ts) else None
        m["time_to_target_no_eval_s"] = (sum(t[1] for t in reached) / len(reached)
                                         if len(reached) == len(ts) else None)
        m["speedup_samples_s"] = m["samples_s"] / sync["samples_s"]
        m["speedup_tok_s"] = m["train_tok_s"] / sync["train_tok_s"]

    print()
    print(table(modes_avg, [
        ("max_staleness", "stale", "{:d}"), ("samples_s", "samples/s", "{:.3g}"),
        ("gen_samples_s", "gen samples/s", "{:.3g}"), ("train_tok_s", "train tok/s", "{:.0f}"),
        ("speedup_samples_s", "speed-up", "{:.2f}x"), ("loop_no_eval_s", "loop s", "{:.1f}"),
        ("generate_s", "gen s", "{:.1f}"), ("grade_s", "grade s", "{:.1f}"), ("train_s", "train s", "{:.1f}"),
        ("sync_s", "sync s", "{:.2f}"), ("eval_s", "eval s", "{:.1f}"), ("gen_engine_tok_s", "engine tok/s", "{:.0f}"),
        ("learner_idle", "learner idle", "{:.2f}"), ("generator_idle", "gen idle", "{:.2f}"),
        ("grader_idle", "grader idle", "{:.2f}"),
        ("staleness_mean", "stale mean", "{:.2f}"), ("staleness_max", "stale max", "{:.0f}"),
        ("val_before", "val@0", "{:.3f}"), ("val_after", "val@end", "{:.3f}"),
        ("time_to_target_s", f"s to {target:.3f}", "{:.1f}"),
        ("time_to_target_no_eval_s", "(no eval)", "{:.1f}")]))
    print(f"\n(machine: {machine()['cpu']}, {os.cpu_count()} cores; samples/s and tok/s over the loop's wall "
          f"time without evaluation pauses; target pass@1 {target:.3f})")

    payload = {"benchmark": "e2e", "machine": machine(), "args": {**vars(args), "out": str(args.out)},
               "target_acc": target, "modes": modes_avg, "runs": results}
    path = write_json("bench_e2e", payload, args.out)
    plot(modes_avg, target, args.out / "bench_e2e.png", args)
    print(f"wrote {path} and {args.out / 'bench_e2e.png'}")
    shutil.rmtree(work, ignore_errors=True)
    return payload


def plot(modes: list[dict], target: float, path: Path, args) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(1, 3, figsize=(16, 4.5))
    for m in modes:
        for i, c in enumerate(m["curves"]):
            ax[0].plot([p[1] for p in c], [p[3] for p in c], marker="o", color=f"C{int(m['max_staleness'])}",
                       label=f"max_staleness={int(m['max_staleness'])}" if i == 0 else None)
    ax[0].axhline(target, ls="--", color="gray", label=f"target {target:.3f}")
    ax[0].set(xlabel="training-loop wall time (s, incl. eval pauses)", ylabel="held-out pass@1",
              title="held-out accuracy vs wall time")
    ax[0].legend()
    names = [f"stale={int(m['max_staleness'])}" for m in modes]
    bottom = [0.0] * len(modes)
    for j, ph in enumerate(PHASES[:-1]):
        vals = [m[f"{ph}_s"] for m in modes]
        ax[1].bar(names, vals, bottom=bottom, label=f"{ph} (busy s)", color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[1].plot(names, [m["loop_no_eval_s"] for m in modes], "k_", markersize=40, mew=3, label="loop wall s")
    ax[1].set(ylabel="seconds", title="busy time per activity (sums over actors) vs wall")
    ax[1].legend(fontsize=8)
    x = range(len(modes))
    ax[2].bar([i - 0.2 for i in x], [m["speedup_samples_s"] for m in modes], width=0.4, label="samples/s")
    ax[2].bar([i + 0.2 for i in x], [m["speedup_tok_s"] for m in modes], width=0.4, label="train tok/s")
    ax[2].set_xticks(list(x), names)
    ax[2].axhline(1.0, color="gray", lw=0.8)
    ax[2].set(ylabel="relative to max_staleness=0", title="end-to-end speed-up")
    ax[2].legend()
    fig.suptitle(f"prorl-async end to end, {machine()['cpu']} ({os.cpu_count()} cores), "
                 f"{Path(args.config).name if args.config else 'built-in tiny model'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
