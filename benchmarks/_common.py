"""Helpers shared by the benchmark scripts: machine description, output paths, tables, the
argument parser, a memcpy reference and a local Ray cluster.

A script runs as ``python benchmarks/<script>.py`` (also under ``prorl-async bench``), so its own
folder is ``sys.path[0]`` and ``from _common import ...`` finds this module; importing it puts
the checkout's root on ``sys.path`` too, so the scripts import ``prorl_async`` and ``actors``
from the same checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages before any other on the path

# $PRORL_BENCH_OUT (set by ``prorl-async bench --out DIR``) redirects every script's JSON/PNG
OUT_DIR = Path(os.environ.get("PRORL_BENCH_OUT") or Path(__file__).resolve().parent / "out")


def machine() -> dict:
    """What the numbers were measured on (CPU model, cores, memory, torch/threads)."""
    cpu, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line
    except OSError:
        pass
    mem_gb = 0.0
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gb, 1),
           "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        out["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return out


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """``cols`` = [(key, header, format)], e.g. ("tok_s", "tok/s", "{:.0f}")."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = []
        for k, _, fmt in cols:
            v = r.get(k)
            line.append("-" if v is None else (fmt.format(v) if isinstance(v, (int, float)) else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(name: str, payload: dict, out_dir: Path = OUT_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / f"{name}.json"
    p.write_text(json.dumps(payload, indent=2, default=float))
    return p


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring as description, defaults in --help."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """Single-threaded ``numpy.copyto`` of ``nbytes``: bytes copied per second (each read once and
    written once), best of ``reps``, after one copy that faults the pages in."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def start_ray(**init) -> str:
    """A local Ray cluster owned by this process: its own temp dir (returned; remove it after
    ``ray.shutdown()``), a fresh auth token in this environment only, the checkout on the
    workers' PYTHONPATH. ``init``: more ``ray.init`` arguments (``num_cpus``, ``object_store_memory``)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # before ray is imported: it caches the mode
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    import ray

    tmp = tempfile.mkdtemp(prefix="prorl-bench-ray-", dir="/tmp")
    ray.init(include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, **init)
    return tmp


def matmul_peak(n: int, dtype, reps: int = 5, device: str = "cpu") -> float:
    """Best FLOP/s of torch.mm on n x n random matrices (on a GPU: synchronized around each product).
    bf16 on a CPU without AVX-512-bf16 / AMX (about 1 GFLOP/s: a 3072^3 product takes a minute) is
    measured at n <= 512."""
    import torch

    from prorl_async.machine import cpu_has_bf16

    if device == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16():
        n = min(n, 512)

    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (oneDNN/AMX kernel selection, cuBLAS handle)
    sync_device(device)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync_device(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def sync_device(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
