"""Buffer -> learner: how fast one training batch reaches the learner, vs memcpy (issue 14).

One batch as the published recipe shapes it: 256 rows (32 groups x 8 samples), each a 256-token
prompt and an 8K-token response (int32 ids, float32 behaviour logprobs: ~17 MB of Arrow
buffers), in a local Ray cluster started here (own temp dir, shut down at the end), with the
real :class:`actors.replay_buffer.ReplayBufferActor` and a learner stand-in actor whose
``train_step`` resolves the batch with the learner's own :func:`actors.learner.resolve_batch`
and returns its size (no training: this measures the transport). Paths, one batch at a time
as the driver moves it, from the ``take`` call to the learner's answer:

* ``by_reference`` (the driver now): the graded requests were put into the buffer as the
  driver puts them (the batch and its reference); ``take`` returns counts plus
  :class:`actors.replay_buffer.BatchRefs` (the objects the rows already live in, row ranges);
  the driver hands them to the learner unresolved; the learner maps and slices the objects.
* ``through_driver`` (what a driver that resolves the batch pays): the driver resolves the
  batch and passes the table as an argument, so it is serialized a second time.
* ``put_get`` (Ray's floor for one hop): the driver ``ray.put``\\ s the same table and the
  stand-in resolves the reference.

Bytes/s = the table's Arrow ``nbytes`` / seconds (median of ``--repeats``), timed two ways:
to the learner's answer (the driver's view, two round trips) and until the learner holds the
table (its wall-clock stamp; same machine). The reference is a single-threaded
``numpy.copyto`` of the same number of bytes (bytes copied / s, best of ``--repeats``, twice,
after the paths; the better is kept) and, as bench_buffer.py uses, of 512 MiB (out of cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import OUT_DIR, machine, table, write_json  # noqa: E402
from bench_buffer import make_batches, start_ray  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--response-len", type=int, default=8192, help="response tokens per row")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per row")
    p.add_argument("--groups", type=int, default=32, help="groups per batch (train.prompts_per_step); 8 rows each")
    p.add_argument("--repeats", type=int, default=15, help="batches moved per path")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


def memcpy_gbps(nbytes: int, reps: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def run_paths(args) -> tuple[list[dict], int]:
    import ray

    from actors.learner import resolve_batch
    from actors.replay_buffer import BatchRefs, ReplayBufferActor

    @ray.remote(num_cpus=0)
    class LearnerStandIn:
        def train_step(self, batch, step: int) -> dict:
            t = resolve_batch(batch)
            return {"rows": t.num_rows, "nbytes": t.nbytes, "held_at": time.time()}  # the learner holds the batch

    per_batch = 16  # groups in a request of make_batches (16 prompts x 8 samples)
    batches = make_batches(max(1, args.groups // per_batch) * (args.repeats * 2 + 1), args.prompt_len,
                           args.response_len)
    buffer = ReplayBufferActor.options(num_cpus=0).remote(1, True)
    learner = LearnerStandIn.remote()
    refs = [ray.put(b) for b in batches]  # the graded requests, in the object store
    ray.get([buffer.put.remote(r, [r]) for r in refs])
    del batches, refs  # the buffer holds the references now

    def by_reference():
        info = ray.get(buffer.take.remote(0, args.groups))
        return ray.get(learner.train_step.remote(info["table"], 0))

    def through_driver():
        info = ray.get(buffer.take.remote(0, args.groups))
        return ray.get(learner.train_step.remote(info["table"].resolve(), 0))

    one = ray.get(buffer.take.remote(0, args.groups))["table"].resolve().combine_chunks()  # for put_get

    def put_get():
        return ray.get(learner.train_step.remote(BatchRefs([(ray.put(one), 0, one.num_rows)], one.num_rows), 0))

    out = []
    for name, fn in (("by_reference", by_reference), ("through_driver", through_driver), ("put_get", put_get)):
        fn()  # warm-up
        times, held, nbytes = [], [], 0
        for _ in range(args.repeats - 1):
            t0, w0 = time.perf_counter(), time.time()
            r = fn()
            times.append(time.perf_counter() - t0)
            held.append(r["held_at"] - w0)  # same machine, same clock
            assert r["rows"] == args.groups * 8, r
            nbytes = r["nbytes"]
        med, med_held = statistics.median(times), statistics.median(held)
        out.append({"path": name, "rows": args.groups * 8, "mb": nbytes / 1e6, "median_ms": med * 1e3,
                    "min_ms": min(times) * 1e3, "gbps": nbytes / med / 1e9,
                    "held_ms": med_held * 1e3, "held_gbps": nbytes / med_held / 1e9})
        print(f"  {name:<15} {nbytes / 1e6:.1f} MB: median {med * 1e3:.1f} ms to the answer, "
              f"{med_held * 1e3:.1f} ms until the learner holds it", flush=True)
    return out, nbytes


def main(argv=None) -> dict:
    args = parse_args(argv)
    ray_tmp = start_ray()
    try:
        import numpy  # noqa: F401  (before the timing)

        results, nbytes = run_paths(args)
    finally:
        import ray
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    mem = max(memcpy_gbps(nbytes, args.repeats), memcpy_gbps(nbytes, args.repeats))
    big = memcpy_gbps(512 * 2**20, 5)
    for r in results:
        r["frac_memcpy"], r["held_frac_memcpy"] = r["gbps"] / mem, r["held_gbps"] / mem
        r["frac_memcpy_512mib"] = r["gbps"] / big
    print()
    print(table(results, [("path", "path", "{}"), ("rows", "rows", "{:d}"), ("mb", "MB", "{:.1f}"),
                          ("median_ms", "median ms", "{:.1f}"), ("min_ms", "min ms", "{:.1f}"),
                          ("gbps", "GB/s", "{:.2f}"), ("frac_memcpy", "/ memcpy", "{:.1%}"),
                          ("frac_memcpy_512mib", "/ memcpy 512MiB", "{:.1%}"), ("held_ms", "held ms", "{:.1f}"),
                          ("held_frac_memcpy", "held / memcpy", "{:.1%}")]))
    m = machine()
    print(f"\n(machine: {m['cpu']}, {os.cpu_count()} cores; memcpy of the same {nbytes / 1e6:.1f} MB "
          f"{mem:.2f} GB/s, of 512 MiB {big:.2f} GB/s)")
    payload = {"benchmark": "rollout_transport", "machine": m, "memcpy_gbps": mem, "memcpy_512mib_gbps": big,
               "args": {**vars(args), "out": str(args.out)}, "results": results}
    path = write_json("bench_rollout_transport", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
