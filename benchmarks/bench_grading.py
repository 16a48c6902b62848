"""Grading throughput: responses/s per domain, in-process and through the GraderPool.

Rows are the built-in eval-split tasks (``builtin:<domain>``; ``builtin:arithmetic`` for the
default task), responses a realistic half-right / half-wrong mix (gold answers in ``\\boxed{}``
with some prose, reference programs for code). Modes:

* ``in-process``: ``prorl_async.rewards.grade`` in a loop in this process (one core). For code
  this runs every program in the real sandbox (a fresh namespaced process tree per response).
  For math also with the verdict caches cleared before every sample (the cost of one
  Math-Verify parse + verify, with no repeated answers), on the built-in rows (mostly integer
  answers) and on a fixed set of harder forms (symbolic, sets, intervals, roots).
* ``plain exec (UNSAFE, no sandbox)``: code only. The same programs ``exec``-ed in this process
  with stdin/stdout redirected: what the sandbox costs, not something to run on model output.
* ``pool``: :class:`prorl_async.rewards.pool.GraderPool` with ``--workers`` processes (chunked
  IPC, kill-based time limit), whole batch per ``grade_many`` call; ``mixed`` interleaves all
  domains in one batch.

Every mode is timed after a warm-up batch of train-split rows (Math-Verify's import and first
parse, worker start-up); the timed rows are eval split (disjoint prompts), and the in-process
math caches are cleared before timing: the math verifier caches verdicts per (gold, answer),
so re-grading the same rows would flatter it. Repeated (gold, answer) pairs inside the timed
batch do hit the cache, as the n samples of a group do in training.

Recovery from hanging samples (``--hangs``, issue 15): one ``grade_many`` batch of N responses
that hang Math-Verify for real (``\\boxed{10^{10^{10}}}``: SymPy evaluates the power tower) spread
among M normal (arithmetic) responses, through a pool with a ``--hang-timeout-s`` limit, once with the
pool's fast recovery (hanging samples moved aside onto spare workers, their limits run side by
side) and once with it switched off (``max_stalled=0, spare_workers=0``: each hang blocks its
worker's chunk and a killed worker is replaced when its slot is next needed, the behaviour
before), interleaved in one run. Reported: wall time in units of the limit.

Output: a table, ``benchmarks/out/grading.json`` and ``benchmarks/out/grading.png``
(``grading_hangs.json`` for ``--hangs``). The machine is shared: the load average at start is
recorded with the numbers.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import OUT_DIR, machine, plt, table, write_json  # noqa: E402

DOMAINS = ["arithmetic", "math", "code", "stem", "logic", "instruction"]
DEFAULT_N = {"arithmetic": 20000, "math": 300, "code": 60, "stem": 3000, "logic": 3000,
             "instruction": 3000}

# reference programs for the built-in code templates (meta["task"])
REFERENCE = {
    "filtered_sum": lambda m: f"input()\nprint(sum(x for x in map(int, input().split()) if x % {m['k']} == 0))\n",
    "reverse_words": lambda m: f"print({m['sep']!r}.join(input().split()[::-1]))\n",
    "vowels": lambda m: f"for _ in range(int(input())):\n    print(sum(c in {m['letters']!r} for c in input()))\n",
    "max_subarray": lambda m: "input()\nxs = list(map(int, input().split()))\nb = c = xs[0]\n"
                              "for x in xs[1:]:\n    c = max(x, c + x)\n    b = max(b, c)\nprint(b)\n",
    "fizzbuzz": lambda m: f"for i in range(1, int(input()) + 1):\n"
                          f"    s = ({m['wa']!r} if i % {m['a']} == 0 else '') + "
                          f"({m['wb']!r} if i % {m['b']} == 0 else '')\n    print(s or i)\n",
    "rotate": lambda m: ("def rotate(nums, k):\n    if not nums:\n        return []\n    k %= len(nums)\n"
                         + ("    return nums[k:] + nums[:k]\n" if m["direction"] == "left"
                            else "    return nums[len(nums) - k:] + nums[:len(nums) - k]\n")),
}
# harder math: LaTeX forms Math-Verify has to work for (symbolic, sets, intervals, roots), cycled
HARD_MATH = [
    ("\\frac{\\sqrt{3}}{3}", "\\boxed{\\frac{1}{\\sqrt{3}}}"), ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("[1,2)", "\\boxed{[1, 2)}"), ("\\{1,2,3\\}", "\\boxed{\\{3, 1, 2\\}}"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"), ("50\\%", "\\boxed{0.5}"), ("3+2i", "\\boxed{3-2i}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}"), ("e^2", "\\boxed{2e}"), ("(-\\infty, 3]", "\\boxed{(-\\infty,3)}"),
    ("\\frac{x}{2}", "\\boxed{0.5x}"), ("2x+2", "\\boxed{2x+1}"),
]
INSTRUCTION_TEXTS = [
    "here is a short note about the topic. it is quiet and simple.\n\nthe light was warm.",
    "* First point about the morning\n* Second point, with water\n* Third point",
    '{"title": "A note", "body": "The wind over the stone"}',
    "IMAGINE A JOURNEY THROUGH THE HILLS. THE WIND IS COLD. THANK YOU FOR READING.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated subset of %(default)s")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the per-domain sample counts (%s)" % DEFAULT_N)
    p.add_argument("--workers", type=int, default=2, help="GraderPool workers (default 2)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="GraderPool per-sample limit")
    p.add_argument("--out", default=str(OUT_DIR), help="output directory (default benchmarks/out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hangs", default="",
                   help="comma-separated counts N of hanging samples per batch: run the recovery benchmark "
                        "(instead of the throughput one), e.g. 1,4,8")
    p.add_argument("--hang-normal", type=int, default=200, help="normal (arithmetic) samples in each hang batch")
    p.add_argument("--hang-timeout-s", type=float, default=2.0, help="pool limit in the hang benchmark")
    p.add_argument("--repeats", type=int, default=2, help="hang benchmark: repeats of each (N, mode)")
    return p.parse_args(argv)


def hang_batch(n_hang: int, n_normal: int, seed: int) -> tuple[list[dict], list[str], list[int]]:
    """n_normal arithmetic samples (half right; cheap, so that the wall time is what the hangs
    cost) with n_hang real Math-Verify hangs spread among them."""
    rows, responses = make_batch("arithmetic", max(n_normal, 4), seed)
    rows, responses = rows[:n_normal], responses[:n_normal]
    step = max(1, len(rows) // max(n_hang, 1))
    hangs = []
    for k in range(n_hang):
        at = min(k * step + k, len(rows))
        rows.insert(at, {"id": f"hang{k}", "domain": "math", "prompt": "?", "answer": "2"})
        responses.insert(at, "So the answer is \\boxed{10^{10^{10}}}.")
        hangs.append(at)
    return rows, responses, hangs


def bench_hangs(args, info) -> None:
    from prorl_async.rewards.pool import GraderPool

    counts = [int(x) for x in args.hangs.split(",") if x]
    modes = {"fast recovery (default)": {}, "serial (before: max_stalled=0, spare_workers=0)":
             {"max_stalled": 0, "spare_workers": 0}}
    warm_rows, warm_resp = map(sum, zip(make_batch("math", 20, args.seed, "train"),
                                        make_batch("arithmetic", 20, args.seed, "train")), ([], []))
    results = []
    for rep in range(args.repeats):
        for n_hang in counts:
            order = list(modes.items()) if rep % 2 == 0 else list(reversed(modes.items()))
            for label, kw in order:
                rows, responses, hangs = hang_batch(n_hang, args.hang_normal, args.seed)
                with GraderPool(num_workers=args.workers, timeout_s=args.hang_timeout_s, **kw) as pool:
                    pool.grade_many(warm_rows, warm_resp)  # worker start-up and Math-Verify import
                    t0 = time.perf_counter()
                    grades = pool.grade_many(rows, responses)
                    wall = time.perf_counter() - t0
                    m = pool.metrics()
                timed_out = sum(grades[i].reason == "timeout" for i in hangs)
                normal = [g for i, g in enumerate(grades) if i not in set(hangs)]
                normal_ok = sum(g.valid for g in normal)
                bad = collections.Counter(g.reason for g in normal if not g.valid)
                r = {"hangs": n_hang, "normal": len(rows) - n_hang, "mode": label, "repeat": rep,
                     "wall_s": round(wall, 2), "limits": wall / args.hang_timeout_s,
                     "timed_out": timed_out, "normal_valid": normal_ok,
                     "restarts": m["grader/restarts"], "stalls": m["grader/stalls"],
                     "normal_invalid_reasons": dict(bad)}
                results.append(r)
                print(f"N={n_hang:3d} M={r['normal']} {label:48s} {wall:6.2f} s = {r['limits']:.2f} limits "
                      f"(timed out {timed_out}/{n_hang}, normal valid {normal_ok}/{r['normal']} {dict(bad) or ''})", flush=True)
    summary = []
    for n_hang in counts:
        row = {"hangs": n_hang}
        for label in modes:
            walls = [r["wall_s"] for r in results if r["hangs"] == n_hang and r["mode"] == label]
            row[label] = sum(walls) / len(walls) / args.hang_timeout_s
        row["speed-up"] = row[list(modes)[1]] / row[list(modes)[0]]
        summary.append(row)
    print()
    print(table(summary, [("hangs", "N hanging", "{}"),
                          *((label, f"{label} [limits]", "{:.2f}") for label in modes),
                          ("speed-up", "speed-up", "{:.1f}x")]))
    print(f"\nlimit {args.hang_timeout_s} s, {args.workers} workers, {args.hang_normal} normal (arithmetic) samples; "
          f"mean of {args.repeats} interleaved repeats\nmachine: {info}")
    path = write_json("grading_hangs", {"machine": info, "args": vars(args), "results": results,
                                        "summary": summary}, out_dir=Path(args.out))
    print(f"wrote {path}")


def make_batch(domain: str, n: int, seed: int, split: str = "eval") -> tuple[list[dict], list[str]]:
    from prorl_async.data.datasets import load_rows

    rows = load_rows(f"builtin:{domain}?n={n}&seed={seed}&split={split}")
    responses = []
    for i, r in enumerate(rows):
        right = i % 2 == 0
        if domain == "arithmetic":
            responses.append(f" {r['answer'] if right else int(r['answer']) + 1}\n1+1=2")
        elif domain in ("math", "stem", "logic"):
            wrong = "B" if r.get("choices") and r["answer"] != "B" else "A" if r.get("choices") else "17"
            body = "Let us work through it step by step. " * 8
            responses.append(f"{body}So the final answer is \\boxed{{{r['answer'] if right else wrong}}}.")
        elif domain == "code":
            prog = REFERENCE[r["meta"]["task"]](r["meta"]) if right else "print(0)\n"
            responses.append(f"Here is my solution.\n```python\n{prog}```\n")
        else:
            responses.append(INSTRUCTION_TEXTS[i % len(INSTRUCTION_TEXTS)])
    return rows, responses


def plain_exec_code(rows, responses) -> float:
    """UNSAFE in-process execution of the code responses; returns the number of tests passed."""
    from prorl_async.rewards.code import extract_program, stdout_matches, values_equal

    passed = 0
    for row, resp in zip(rows, responses):
        src = extract_program(resp)
        code = compile(src, "<solution>", "exec")
        for t in row["tests"]:
            out = io.StringIO()
            ns = {"__name__": "solution" if "fn_name" in t else "__main__"}
            old_stdin = sys.stdin
            sys.stdin = io.StringIO(t.get("input", ""))
            try:
                with contextlib.redirect_stdout(out):
                    exec(code, ns)
                    if "fn_name" in t:
                        got = ns[t["fn_name"]](*t["args"])
                        passed += values_equal(list(got) if isinstance(got, tuple) else got, t["expected"])
                        continue
                passed += stdout_matches(out.getvalue(), t["output"])
            except Exception:  # noqa: BLE001 -- a wrong program
                pass
            finally:
                sys.stdin = old_stdin
    return passed


def timed(fn, n) -> dict:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return {"n": n, "seconds": round(dt, 4), "responses_per_s": n / dt}


def main(argv=None):
    args = parse_args(argv)
    from prorl_async.rewards import grade
    from prorl_async.rewards import math as math_verifier
    from prorl_async.rewards.pool import GraderPool
    from prorl_async.rewards.sandbox import isolation_mode

    domains = [d for d in args.domains.split(",") if d]
    info = machine()
    info["sandbox_isolation"] = isolation_mode()
    if args.hangs:
        return bench_hangs(args, info)
    batches = {d: make_batch(d, max(4, int(DEFAULT_N[d] * args.scale)), args.seed) for d in domains}
    if "math" in batches:
        rows, responses = batches["math"]
        pairs = {(str(r["answer"]), s.rsplit("boxed{", 1)[-1]) for r, s in zip(rows, responses)}
        info["math_distinct_gold_answer_pairs"] = f"{len(pairs)} of {len(rows)}"
    results = []

    # warm-ups use train-split rows (the timed rows are eval split, disjoint prompts): the math
    # verifier caches verdicts per (gold, answer), so warming up on the timed rows would flatter it
    warm = {d: make_batch(d, max(4, len(batches[d][0]) // 10), args.seed, "train") for d in domains}
    for d in domains:  # in-process, serial
        rows, responses = batches[d]
        for r, s in zip(*warm[d]):
            grade(r, s)
        math_verifier._equivalent.cache_clear()
        math_verifier._parsed_gold.cache_clear()
        res = timed(lambda: [grade(r, s) for r, s in zip(rows, responses)], len(rows))
        label = "in-process (sandboxed)" if d == "code" else "in-process"
        results.append({"domain": d, "mode": label, **res})
        print(f"{d:12s} {label:32s} {res['responses_per_s']:10.1f} responses/s", flush=True)
        if d == "math":  # the cost of one parse + verify: caches cleared before every sample
            def cold():
                for r, s in zip(rows, responses):
                    math_verifier._equivalent.cache_clear()
                    math_verifier._parsed_gold.cache_clear()
                    grade(r, s)
            res = timed(cold, len(rows))
            label = "in-process, caches cleared per sample"
            results.append({"domain": d, "mode": label, **res})
            print(f"{d:12s} {label:32s} {res['responses_per_s']:10.1f} responses/s", flush=True)
        if d == "math":
            hard = [({"id": f"h{i}", "domain": "math", "prompt": "?", "answer": g}, resp)
                    for i, (g, resp) in enumerate(HARD_MATH * 5)]

            def cold_hard():
                for r, s in hard:
                    math_verifier._equivalent.cache_clear()
                    math_verifier._parsed_gold.cache_clear()
                    grade(r, s)
            res = timed(cold_hard, len(hard))
            label = "in-process, hard forms, caches cleared"
            results.append({"domain": d, "mode": label, **res})
            print(f"{d:12s} {label:32s} {res['responses_per_s']:10.1f} responses/s", flush=True)
        if d == "code":
            plain_exec_code(*warm[d])
            res = timed(lambda: plain_exec_code(rows, responses), len(rows))
            results.append({"domain": d, "mode": "plain exec (UNSAFE, no sandbox)", **res})
            print(f"{d:12s} {'plain exec (UNSAFE, no sandbox)':32s} {res['responses_per_s']:10.1f} responses/s",
                  flush=True)

    with GraderPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        label = f"pool ({args.workers} workers)"
        for d in domains:
            rows, responses = batches[d]
            pool.grade_many(*warm[d])  # warm-up: worker start, first-use imports
            res = timed(lambda: pool.grade_many(rows, responses), len(rows))
            results.append({"domain": d, "mode": label, **res})
            print(f"{d:12s} {label:32s} {res['responses_per_s']:10.1f} responses/s", flush=True)
        mixed_rows, mixed_resp = [], []
        longest = max(len(batches[d][0]) for d in domains)
        for i in range(longest):  # interleave, each domain in proportion to its batch
            for d in domains:
                rows, responses = batches[d]
                if i < len(rows):
                    mixed_rows.append(rows[i])
                    mixed_resp.append(responses[i])
        res = timed(lambda: pool.grade_many(mixed_rows, mixed_resp), len(mixed_rows))
        results.append({"domain": "mixed", "mode": label, **res})
        invalid = pool.metrics()["reward/invalid"]

    print()
    print(table(results, [("domain", "domain", "{}"), ("mode", "mode", "{}"), ("n", "n", "{}"),
                          ("seconds", "s", "{:.2f}"), ("responses_per_s", "responses/s", "{:.1f}")]))
    print(f"\nmachine: {info}\ninvalid grades in the pool: {invalid:.0f}")
    out = Path(args.out)
    path = write_json("grading", {"machine": info, "args": vars(args), "results": results,
                                  "pool_invalid": invalid}, out_dir=out)
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(9, 0.42 * len(results) + 1.2))
    labels = [f"{r['domain']} — {r['mode']}" for r in results]
    colors = ["tab:red" if "UNSAFE" in r["mode"] else "tab:blue" if r["mode"].startswith("pool")
              else "tab:gray" for r in results]
    ax.barh(range(len(results)), [r["responses_per_s"] for r in results], color=colors)
    ax.set_yticks(range(len(results)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("responses / s (log scale)")
    ax.set_title(f"Grading throughput, {info['cores']}-core CPU, {info['date']} "
                 f"(sandbox: {info['sandbox_isolation']})", fontsize=9)
    for i, r in enumerate(results):
        ax.text(r["responses_per_s"], i, f" {r['responses_per_s']:.0f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grading.png", dpi=120)
    print(f"wrote {path} and {out / 'grading.png'}")


if __name__ == "__main__":
    main()
