"""Replay-buffer throughput: put / take rows/s and GB/s vs measured memcpy bandwidth.

Two paths, each with realistic rows (a 256-token prompt and a response of 1K or 8K tokens:
``prompt_ids``/``response_ids`` int32 and ``behavior_logprobs`` float32, about 9 KB and 66 KB a
row), in requests of 16 prompts x n=8 samples (128 rows, one Arrow RecordBatch), half of each
group correct so that dynamic sampling keeps every group:

* ``pure``: :class:`prorl_async.buffer.ReplayBuffer` in this process. ``put`` splits a request
  into groups and copies each group's rows (``RecordBatch.take``); ``take`` hands 32 groups
  (256 rows) out as one ``pa.Table`` built from the stored batches (no copy).
* ``ray``: the :class:`actors.replay_buffer.ReplayBufferActor` in a local Ray cluster started
  here (own temp dir, ``ray.shutdown()`` at the end). ``put`` = the driver's pattern: the batch
  is already in the object store (the grader's return value; ``ray.put`` here, timed apart) and
  the actor is handed it (resolved by Ray) and its reference; calls are pipelined. ``take`` = one
  ``take.remote``, which returns :class:`actors.replay_buffer.BatchRefs` (the objects the rows
  live in), then their resolution by the caller (shared-memory mapping and slicing, no copy).
  ``bench_rollout_transport.py`` times the whole way to a learner actor.

GB/s counts the Arrow buffers of the rows moved once (``nbytes``). The reference is a
single-threaded ``numpy.copyto`` of a 512 MiB array (bytes copied / s; each byte is read once
and written once), best of several.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from _common import OUT_DIR, arg_parser, machine, memcpy_gbps, plt, start_ray, table, write_json


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--response-lens", default="1024,8192", help="response tokens per row")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per row")
    p.add_argument("--total-mb", type=float, default=256.0, help="data moved per configuration (MB)")
    p.add_argument("--groups-per-take", type=int, default=32, help="groups per take (train.prompts_per_step)")
    p.add_argument("--memcpy-mb", type=int, default=512, help="size of the memcpy reference array (MiB)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray-actor path")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


def make_batches(num: int, plen: int, rlen: int, prompts: int = 16, n: int = 8):
    import numpy as np
    import pyarrow as pa

    from prorl_async.data.schema import ROLLOUT_SCHEMA

    rng = np.random.default_rng(0)
    rows = prompts * n
    out = []
    for b in range(num):
        prompt_ids = pa.ListArray.from_arrays(np.arange(0, (rows + 1) * plen, plen, dtype=np.int32),
                                              pa.array(rng.integers(0, 32000, rows * plen, dtype=np.int32)))
        response_ids = pa.ListArray.from_arrays(np.arange(0, (rows + 1) * rlen, rlen, dtype=np.int32),
                                                pa.array(rng.integers(0, 32000, rows * rlen, dtype=np.int32)))
        logps = pa.ListArray.from_arrays(np.arange(0, (rows + 1) * rlen, rlen, dtype=np.int32),
                                         pa.array(-rng.random(rows * rlen, dtype=np.float32)))
        reward = (np.arange(rows) % 2).astype(np.float32)
        cols = {
            "sample_id": pa.array([f"r{b}-{i}" for i in range(rows)]),
            "prompt_id": pa.array([f"p{b}-{i // n}" for i in range(rows)]),
            "domain": pa.array(["math"] * rows),
            "prompt_ids": prompt_ids, "response_ids": response_ids, "behavior_logprobs": logps,
            "policy_version": pa.array(np.zeros(rows, dtype=np.int64)),
            "policy_version_end": pa.array(np.zeros(rows, dtype=np.int64)),
            "finish_reason": pa.array(["stop"] * rows),
            "raw_reward": pa.array(reward),
            "reward_valid": pa.array(np.ones(rows, dtype=bool)),
            "gen_time_s": pa.array(np.zeros(rows, dtype=np.float32)),
            "grade_time_s": pa.array(np.zeros(rows, dtype=np.float32)),
            "response_text": pa.array([""] * rows), "grade_reason": pa.array(["correct"] * rows),
            "request_id": pa.array([f"req{b}"] * rows),
        }
        out.append(pa.RecordBatch.from_arrays([cols[f.name] for f in ROLLOUT_SCHEMA], schema=ROLLOUT_SCHEMA))
    return out


def bench_pure(batches, groups_per_take: int) -> dict:
    from prorl_async.buffer import ReplayBuffer

    buf = ReplayBuffer(max_staleness=1, dynamic_sampling=True)
    rows_in = sum(b.num_rows for b in batches)
    bytes_in = sum(b.nbytes for b in batches)
    t0 = time.perf_counter()
    for b in batches:
        buf.put(b)
    put_s = time.perf_counter() - t0
    taken_rows = taken_bytes = 0
    t0 = time.perf_counter()
    while True:
        t = buf.take(0, groups_per_take).table
        if t is None:
            break
        taken_rows += t.num_rows
        taken_bytes += t.nbytes
    take_s = time.perf_counter() - t0
    return {"put_rows_s": rows_in / put_s, "put_gbps": bytes_in / put_s / 1e9,
            "take_rows_s": taken_rows / take_s, "take_gbps": taken_bytes / take_s / 1e9,
            "rows": rows_in, "bytes": bytes_in}


def bench_ray(batches, groups_per_take: int) -> dict:
    import ray

    from actors.replay_buffer import ReplayBufferActor

    actor = ReplayBufferActor.options(num_cpus=0).remote(1, True)
    ray.get(actor.metrics.remote())
    rows_in = sum(b.num_rows for b in batches)
    bytes_in = sum(b.nbytes for b in batches)
    t0 = time.perf_counter()
    refs = [ray.put(b) for b in batches]
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.get([actor.put.remote(r, [r]) for r in refs])  # as the driver puts a graded request
    put_s = time.perf_counter() - t0
    del refs
    taken_rows = taken_bytes = 0
    t0 = time.perf_counter()
    while True:
        info = ray.get(actor.take.remote(0, groups_per_take))
        if info.batch is None:
            break
        t = info.batch.resolve()  # BatchRefs: map the objects the rows live in, slice them
        taken_rows += t.num_rows
        taken_bytes += t.nbytes
        del t, info
    take_s = time.perf_counter() - t0
    ray.kill(actor)
    return {"store_put_gbps": bytes_in / store_s / 1e9,
            "put_rows_s": rows_in / put_s, "put_gbps": bytes_in / put_s / 1e9,
            "take_rows_s": taken_rows / take_s, "take_gbps": taken_bytes / take_s / 1e9,
            "rows": rows_in, "bytes": bytes_in}


def main(argv=None) -> dict:
    args = parse_args(argv)
    mem = memcpy_gbps(args.memcpy_mb * 2**20)
    print(f"memcpy (numpy.copyto, {args.memcpy_mb} MiB, 1 thread): {mem:.2f} GB/s", flush=True)
    ray_tmp = None if args.no_ray else start_ray(num_cpus=2, object_store_memory=2 * 2**30)
    results = []
    try:
        for rlen in [int(x) for x in args.response_lens.split(",")]:
            probe = make_batches(1, args.prompt_len, rlen)[0]
            num = max(2, int(args.total_mb * 1e6 / probe.nbytes))
            batches = make_batches(num, args.prompt_len, rlen)
            row_kb = probe.nbytes / probe.num_rows / 1e3
            paths = [("pure", lambda: bench_pure(batches, args.groups_per_take))]
            if ray_tmp:
                paths.append(("ray", lambda: bench_ray(batches, args.groups_per_take)))
            for name, fn in paths:
                r = fn()
                r.update({"path": name, "response_len": rlen, "row_kb": row_kb,
                          "put_frac_memcpy": r["put_gbps"] / mem, "take_frac_memcpy": r["take_gbps"] / mem})
                results.append(r)
                print(f"  {name:<4} {rlen:>5}-token rows: put {r['put_gbps']:.2f} GB/s, take {r['take_gbps']:.2f} GB/s",
                      flush=True)
    finally:
        if ray_tmp:
            import ray
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    mem = max(mem, memcpy_gbps(args.memcpy_mb * 2**20))  # again at the end (shared machine); keep the better
    for r in results:
        r["put_frac_memcpy"], r["take_frac_memcpy"] = r["put_gbps"] / mem, r["take_gbps"] / mem
    print()
    print(table(results, [("path", "path", "{}"), ("response_len", "resp tokens", "{:d}"), ("row_kb", "row KB", "{:.1f}"),
                          ("put_rows_s", "put rows/s", "{:.0f}"), ("put_gbps", "put GB/s", "{:.2f}"),
                          ("put_frac_memcpy", "put/memcpy", "{:.1%}"), ("take_rows_s", "take rows/s", "{:.0f}"),
                          ("take_gbps", "take GB/s", "{:.2f}"), ("take_frac_memcpy", "take/memcpy", "{:.1%}"),
                          ("store_put_gbps", "ray.put GB/s", "{:.2f}")]))
    print(f"\n(machine: {machine()['cpu']}, {os.cpu_count()} cores; memcpy {mem:.2f} GB/s; "
          f"requests of 128 rows, takes of {args.groups_per_take} groups x 8 rows)")
    payload = {"benchmark": "buffer", "machine": machine(), "memcpy_gbps": mem,
               "args": {**vars(args), "out": str(args.out)}, "results": results}
    path = write_json("bench_buffer", payload, args.out)
    plot(results, mem, args.out / "bench_buffer.png")
    print(f"wrote {path} and {args.out / 'bench_buffer.png'}")
    return payload


def plot(results, mem, path):
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 4.5))
    labels = [f"{r['path']}\n{r['response_len']} tok" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["put_gbps"] for r in results], width=0.4, label="put")
    ax.bar([i + 0.2 for i in x], [r["take_gbps"] for r in results], width=0.4, label="take")
    ax.axhline(mem, ls="--", color="gray", label=f"memcpy {mem:.1f} GB/s")
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="GB/s (Arrow bytes moved once)", yscale="log",
           title=f"replay buffer on {machine()['cpu']} ({os.cpu_count()} cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
