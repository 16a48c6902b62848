"""Where a CPU learner's resident memory goes over many steps of packed batches of changing shape.

The sixth SmolLM2 run of docs/prorl_in_miniature.md saw its learner grow from 5.7 GB to 14.6 GB
in 250 steps. This script repeats what the learner does each step, in one process and without Ray:
``TorchLearner.train_step`` on SmolLM2-135M-Instruct with the k2 KL term (reference forward),
on a batch like that run's (4 prompts of 250-450 tokens x 8 samples, responses up to 24, 48 or
96 tokens, a new shape every step, the same batches in every arm); after every step it records
the step time, the process's RSS and glibc's heap counters (``mallinfo2``: bytes in use vs bytes
free inside the heap), so growth can be told apart into a leak (in use grows) and a heap that
keeps what was freed (free grows), and the step's kernel time and minor page faults
(``getrusage``), what faulting freed memory in again costs. ``--distinct-batches K`` cycles through
K batches, so that shapes repeat.

    .venv/bin/python benchmarks/bench_learner_memory.py --steps 12

Arms, each in its own process, one after another: ``default`` is the learner as shipped
(``train.reuse_freed_memory: auto`` keeps freed blocks, and a step's end hands the heap's free
pages back when more than ``train.reuse_freed_memory_gb`` (6) is resident beyond what is in use,
:func:`prorl_async.learners.host_memory.bound_free_heap`), ``every-step`` hands back after every
step (``reuse_freed_memory_gb=0``), ``unbounded`` never hands back (the behaviour before),
``never`` keeps glibc's default allocator settings (``train.reuse_freed_memory=never``),
``kernel-cache-1024`` keeps oneDNN's and ideep's kernel caches at their default 1024 entries
(``train.kernel_cache_entries=0``, the behaviour before; the learner's default keeps 64,
:func:`prorl_async.learners.host_memory.kernel_cache_env`, which a learner actor's runtime env
carries and each arm's process here is started with).
Writes benchmarks/out/learner_memory.json.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time

from _common import arg_parser, machine, table, write_json

ARMS = {"default": [], "every-step": ["train.reuse_freed_memory_gb=0"],
        "unbounded": ["train.reuse_freed_memory_gb=1000000"], "never": ["train.reuse_freed_memory=never"],
        "kernel-cache-1024": ["train.kernel_cache_entries=0"]}


def kernel_env(arm: str, overrides: list[str]) -> dict:
    """The kernel-cache variables a CPU learner actor's process starts with, for ``arm`` and the
    ``--set`` overrides (``train.kernel_cache_entries`` may be among them)."""
    from actors.learner import learner_runtime_env
    from prorl_async.config import load_config
    from prorl_async.learners.host_memory import KERNEL_CACHE_ENV

    env_vars = learner_runtime_env(load_config(None, [*ARMS[arm], *overrides])).get("runtime_env", {}).get("env_vars", {})
    return {k: v for k, v in env_vars.items() if k in KERNEL_CACHE_ENV}


def run_arm(arm: str, steps: int, overrides: list[str], distinct: int = 0) -> list[dict]:
    """One arm in this process: a line of JSON per step on stdout. ``distinct`` > 0 cycles through
    that many batches (their shapes repeat) instead of a new batch every step."""
    import torch

    from bench_learner import variable_length_table
    from prorl_async.config import ModelConfig, load_config
    from prorl_async.learners import host_memory
    from prorl_async.learners.torch_learner import TorchLearner
    from prorl_async.models import build_smollm2

    torch.set_num_threads(2)
    model_dir = str(build_smollm2(ModelConfig(), log=lambda *_: None))
    cfg = load_config(None, [f"model.path={model_dir}", "train.prompts_per_step=4", "rollout.n=8",
                             "train.mini_batches=1", "train.micro_batch_size=8", "algo.kl_coef=0.01",
                             "algo.kl_kind=k2", "train.lr=2e-5", "rollout.max_new_tokens=96",
                             *ARMS[arm], *overrides])
    learner = TorchLearner(cfg, model_dir, device="cpu")
    rows = []
    for step in range(1, steps + 1):
        seed = (step - 1) % distinct + 1 if distinct > 0 else step
        rng = random.Random(seed)
        prompts = [[rng.randrange(49000) for _ in range(rng.randint(250, 450))] for _ in range(4)]
        batch = variable_length_table(32, 0, rng.choice([24, 48, 96]), 49000, seed=seed, prompts=prompts, n=8)
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        metrics = learner.train_step(batch)
        dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        in_use, free = host_memory.heap_bytes()
        row = {"arm": arm, "step": step, "step_s": dt, "rss_gb": host_memory.resident_bytes() / 1e9,
               "in_use_gb": in_use / 1e9, "free_in_heap_gb": free / 1e9,
               "trimmed": metrics.get("perf/heap_trimmed", 0.0), "kernel_s": r1.ru_stime - r0.ru_stime,
               "user_s": r1.ru_utime - r0.ru_utime, "minor_faults": r1.ru_minflt - r0.ru_minflt}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    p = arg_parser(__doc__)
    p.add_argument("--steps", type=int, default=12, help="learner steps per arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {list(ARMS)}")
    p.add_argument("--set", nargs="*", default=["model.dtype=bfloat16"],
                   help="config overrides for every arm (default: bf16 weights, as the sixth run)")
    p.add_argument("--distinct-batches", type=int, default=0,
                   help="cycle through this many batches, so shapes repeat (0: a new batch every step)")
    p.add_argument("--arm", help="internal: run one arm in this process")
    args = p.parse_args(argv)
    if args.arm:
        run_arm(args.arm, args.steps, args.set, args.distinct_batches)
        return {}
    rows = []
    for arm in args.arms.split(","):
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps),
                              "--distinct-batches", str(args.distinct_batches), "--set", *args.set],
                             capture_output=True, text=True, env={**os.environ, **kernel_env(arm, args.set)})
        if out.returncode:
            raise SystemExit(f"arm {arm} failed:\n{out.stderr[-3000:]}")
        got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        for r in got:
            print(f"{arm:9s} step {r['step']:3d} {r['step_s']:5.1f}s rss {r['rss_gb']:5.2f} GB in use "
                  f"{r['in_use_gb']:5.2f} free in heap {r['free_in_heap_gb']:5.2f} trimmed {r['trimmed']:.0f} "
                  f"kernel {r['kernel_s']:4.1f}s faults {r['minor_faults']}",
                  flush=True)
        rows += got
    summary = []
    for arm in args.arms.split(","):
        mine = [r for r in rows if r["arm"] == arm]
        summary.append({"arm": arm, "steps_s": sum(r["step_s"] for r in mine),
                        "kernel_s": sum(r["kernel_s"] for r in mine),
                        "rss_first": mine[0]["rss_gb"], "rss_last": mine[-1]["rss_gb"],
                        "rss_max": max(r["rss_gb"] for r in mine),
                        "in_use_growth_mb": (mine[-1]["in_use_gb"] - mine[0]["in_use_gb"]) * 1e3,
                        "trims": sum(r["trimmed"] for r in mine)})
    print()
    print(table(summary, [("arm", "arm", "{}"), ("steps_s", "sum of step s", "{:.1f}"),
                          ("kernel_s", "kernel s", "{:.1f}"),
                          ("rss_first", "RSS step 1 GB", "{:.2f}"), ("rss_last", "RSS last GB", "{:.2f}"),
                          ("rss_max", "RSS max GB", "{:.2f}"), ("in_use_growth_mb", "in use +MB", "{:.0f}"),
                          ("trims", "trims", "{:.0f}")]))
    payload = {"benchmark": "learner-memory", "machine": machine(), "args": vars(args), "steps": rows,
               "summary": summary}
    path = write_json("learner_memory", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
