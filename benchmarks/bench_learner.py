"""Learner throughput: TorchLearner.train_step tokens/s and achieved FLOP/s vs measured matmul peak.

For each model size (the built-in tiny model, a mid-size and a ~50M-parameter Llama built
locally with random weights and the project's character tokenizer) and each precision (fp32,
bf16 autocast), times ``TorchLearner.train_step`` — the full ProRL v2 update: reward shaping,
advantages, reference forward for the KL penalty, policy forward + backward, AdamW — on a
synthetic rollout batch of uniform length (no padding), after one warm-up step.

FLOP accounting (stated, not measured):

    model FLOPs per step = 6 * N * T        (policy forward 2NT + backward 4NT)
    with the reference forward (kl_coef > 0): 8 * N * T

``N`` = all parameters (embeddings are negligible with a 21-token vocabulary; tied lm_head),
``T`` = tokens in the batch (prompt + response of every row); attention-score FLOPs
(~12 * layers * hidden * S^2 per sequence) are left out, as in the usual MFU convention.
The peak is measured in the same run: ``torch.mm`` of two n x n matrices (2 n^3 FLOPs) in fp32
and bf16, best of several, with the same thread count. Achieved / peak is reported against the
peak of the precision the matmuls run in (fp32 peak for fp32, bf16 peak for bf16 autocast).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import OUT_DIR, machine, plt, table, write_json  # noqa: E402

# name -> (hidden, layers, intermediate, heads); "builtin" is the built-in model's shape (models._tiny_config)
SIZES = {
    "tiny-0.4M": (128, 2, 384, 4),
    "small-6M": (320, 5, 864, 5),
    "llama-50M": (640, 10, 1728, 10),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    p.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 (autocast)")
    p.add_argument("--rows", type=int, default=32, help="responses per batch (4 prompts x n=8)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--response-len", type=int, default=96, help="response tokens per row")
    p.add_argument("--micro-batch", type=int, default=16, help="train.micro_batch_size")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--peak-n", type=int, default=3072, help="square matmul size for the peak")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    return p.parse_args(argv)


def matmul_peak(n: int, dtype, reps: int = 5) -> float:
    """Best FLOP/s of torch.mm on n x n matrices."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up (oneDNN/AMX kernel selection)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def build_model_dir(name: str, work: Path, max_len: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from prorl_async.models import build_char_tokenizer

    hidden, layers, inter, heads = SIZES[name]
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = work / name
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def synthetic_batch(rows: int, n: int, plen: int, rlen: int, vocab: int, seed: int = 0):
    """A graded rollout batch in the rollout schema; rewards vary within every group."""
    import random

    from prorl_async.data.schema import rollout_batch

    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids", "behavior_logprobs",
                            "policy_version", "finish_reason", "raw_reward", "reward_valid",
                            "gen_time_s", "grade_time_s", "response_text", "grade_reason", "request_id")}
    for i in range(rows):
        g = i // n
        r = float(i % 2)  # half right, half wrong in each group
        cols["sample_id"].append(f"s{i}")
        cols["prompt_id"].append(f"p{g}")
        cols["domain"].append("arithmetic")
        cols["prompt_ids"].append([1] + [rng.randrange(4, vocab) for _ in range(plen - 1)])
        cols["response_ids"].append([rng.randrange(4, vocab) for _ in range(rlen - 1)] + [2])
        cols["behavior_logprobs"].append([-3.0] * rlen)
        cols["policy_version"].append(0)
        cols["finish_reason"].append("stop")
        cols["raw_reward"].append(r)
        cols["reward_valid"].append(True)
        cols["gen_time_s"].append(0.0)
        cols["grade_time_s"].append(0.0)
        cols["response_text"].append("")
        cols["grade_reason"].append("correct" if r else "wrong")
        cols["request_id"].append("bench")
    import pyarrow as pa
    return pa.Table.from_batches([rollout_batch(cols)])


