"""Weight-sync time vs model size: the WeightSyncGroup protocol (gloo here, NCCL on GPU, same
code) from a sender process to a receiver process, next to a bare gloo broadcast of the same
bytes (one collective, no manifest, packing or checks) and this machine's memcpy bandwidth
(torch clone of a large tensor), all in one run.

Random-init Llama tensors of several sizes (labels give the real parameter count: 25M, the
SmolLM2-135M shape, 550M). Modes: ``float32`` and ``bfloat16`` (sent as held) and
``float32->bfloat16`` (an fp32 learner feeding a bf16 engine: cast while packing, bf16 on the
wire; its bare broadcast moves the same bf16 bytes). Each repeat runs protocol and bare
broadcast back to back, both timed on the receiver from a common start (a one-element
broadcast) to the moment its tensors are usable; the best repeat is reported.

    python benchmarks/bench_weight_sync.py                              # 25M,135M,550M, all modes
    python benchmarks/bench_weight_sync.py --sizes 25M --modes float32 --repeats 3 --verify full

Writes benchmarks/out/bench_weight_sync.{json,png} and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import OUT_DIR, machine, plt, table, write_json  # noqa: E402

# name -> (hidden, layers, intermediate, vocab, heads, kv_heads, tied)
SIZES = {"25M": (384, 8, 1024, 32000, 6, 6, True),
         "135M": (576, 30, 1536, 49152, 9, 3, True),  # SmolLM2-135M's shape
         "550M": (1536, 16, 4096, 32000, 24, 24, False)}
MODES = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None),
         "float32->bfloat16": (torch.float32, torch.bfloat16)}


def llama_named(size: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, inter, vocab, heads, kv, tied = SIZES[size]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(n, torch.randn(p.shape).to(dtype)) for n, p in model.named_parameters()]


def _start(g) -> None:
    g._bcast(torch.zeros(1))  # common start for both sides


def _receiver(port: int, runs: int, q) -> None:
    from prorl_async.weight_sync import WeightSyncGroup
    torch.set_num_threads(1)
    g = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=600)
    for _ in range(runs):
        _start(g)
        t0 = time.perf_counter()
        _, got = g.receive()
        proto = time.perf_counter() - t0
        numel, dtype = sum(t.numel() for _, t in got), got[0][1].dtype
        del got
        raw = torch.empty(numel, dtype=dtype)
        _start(g)
        t0 = time.perf_counter()
        g._bcast(raw)  # the bare collective of the same bytes
        q.put((proto, time.perf_counter() - t0))
        del raw
    g.close()


def memcpy_gbps(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = x.clone()
        best = min(best, time.perf_counter() - t0)
        del y
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="25M,135M,550M", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per size and mode (best is reported)")
    ap.add_argument("--verify", default="sampled", choices=["sampled", "full"], help="integrity check")
    args = ap.parse_args()
    sizes, modes = args.sizes.split(","), args.modes.split(",")
    from prorl_async.weight_sync import WeightSyncGroup, free_port

    torch.set_num_threads(1)
    mem = memcpy_gbps()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, len(sizes) * len(modes) * args.repeats, q))
    proc.start()
    g = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=600, verify=args.verify)
    rows = []
    for size in sizes:
        for mode in modes:
            held, wire = MODES[mode]
            named = llama_named(size, held)
            params = sum(t.numel() for _, t in named)
            flat = torch.cat([t.reshape(-1) for _, t in named]).to(wire or held)
            proto, bare, send = float("inf"), float("inf"), float("inf")
            for v in range(args.repeats):
                _start(g)
                info = g.send(named, version=v, wire_dtype=wire)
                _start(g)
                g._bcast(flat)
                p, b = q.get(timeout=600)
                proto, bare, send = min(proto, p), min(bare, b), min(send, info["perf/sync_s"])
            del flat, named
            gb = info["perf/sync_gb"]
            rows.append({"model": f"llama-{size}", "params_m": params / 1e6, "mode": mode, "gb": gb,
                         "sync_s": proto, "send_s": send, "gbps": gb / proto, "raw_s": bare, "raw_gbps": gb / bare,
                         "ratio": proto / bare, "memcpy_gbps": mem})
            print(f"  {size} {mode}: protocol {proto:.2f}s, bare {bare:.2f}s ({proto / bare:.2f}x)", flush=True)
    proc.join(60)
    g.close()
    print(table(rows, [("model", "model", "{}"), ("params_m", "params (M)", "{:.0f}"), ("mode", "dtype", "{}"),
                       ("gb", "GB on wire", "{:.2f}"), ("sync_s", "protocol s", "{:.2f}"), ("gbps", "GB/s", "{:.2f}"),
                       ("raw_s", "bare bcast s", "{:.2f}"), ("raw_gbps", "bare GB/s", "{:.2f}"),
                       ("ratio", "protocol/bare", "{:.2f}"), ("memcpy_gbps", "memcpy GB/s", "{:.1f}")]))
    payload = {"machine": machine(), "backend": "gloo", "verify": args.verify, "memcpy_gbps": mem, "rows": rows}
    print("wrote", write_json("bench_weight_sync", payload))
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        ax.plot([r["params_m"] for r in rs], [r["gbps"] for r in rs], "o-", label=f"WeightSyncGroup {mode}")
        ax.plot([r["params_m"] for r in rs], [r["raw_gbps"] for r in rs], "x:", label=f"bare gloo broadcast {mode}")
    ax.axhline(mem, color="gray", ls="--", label=f"memcpy {mem:.1f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GB/s")
    ax.set_title("weight sync between two processes (gloo, CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT_DIR / "bench_weight_sync.png", dpi=120)


if __name__ == "__main__":
    main()
