"""``prorl-async``: train | eval | config | compare | bench | replay | ledger (the command-line entry point, above the Ray layer).

    prorl-async train                                   # the embedded default (tiny CPU run)
    prorl-async train --config configs/x.yaml algo.clip_eps_high=0.28 rollout.n=8
    prorl-async train --resume runs/x train.total_steps=400   # continue from its newest checkpoint
    prorl-async train --verbose                         # engines', DeepSpeed's and Ray's lines on the console too
    prorl-async eval --model runs/x --data builtin:humaneval --samples 4 --out r.json   # pass@1 / pass@k, no training
    prorl-async config [--config X] [overrides]         # print the resolved config / field docs
    prorl-async compare runs/a runs/b --out cmp.png     # runs side by side (run dirs or Aim hashes)
    prorl-async bench --quick [--only weight_sync,buffer] [--out DIR]   # the benchmarks' ratio table
    prorl-async replay runs/x --step 42                 # recompute step 42's loss, KL, grad norm from the ledger
    prorl-async ledger runs/x --reset 2 --top 10        # the samples that drove the KL before reset 2

The console holds the project's lines only; what the engines, DeepSpeed, torch and Ray print goes to
``<run_dir>/logs/`` (:mod:`prorl_async.console`) unless ``--verbose``.

Errors a user can fix (a bad config value, a missing file, a malformed dataset) are printed
as one ``error:`` line and exit with status 2, never as a traceback from inside Ray.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from prorl_async.config import ConfigError, config_to_dict, describe, load_config
from prorl_async.console import VERBOSE_ENV


def _resume(args):
    """``--resume RUN_DIR``: the run's newest checkpoint and its config plus the overrides."""
    from prorl_async.checkpoint import CheckpointError, load_latest, resume_config

    if args.config:
        raise CheckpointError("--resume uses the run's own config.yaml; pass only overrides, not --config")
    ckpt = load_latest(args.resume)
    cfg = resume_config(ckpt, args.resume, args.overrides)
    if ckpt.step >= cfg.train.total_steps:
        raise CheckpointError(f"{args.resume} is at step {ckpt.step} already (train.total_steps={cfg.train.total_steps}); "
                              f"pass train.total_steps=<more> to continue")
    return cfg, ckpt


