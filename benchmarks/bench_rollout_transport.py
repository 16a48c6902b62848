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
* ``pipelined`` (not what the driver does now: it takes the next batch after the step's answer):
  ``--repeats`` batches as a stream, each taken and handed to the learner while the learner
  still has the previous one (two ``train_step`` calls in flight), as a driver that overlapped
  the hand-over with a training step would move them; time = the stream's wall time / batches.

For ``by_reference`` the time is split into its legs (``LEGS``; medians, wall-clock stamps taken
by the driver and the stand-in on the same machine).

Bytes/s = the table's Arrow ``nbytes`` / seconds (median of ``--repeats`` for the one-at-a-time
paths), timed two ways:
to the learner's answer (the driver's view, two round trips) and until the learner holds the
table (its wall-clock stamp; same machine). The reference is a single-threaded
``numpy.copyto`` of the same number of bytes (bytes copied / s, best of ``--repeats``, twice,
after the paths; the better is kept) and, as bench_buffer.py uses, of 512 MiB (out of cache).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from _common import OUT_DIR, arg_parser, machine, memcpy_gbps, start_ray, table, write_json
from bench_buffer import make_batches


# the by-reference path's legs: the driver's take round trip; from the driver's train_step call
# until the learner runs it; the learner's resolve_batch; from its return to the driver's answer
LEGS = ("take", "hand-over", "resolve", "answer")


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--response-len", type=int, default=8192, help="response tokens per row")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per row")
    p.add_argument("--groups", type=int, default=32, help="groups per batch (train.prompts_per_step); 8 rows each")
    p.add_argument("--repeats", type=int, default=15, help="batches moved per path")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


def run_paths(args) -> tuple[list[dict], int]:
    import ray

    from actors.learner import resolve_batch
    from actors.replay_buffer import BatchRefs, ReplayBufferActor

    @ray.remote(num_cpus=0)
    class LearnerStandIn:
        def train_step(self, batch, step: int) -> dict:
            entered = time.time()
            t = resolve_batch(batch)
            return {"rows": t.num_rows, "nbytes": t.nbytes, "entered_at": entered,
                    "held_at": time.time()}  # the learner holds the batch

    per_batch = 16  # groups in a request of make_batches (16 prompts x 8 samples)
    batches = make_batches(max(1, args.groups // per_batch) * (args.repeats * 3 + 1), args.prompt_len,
                           args.response_len)
    buffer = ReplayBufferActor.options(num_cpus=0).remote(1, True)
    learner = LearnerStandIn.remote()
    refs = [ray.put(b) for b in batches]  # the graded requests, in the object store
    ray.get([buffer.put.remote(r, [r]) for r in refs])
    del batches, refs  # the buffer holds the references now

    def by_reference():
        info = ray.get(buffer.take.remote(0, args.groups))
        taken = time.time()
        return {**ray.get(learner.train_step.remote(info.batch, 0)), "taken_at": taken}

    def through_driver():
        info = ray.get(buffer.take.remote(0, args.groups))
        return ray.get(learner.train_step.remote(info.batch.resolve(), 0))

    one = ray.get(buffer.take.remote(0, args.groups)).batch.resolve().combine_chunks()  # for put_get

    def put_get():
        return ray.get(learner.train_step.remote(BatchRefs([(ray.put(one), 0, one.num_rows)], one.num_rows), 0))

    out = []
    for name, fn in (("by_reference", by_reference), ("through_driver", through_driver), ("put_get", put_get)):
        fn()  # warm-up
        times, held, legs, nbytes = [], [], [], 0
        for _ in range(args.repeats - 1):
            t0, w0 = time.perf_counter(), time.time()
            r = fn()
            times.append(time.perf_counter() - t0)
            w3 = time.time()
            held.append(r["held_at"] - w0)  # same machine, same clock
            if "taken_at" in r:  # where the time goes: take's round trip, hand-over, resolve, answer
                legs.append((r["taken_at"] - w0, r["entered_at"] - r["taken_at"], r["held_at"] - r["entered_at"],
                             w3 - r["held_at"]))
            assert r["rows"] == args.groups * 8, r
            nbytes = r["nbytes"]
        med, med_held = statistics.median(times), statistics.median(held)
        out.append({"path": name, "rows": args.groups * 8, "mb": nbytes / 1e6, "median_ms": med * 1e3,
                    "min_ms": min(times) * 1e3, "gbps": nbytes / med / 1e9,
                    "held_ms": med_held * 1e3, "held_gbps": nbytes / med_held / 1e9})
        print(f"  {name:<15} {nbytes / 1e6:.1f} MB: median {med * 1e3:.1f} ms to the answer, "
              f"{med_held * 1e3:.1f} ms until the learner holds it", flush=True)
        if legs:
            out[-1]["legs_ms"] = {k: statistics.median(x[i] for x in legs) * 1e3 for i, k in enumerate(LEGS)}
            print("  " + " " * 16 + ", ".join(f"{k} {v:.2f} ms" for k, v in out[-1]["legs_ms"].items()) + " (medians)",
                  flush=True)

    # pipelined: the next batch is taken and handed over while the learner still has the previous
    # one (two train_step calls in flight), as a driver would overlap them with a training step
    t0, in_flight, answers = time.perf_counter(), [], []
    for _ in range(args.repeats):
        info = ray.get(buffer.take.remote(0, args.groups))
        in_flight.append(learner.train_step.remote(info.batch, 0))
        if len(in_flight) == 2:
            answers.append(ray.get(in_flight.pop(0)))
    answers += ray.get(in_flight)
    per = (time.perf_counter() - t0) / args.repeats
    assert [a["rows"] for a in answers] == [args.groups * 8] * args.repeats, answers
    out.append({"path": "pipelined", "rows": args.groups * 8, "mb": nbytes / 1e6, "median_ms": per * 1e3,
                "gbps": nbytes / per / 1e9})
    print(f"  {'pipelined':<15} {nbytes / 1e6:.1f} MB: {per * 1e3:.1f} ms a batch over a stream of "
          f"{args.repeats}", flush=True)
    return out, nbytes


def main(argv=None) -> dict:
    args = parse_args(argv)
    ray_tmp = start_ray(num_cpus=2, object_store_memory=2 * 2**30)
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
        r["frac_memcpy"] = r["gbps"] / mem
        if "held_gbps" in r:
            r["held_frac_memcpy"] = r["held_gbps"] / mem
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