def bench_one(model_dir: str, precision: str, args, table_) -> dict:
    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.torch_learner import TorchLearner

    n = 8
    cfg = load_config(None, [f"model.path={model_dir}", f"model.autocast_bf16={precision == 'bf16'}",
                             f"train.prompts_per_step={args.rows // n}", f"rollout.n={n}",
                             f"train.micro_batch_size={args.micro_batch}",
                             f"rollout.max_new_tokens={args.response_len}"])
    learner = TorchLearner(cfg, model_dir)
    if (precision == "bf16") != learner.autocast:
        raise RuntimeError(f"bf16 autocast requested={precision == 'bf16'} but the learner uses {learner.autocast}")
    params = sum(p.numel() for p in learner.model.parameters())
    learner.train_step(table_)  # warm-up
    times, toks = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = learner.train_step(table_)
        times.append(time.perf_counter() - t0)
        toks.append(m["perf/train_tok_s"] * m["perf/train_s"])
    dt = statistics.median(times)
    tokens = toks[0]
    del learner
    torch.set_num_threads(torch.get_num_threads())
    return {"params": params, "precision": precision, "tokens": tokens, "step_s": dt,
            "tok_s": tokens / dt, "flops_6nt": 6 * params * tokens / dt, "flops_8nt": 8 * params * tokens / dt}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sizes = args.sizes.split(",")
    precisions = args.precisions.split(",")
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-learner-"))
    seq = args.prompt_len + args.response_len
    peaks = {"fp32": matmul_peak(args.peak_n, torch.float32), "bf16": matmul_peak(args.peak_n, torch.bfloat16)}
    print(f"matmul peak ({threads} threads, n={args.peak_n}): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s", flush=True)
    rows = []
    from prorl_async.models import build_char_tokenizer
    vocab = len(build_char_tokenizer())
    batch = synthetic_batch(args.rows, 8, args.prompt_len, args.response_len, vocab)
    for size in sizes:
        model_dir = build_model_dir(size, work, max_len=max(64, seq))
        for prec in precisions:
            r = bench_one(model_dir, prec, args, batch)
            r["model"] = size
            rows.append(r)
            print(f"  {size:<10} {prec}: {r['tok_s']:.0f} tok/s, {r['flops_6nt'] / 1e9:.1f} GFLOP/s", flush=True)
    # the peak again at the end: the machine is shared, keep the better of the two measurements
    for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[k] = max(peaks[k], matmul_peak(args.peak_n, dt))
    for r in rows:
        r["peak"] = peaks[r["precision"]]
        r["frac_peak_6nt"] = r["flops_6nt"] / r["peak"]
        r["frac_peak_8nt"] = r["flops_8nt"] / r["peak"]
        r["gflops_6nt"], r["gflops_8nt"], r["peak_gflops"] = r["flops_6nt"] / 1e9, r["flops_8nt"] / 1e9, r["peak"] / 1e9
        r["params_m"] = r["params"] / 1e6
    print()
    print(table(rows, [("model", "model", "{}"), ("params_m", "params (M)", "{:.2f}"), ("precision", "prec", "{}"),
                       ("tokens", "tokens/step", "{:.0f}"), ("step_s", "step s", "{:.2f}"), ("tok_s", "tok/s", "{:.0f}"),
                       ("gflops_6nt", "GFLOP/s (6NT)", "{:.1f}"), ("gflops_8nt", "GFLOP/s (8NT)", "{:.1f}"),
                       ("peak_gflops", "peak GFLOP/s", "{:.0f}"), ("frac_peak_6nt", "6NT/peak", "{:.1%}"),
                       ("frac_peak_8nt", "8NT/peak", "{:.1%}")]))
    print(f"\n(machine: {machine()['cpu']}, {threads} torch threads; batch {args.rows} rows x "
          f"{seq} tokens; 6NT = policy fwd+bwd, 8NT adds the reference forward)")
    payload = {"benchmark": "learner", "machine": machine(), "threads": threads,
               "args": {**vars(args), "out": str(args.out)},
               "peak_flops": peaks, "formula": "model FLOPs = 6*N*T (policy fwd+bwd); 8*N*T with reference forward",
               "results": rows}
    path = write_json("bench_learner", payload, args.out)
    plot(rows, peaks, args.out / "bench_learner.png", threads)
    print(f"wrote {path} and {args.out / 'bench_learner.png'}")
    return payload


def plot(rows, peaks, path, threads):
    pyplot = plt()
    fig, ax = pyplot.subplots(1, 2, figsize=(12, 4.5))
    models = list(dict.fromkeys(r["model"] for r in rows))
    precs = list(dict.fromkeys(r["precision"] for r in rows))
    w = 0.8 / len(precs)
    for j, p in enumerate(precs):
        xs = [i + (j - (len(precs) - 1) / 2) * w for i in range(len(models))]
        get = {r["model"]: r for r in rows if r["precision"] == p}
        ax[0].bar(xs, [get[m]["tok_s"] for m in models], width=w, label=p, color=f"C{j}")
        ax[1].bar(xs, [get[m]["gflops_6nt"] for m in models], width=w, label=f"{p} achieved (6NT)", color=f"C{j}")
        ax[1].axhline(peaks[p] / 1e9, ls="--", color=f"C{j}", label=f"{p} torch.mm peak")
    for a in ax:
        a.set_xticks(range(len(models)), models)
        a.legend(fontsize=8)
    ax[0].set(ylabel="tokens/s", title="TorchLearner.train_step tokens/s", yscale="log")
    ax[1].set(ylabel="GFLOP/s", title="achieved model FLOP/s vs measured matmul peak")
    fig.suptitle(f"learner on {machine()['cpu']}, {threads} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
