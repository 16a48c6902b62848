"""Chaos soak: the tiny config for a few hundred steps while a random generator is killed
(``ray.kill``, Ray restarts it) every ``--kill-every`` steps. The run must complete with every
drawn prompt trained or waiting exactly once (nothing lost, nothing trained twice: read back
from the end checkpoint by tests/accounting.py) and flat memory (RSS of the driver and of this
run's actor processes, warm-up vs end).

    nice -n 5 .venv/bin/python benchmarks/chaos.py --steps 300 --kill-every 20

Prints steps, kills, re-sync count, prompts lost / trained twice and the RSS growth per process;
writes benchmarks/out/chaos.json. tests/test_chaos.py runs a short version.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROLES = ("GeneratorActor", "ReplayBufferActor", "LearnerActor", "GraderActor")
CONFIG = ["train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4", "train.micro_batch_size=32",
          "model.warmup_steps=200", "train.max_staleness=1", "algo.dynamic_sampling=false", "train.eval_interval=0",
          "rollout.num_generators=2", "rollout.generator_num_cpus=0.5", "train.learner_num_cpus=0.5",
          "train.sync_timeout_s=20", "tracking.enabled=false"]


def rss_by_role() -> dict[str, float]:
    """MB of resident memory: the driver, and the sum over this process's Ray actor descendants per class."""
    import psutil

    me = psutil.Process()
    out = {"driver": me.memory_info().rss / 2**20}
    for p in me.children(recursive=True):
        try:
            cmd = (p.cmdline() or [""])[0]
            rss = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for role in ROLES:
            if cmd.startswith(f"ray::{role}"):
                out[role] = out.get(role, 0.0) + rss
    return out


def chaos_run(cfg, kill_every: int, seed: int = 0, sample_s: float = 2.0) -> dict:
    """One run of ``cfg`` with a random generator killed after every ``kill_every``-th step."""
    import ray

    from actors.driver import TrainingLoop, run
    from prorl_async.checkpoint import load_latest
    from tests.accounting import checkpoint_accounting

    rng, kills, samples, done = random.Random(seed), [], [], threading.Event()
    original = TrainingLoop.log_step

    def log_step_then_kill(self, m):
        original(self, m)
        if self.s.version % kill_every == 0 and self.s.version < self.cfg.train.total_steps:
            i = rng.randrange(len(self.actors.generators))
            ray.kill(self.actors.generators[i], no_restart=False)  # Ray restarts it; the driver re-syncs it
            kills.append({"step": self.s.version, "generator": i, "t": time.time()})

    def sampler():
        while not done.is_set():
            samples.append({"t": time.time(), **rss_by_role()})
            done.wait(sample_s)

    TrainingLoop.log_step = log_step_then_kill
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    t0 = time.time()
    try:
        summary = run(cfg)
    finally:
        TrainingLoop.log_step = original
        done.set()
        th.join()
    a = checkpoint_accounting(cfg, load_latest(cfg.run_dir).path)
    placed = a["trained"] + a["buffered"] + a["retry"]
    live = [s for s in samples if all(r in s for r in ROLES)]
    warm, last = (live[len(live) // 5], live[-1]) if live else ({}, {})
    growth = {r: last[r] - warm[r] for r in ("driver", *ROLES) if r in warm and r in last}
    return {"steps": summary["steps"], "wall_s": time.time() - t0, "kills": len(kills),
            "kill_steps": [k["step"] for k in kills], "generator_failures": summary["generator_failures"],
            "weight_resyncs": summary["weight_resyncs"], "prompts_drawn": sum(a["drawn"].values()),
            "groups_trained": len(a["groups"]), "groups_trained_twice": len(a["groups"]) - len(set(a["groups"])),
            "prompts_lost": sum((a["drawn"] - placed).values()),
            "prompts_trained_twice": sum((placed - a["drawn"]).values()),
            "reissued_prompts": len(summary["reissued_prompts"]),
            "rss_warm_mb": warm, "rss_end_mb": last, "rss_growth_mb": growth, "rss_samples": len(live)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="extra config overrides")
    args = ap.parse_args()

    from benchmarks._common import machine, write_json
    from prorl_async.config import load_config

    tmp = Path(os.environ.get("CHAOS_DIR", "/tmp/prorl-chaos"))
    kills = args.steps // args.kill_every
    cfg = load_config(None, [*CONFIG, f"train.total_steps={args.steps}", f"rollout.max_generator_failures={kills + 1}",
                             f"train.checkpoint_interval={max(args.kill_every * 5 // 2, 1)}",
                             f"run_dir={tmp / 'run'}", f"tracking.aim_repo={tmp / 'aim'}", *args.overrides])
    r = chaos_run(cfg, args.kill_every, args.seed)
    print(f"chaos: {r['steps']} steps in {r['wall_s']:.0f}s, {r['kills']} generators killed (steps {r['kill_steps']}), "
          f"{r['generator_failures']} failures seen, {r['weight_resyncs']} re-syncs, {r['reissued_prompts']} prompts re-issued")
    print(f"prompts drawn {r['prompts_drawn']}, groups trained {r['groups_trained']}, lost {r['prompts_lost']}, "
          f"trained twice {r['prompts_trained_twice']} (groups {r['groups_trained_twice']})")
    print("RSS MB (warm -> end, growth): " + ", ".join(
        f"{k} {r['rss_warm_mb'][k]:.0f} -> {r['rss_end_mb'][k]:.0f} ({v:+.0f})" for k, v in r["rss_growth_mb"].items()))
    path = write_json("chaos", {"machine": machine(), "args": vars(args), **r})
    print(f"wrote {path}")
    ok = r["prompts_lost"] == 0 and r["prompts_trained_twice"] == 0 and r["groups_trained_twice"] == 0
    raise SystemExit(0 if ok and r["steps"] == args.steps else 1)


if __name__ == "__main__":
    main()
