"""Weight-sync time and GB/s vs model size: WeightSyncGroup broadcast (gloo here, NCCL on GPU,
same code) from a sender process to a receiver process, for random-init Llama models of
several sizes, next to this machine's memcpy bandwidth (torch clone of a large tensor).

    python benchmarks/bench_weight_sync.py                  # default sizes, fp32 and bf16
    python benchmarks/bench_weight_sync.py --sizes 25M,100M --dtypes float32 --repeats 3

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

# (hidden, layers, intermediate, vocab) -> roughly the named parameter count
SIZES = {"25M": (512, 6, 1536, 32000), "100M": (768, 12, 2304, 32000), "250M": (1024, 16, 3072, 32000),
         "500M": (1536, 16, 4096, 32000), "1B": (2048, 18, 5632, 32000)}


def llama_named(size: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab,
                      num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 64),
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(n, torch.randn(p.shape).to(dtype)) for n, p in model.named_parameters()]


def _receiver(port: int, sizes: list, dtypes: list, repeats: int, q) -> None:
    from prorl_async.weight_sync import WeightSyncGroup
    torch.set_num_threads(1)
    g = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=600)
    for _ in sizes:
        for _ in dtypes:
            for _ in range(repeats):
                t0 = time.perf_counter()
                _, got = g.receive()
                q.put(time.perf_counter() - t0)
                raw = torch.empty(sum(t.numel() for _, t in got), dtype=got[0][1].dtype)
                del got
                g._bcast(raw)  # the bare collective, no packing or checksums
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
    ap.add_argument("--sizes", default="25M,100M,250M,500M,1B", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=2, help="syncs per size and dtype (best is reported)")
    args = ap.parse_args()
    sizes, dtypes = args.sizes.split(","), args.dtypes.split(",")
    from prorl_async.weight_sync import WeightSyncGroup, free_port

    torch.set_num_threads(1)
    mem = memcpy_gbps()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, sizes, dtypes, args.repeats, q))
    proc.start()
    g = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=600)
    rows = []
    for size in sizes:
        for dt in dtypes:
            named = llama_named(size, getattr(torch, dt))
            params = sum(t.numel() for _, t in named)
            best_send, best_recv, best_raw = float("inf"), float("inf"), float("inf")
            flat = torch.cat([t.reshape(-1) for _, t in named])
            for v in range(args.repeats):
                info = g.send(named, version=v)
                best_send = min(best_send, info["perf/sync_s"])
                best_recv = min(best_recv, q.get(timeout=600))
                t0 = time.perf_counter()
                g._bcast(flat)
                best_raw = min(best_raw, time.perf_counter() - t0)
            del flat
            gb = info["perf/sync_gb"]
            rows.append({"model": f"llama-{size}", "params_m": params / 1e6, "dtype": dt, "gb": gb,
                         "sync_s": best_send, "recv_s": best_recv, "gbps": gb / best_send,
                         "raw_s": best_raw, "raw_gbps": gb / best_raw,
                         "memcpy_gbps": mem})
            print(f"  {size} {dt}: {best_send:.2f}s {gb / best_send:.2f} GB/s (bare {gb / best_raw:.2f} GB/s)", flush=True)
            del named
    proc.join(60)
    g.close()
    print(table(rows, [("model", "model", "{}"), ("params_m", "params (M)", "{:.0f}"), ("dtype", "dtype", "{}"),
                       ("gb", "GB", "{:.2f}"), ("sync_s", "sync s", "{:.2f}"), ("gbps", "GB/s", "{:.2f}"),
                       ("raw_s", "bare bcast s", "{:.2f}"), ("raw_gbps", "bare GB/s", "{:.2f}"),
                       ("memcpy_gbps", "memcpy GB/s", "{:.1f}")]))
    payload = {"machine": machine(), "backend": "gloo", "memcpy_gbps": mem, "rows": rows}
    print("wrote", write_json("bench_weight_sync", payload))
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    for dt in dtypes:
        rs = [r for r in rows if r["dtype"] == dt]
        ax.plot([r["params_m"] for r in rs], [r["gbps"] for r in rs], "o-", label=f"WeightSyncGroup {dt}")
        ax.plot([r["params_m"] for r in rs], [r["raw_gbps"] for r in rs], "x:", label=f"bare gloo broadcast {dt}")
    ax.axhline(mem, color="gray", ls="--", label=f"memcpy {mem:.1f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GB/s")
    ax.set_title("weight sync between two processes (gloo, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT_DIR / "bench_weight_sync.png", dpi=120)


if __name__ == "__main__":
    main()
