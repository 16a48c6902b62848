"""Where a vLLM generator's resident memory goes over many weight updates.

A long SmolLM2 run (docs/prorl_in_miniature.md) saw its generator grow from 3.5 GB to 6.2 GB in 75
steps. This script repeats what the generator does each step, in one process and without Ray: receive
the learner's weights over gloo into the in-process vLLM engine, reload them, generate a batch; and
after every update records the process's RSS and glibc's heap counters (``mallinfo2``: bytes in use
by the program vs bytes free inside the heap that the process still holds), so growth can be told
apart into a leak (in use grows) and a heap that keeps what was freed (free grows).

    .venv/bin/python benchmarks/bench_generator_memory.py --updates 30

Each arm runs in its own process, one after another: ``with`` is the generator as shipped (it hands
the heap's free pages back after each update, :func:`prorl_async.machine.release_freed_heap`, whose
time is recorded), ``without`` the same with that call disabled (the behaviour before).
Writes benchmarks/out/generator_memory.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from _common import arg_parser, machine, write_json

PROMPTS = [f"What is {a} + {b}? Put the result in <answer></answer> tags." for a, b in
           [(3, 4), (12, 9), (7, 8), (25, 17), (6, 6), (40, 2), (11, 13), (9, 30)]]


def heap() -> dict:
    """glibc's counters in MB: ``in_use`` (allocated, heap + mmapped), ``free_held`` (freed, still mapped)."""
    from prorl_async.learners.host_memory import heap_counters

    m = heap_counters()
    if m is None:
        raise SystemExit("bench_generator_memory needs glibc's mallinfo2 (glibc 2.33 or newer)")
    return {"in_use_mb": (m["uordblks"] + m["hblkhd"]) / 2**20, "free_held_mb": m["fordblks"] / 2**20,
            "mmapped_mb": m["hblkhd"] / 2**20}


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def arm(updates: int, release: bool, kv_cache_gb: float, max_new_tokens: int) -> dict:
    import torch

    from prorl_async import machine

    real, release_s = machine.release_freed_heap, []

    def timed() -> bool:
        t = time.perf_counter()
        done = real() if release else False
        release_s.append(time.perf_counter() - t)
        return done

    machine.release_freed_heap = timed  # the engine's worker calls it by module attribute

    from prorl_async.config import load_config
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.prompts import encode_prompt
    from prorl_async.engines.vllm import VLLMEngine
    from prorl_async.models import load_model, resolve_model_path
    from prorl_async.weight_sync import WeightSyncGroup, free_port

    torch.set_num_threads(1)
    path = resolve_model_path(load_config(None, ["model.path=builtin:smollm2-135m-instruct"]).model, log=lambda *_: None)
    engine = VLLMEngine(path, dtype="float32", seed=0, in_process=True, kv_cache_gb=kv_cache_gb)
    learner = load_model(path, "float32")
    named = [(n, p.detach()) for n, p in learner.named_parameters()]
    port, ready = free_port(), threading.Event()
    go = threading.Semaphore(0)

    def learner_side():
        group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=120)
        ready.set()
        for v in range(1, updates + 1):
            go.acquire()
            with torch.no_grad():
                for _, t in named:
                    t.add_(1e-4 * torch.randn_like(t))  # a learner step's worth of change
            group.send(named, version=v)

    sender = threading.Thread(target=learner_side, daemon=True)
    sender.start()
    engine.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", timeout_s=120)
    ready.wait(120)
    ids = [encode_prompt(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    spec = SamplingSpec(n=8, temperature=1.0, max_new_tokens=max_new_tokens)
    rows = [{"update": 0, "rss_mb": rss_mb(), **heap()}]
    t0 = time.time()
    for v in range(1, updates + 1):
        go.release()
        info = engine.receive_weights()
        assert info["version"] == v and info["applied"], info
        engine.generate(ids, spec)
        rows.append({"update": v, "rss_mb": rss_mb(), **heap()})
    sender.join(60)
    engine.shutdown()
    assert len(release_s) == updates, release_s  # once per applied update
    return {"release": release, "rows": rows, "seconds": time.time() - t0,
            "release_ms_mean": 1e3 * sum(release_s) / len(release_s)}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--arm", choices=["with", "without"], help="(internal) run one arm in this process")
    args = p.parse_args()
    if args.arm:  # a child: one arm, its JSON on the last line
        print(json.dumps(arm(args.updates, args.arm == "with", args.kv_cache_gb, args.max_new_tokens)))
        return
    results = {}
    for name in ("without", "with"):
        out = subprocess.run([sys.executable, __file__, "--arm", name, "--updates", str(args.updates),
                              "--kv-cache-gb", str(args.kv_cache_gb), "--max-new-tokens", str(args.max_new_tokens)],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"arm {name} failed:\n{out.stderr[-3000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'arm':7} {'update':>6} {'rss MB':>8} {'in use':>8} {'free held':>10}")
    for name, r in results.items():
        for row in r["rows"]:
            if row["update"] in (0, 1, 2, 5, 10, 20) or row["update"] == args.updates:
                print(f"{name:7} {row['update']:6d} {row['rss_mb']:8.0f} {row['in_use_mb']:8.0f} {row['free_held_mb']:10.0f}")
        start, first, last = r["rows"][0], r["rows"][2], r["rows"][-1]
        print(f"{name}: RSS {last['rss_mb'] - start['rss_mb']:+.0f} MB over {args.updates} updates, "
              f"{last['rss_mb'] - first['rss_mb']:+.0f} MB from update 2 (in use {last['in_use_mb'] - first['in_use_mb']:+.0f}); "
              f"release call {r['release_ms_mean']:.1f} ms")
    write_json("generator_memory", {"machine": machine(), "args": vars(args), **results})


if __name__ == "__main__":
    main()
