"""Helpers shared by the benchmark scripts: machine description, output paths, tables."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

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