def _train(args) -> int:
    cfg, resume = _resume(args) if args.resume else (load_config(args.config, args.overrides), None)
    from actors.driver import RunError, run  # Ray is imported only when a run starts
    from actors.stopping import Stopped, Terminated, raise_if_terminated, sigterm_stops_at_once

    try:
        with sigterm_stops_at_once():  # the loop itself stops after what is in flight, with a checkpoint
            summary = run(cfg, resume=resume)
            raise_if_terminated()  # one whose exception Ray's C code lost after the last wait
    except RunError as e:  # a run that had to stop: one line, the checkpoint (if any) is intact
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (Stopped, Terminated) as e:  # SIGTERM: 128 + the signal's number, as a shell reports it
        print(str(e), file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:  # SIGTERM inside Ray's C code (a ray.get) comes back as a SystemError caused by it
        if (t := _caused_by(e, Terminated)) is None:
            raise
        print(str(t), file=sys.stderr)
        return 128 + signal.SIGTERM
    return 0 if summary else 1


def _caused_by(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of ``kind`` in ``e``'s chain of causes and contexts, or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _eval(args) -> int:
    from actors.offline_eval import model_override, run_eval  # Ray is imported only when a run starts

    if args.samples < 1 or args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError("--samples and --max-new-tokens must be >= 1")
    extra = [model_override(args.model), f"data.eval={args.data}"]
    if args.max_new_tokens:
        extra.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    cfg = load_config(args.config, [*args.overrides, *extra])
    from actors.cluster import RunError
    from actors.stopping import Terminated, raise_if_terminated, sigterm_stops_at_once

    try:
        with sigterm_stops_at_once():  # its actors and the Ray it started shut down, as a run's before step 1
            run_eval(cfg, args.data, args.samples, out=args.out, aim=args.aim)
            raise_if_terminated()
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated as t:
        return _eval_stopped(t, args.out)
    except Exception as e:  # SIGTERM inside Ray's C code (a ray.get) comes back as a SystemError caused by it
        if (t := _caused_by(e, Terminated)) is None:
            raise
        return _eval_stopped(t, args.out)
    return 0


def _eval_stopped(t: BaseException, out: str) -> int:
    """One line for an evaluation stopped by SIGTERM, and the status a shell reports for it."""
    name = getattr(t, "signal_name", "SIGTERM")
    wrote = f"{out} not written" if out else "nothing written"
    print(f"stopped by {name} during the evaluation: {wrote}; run it again to evaluate", file=sys.stderr)
    return 128 + signal.SIGTERM


def _config(args) -> int:
    import yaml

    if args.docs:
        print("\n".join(describe()))
        return 0
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def _compare(args) -> int:
    from prorl_async.compare import compare

    print(compare(args.runs, repo=args.repo, out=args.out))
    return 0


def _bench(args) -> int:
    from actors.bench import run_bench

    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return run_bench(args.quick, only=args.only, out=args.out, timeout=args.timeout, bench_dir=args.bench_dir)


def _replay(args) -> int:
    from prorl_async.replay import dump_json, replay, step_range

    result = replay(args.run_dir, args.step)
    print(result.table())
    if result.reapplied:
        print(f"re-applied {step_range(result.reapplied[0], result.reapplied[-1])}: largest relative difference to "
              f"their logged metrics {result.worst_reapplied:.2e}")
    if args.out:
        dump_json(result, args.out)
    if result.ok(args.rtol):
        print(f"step {result.step} reproduced (relative tolerance {args.rtol:g})")
        return 0
    print(f"error: step {result.step} differs from the logged values by more than the relative tolerance {args.rtol:g}",
          file=sys.stderr)
    return 1


def _ledger(args) -> int:
    from prorl_async.ledger import RANKINGS, read_step, top_samples
    from prorl_async.replay import read_run_history, reset_step

    if (args.step is None) == (args.reset is None):
        raise ValueError("pass exactly one of --step N or --reset R")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.reset is not None:
        step, cause = reset_step(args.run_dir, args.reset)
        head = f"reset {args.reset} ({cause}) came after step {step}"
    else:
        step, head = args.step, f"step {args.step}"
    rows, _ = read_step(args.run_dir, step)
    logged = read_run_history(Path(args.run_dir)).get(step, {})
    kl = logged.get("kl/loss_term")
    print(f"{head}: {rows.num_rows} samples trained" + (f", kl/loss_term {kl:.4g}" if kl is not None else "")
          + f"; top {args.top} by {RANKINGS[args.by]}")
    print(f"{'share':>7} {'score':>10}  {'version':>7} {'len':>4} {'reward':>6}  {'verdict':<8} {'sample_id':<28} response")
    for r in top_samples(rows, args.by, args.top):
        text = (r["response_text"] or "").replace("\n", " ")[:60]
        print(f"{r['share']:>7.1%} {r['score']:>10.4g}  {r['policy_version']:>7} {r['response_len']:>4} "
              f"{r['raw_reward']:>6.2f}  {r['verdict']:<8} {r['sample_id']:<28} {text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-async", description="ProRL v2 asynchronous RL on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run training (default: the embedded tiny CPU run)")
    t.add_argument("--config", help="YAML config file (see configs/)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint (overrides: "
                   "only fields that do not change the math or data, e.g. train.total_steps)")
    t.add_argument("--verbose", action="store_true", help="also show what the engines, DeepSpeed, torch and Ray "
                   "print (default: only the project's lines; the rest is in <run_dir>/logs/)")
    t.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. rollout.n=8")
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="pass@1 / pass@k of a model on a dataset, per domain (no training)")
    e.add_argument("--model", required=True, help="HF folder, builtin:tiny-arith, a run directory or a checkpoint")
    e.add_argument("--data", required=True, help="any source data.eval accepts (file, builtin:...)")
    e.add_argument("--samples", type=int, default=4, help="samples per prompt: pass@1 is their mean, pass@K any")
    e.add_argument("--max-new-tokens", type=int, default=None, help="response length (default: rollout.max_new_tokens)")
    e.add_argument("--out", default="", help="write the results as JSON (keys pass@1, pass@1/<domain>, pass@K, se@1 ..., and outcomes: "
                   "each prompt's [domain, correct, samples], for scripts/eval_diff.py)")
    e.add_argument("--aim", action="store_true", help="also log to an Aim run (tracking.aim_repo)")
    e.add_argument("--verbose", action="store_true", help="also show what the engines, torch and Ray print "
                   "(default: only the project's lines; the rest is in <out>-logs/, or in a temporary folder kept only "
                   "if the evaluation fails)")
    e.add_argument("--config", help="YAML config: engine, sampling, grader settings")
    e.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. rollout.temperature=0.6")
    e.set_defaults(fn=_eval)
    c = sub.add_parser("config", help="print the resolved config, or --docs for every field")
    c.add_argument("--config")
    c.add_argument("--docs", action="store_true", help="list every field with its default and doc")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=_config)
    m = sub.add_parser("compare", help="side-by-side table and curves of runs (run dirs or Aim hashes)")
    m.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_HASH")
    m.add_argument("--repo", default="runs", help="Aim repo folder for hashes (default: runs)")
    m.add_argument("--out", default="compare.png", help="PNG of reward, accuracy, KL and length vs step and wall time")
    m.set_defaults(fn=_compare)
    b = sub.add_parser("bench", help="run benchmarks/ scripts and print the table of issue 14's ratios")
    b.add_argument("--quick", action="store_true", help="weight sync at 135M, the learner at 6M, buffer -> "
                   "learner at the issue's batch: under a minute on an idle 2-core CPU; vLLM and training-run ratios "
                   "are full mode only (default: each script's own defaults, much longer)")
    b.add_argument("--only", default="", help="comma list of weight_sync, learner, learner_packing, learner_smollm2, "
                   "generation, buffer, rollout_transport, e2e (default: all)")
    b.add_argument("--out", default="", help="folder for the scripts' JSON/PNG, logs and bench_summary.json "
                   "(default: benchmarks/out/quick with --quick, else benchmarks/out)")
    b.add_argument("--timeout", type=float, default=None, help="seconds per script before it is killed and "
                   "reported as failed (default: 300 with --quick, none otherwise)")
    b.add_argument("--bench-dir", default="", help="the benchmarks/ folder (default: the one next to this package)")
    b.set_defaults(fn=_bench)
    r = sub.add_parser("replay", help="recompute a step's loss, KL and gradient norm from the checkpoint before it and "
                       "the ledger, and compare them with the logged values")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument("--step", type=int, required=True, help="history step N (the update that made policy version N)")
    r.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance of the comparison (default 1e-6: "
                   "exact on CPU fp32; 1e-3 where kernels are not deterministic)")
    r.add_argument("--out", default="", help="also write the comparison as JSON")
    r.set_defaults(fn=_replay)
    g = sub.add_parser("ledger", help="the samples of one trained step that weigh most (KL, advantage, importance "
                       "weight, mismatch), from the ledger")
    g.add_argument("run_dir", metavar="RUN_DIR")
    g.add_argument("--step", type=int, default=None, help="history step N")
    g.add_argument("--reset", type=int, default=None, help="the step whose update was followed by the R-th reference reset")
    g.add_argument("--top", type=int, default=10, help="samples shown (default 10)")
    g.add_argument("--by", default="kl", choices=("kl", "advantage", "is_weight", "mismatch"),
                   help="ranking (default kl: each sample's KL to the reference summed over its tokens)")
    g.set_defaults(fn=_ledger)
    return p


USER_ERRORS = (ConfigError, FileNotFoundError, ValueError)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # read by the driver and, inherited, by the actors
        os.environ[VERBOSE_ENV] = "1"
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; actors shut down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
