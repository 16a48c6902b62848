"""HumanEval grading time: the 164 canonical solutions and 164 stub bodies through GraderPool.

Every response is its own sandbox run (a fresh namespaced process tree); the pool grades
responses concurrently on ``--workers`` processes. Each worker count is timed in this one run
(after a warm-up batch that starts the workers), so the ratios between them are comparable;
absolute seconds depend on the (shared) machine, whose description and load average are
recorded. Also checks the verdicts: 164/164 canonical right, 164/164 stubs wrong.

Output: a table and ``benchmarks/out/humaneval_grading.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import OUT_DIR, machine, table, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default %(default)s)")
    p.add_argument("--out", default=str(OUT_DIR))
    args = p.parse_args(argv)

    from prorl_async.data.datasets import load_rows
    from prorl_async.rewards.pool import GraderPool
    from prorl_async.rewards.sandbox import isolation_mode

    rows = load_rows("builtin:humaneval")
    batches = {"canonical": ([r["meta"]["canonical_solution"] for r in rows], 1.0),
               "stub": (["    pass\n" if k % 2 else "    return None\n" for k in range(len(rows))], 0.0)}
    info = {**machine(), "isolation": isolation_mode()}
    results = []
    for w in [int(x) for x in args.workers.split(",")]:
        with GraderPool(num_workers=w, timeout_s=10.0) as pool:
            pool.grade_many(rows[:w * 2], [r["meta"]["canonical_solution"] for r in rows[:w * 2]])  # warm-up
            for name, (responses, expected) in batches.items():
                t0 = time.perf_counter()
                grades = pool.grade_many(rows, responses)
                s = time.perf_counter() - t0
                ok = sum(g.valid and g.reward == expected for g in grades)
                results.append({"workers": w, "responses": name, "n": len(rows), "s": s,
                                "per_s": len(rows) / s, "as_expected": ok})
    base = {r["responses"]: r["s"] for r in results if r["workers"] == results[0]["workers"]}
    for r in results:
        r["speedup"] = base[r["responses"]] / r["s"]
    print(f"machine: {info}")
    print(table(results, [("workers", "workers", "{}"), ("responses", "responses", "{}"), ("n", "n", "{}"),
                          ("s", "s", "{:.1f}"), ("per_s", "responses/s", "{:.1f}"),
                          ("speedup", "vs first", "{:.2f}x"), ("as_expected", "as expected", "{}")]))
    print(write_json("humaneval_grading", {"machine": info, "results": results}, Path(args.out)))
    return 0 if all(r["as_expected"] == r["n"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
