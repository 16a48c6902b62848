"""``prorl-async eval``: pass@1 and pass@k of a model on a dataset, no training (issue 13).

The same generators and grader as a training run's held-out evaluation
(:func:`actors.evaluation.evaluate`): ``--samples`` samples per prompt from the configured
engine at ``train.eval_temperature`` (when set; else ``rollout.temperature``), graded by the domain verifiers; pass@1 is the mean
correctness over the samples of a prompt, pass@k whether any of them is correct
(:func:`prorl_async.metrics.pass_at_k`); beside them, where the rows have answers, what the
answers alone score (``prior@1`` / ``prior@k``, :func:`prorl_async.metrics.answer_prior`), and one
standard error of each pass@ over the prompts (``se@1`` / ``se@k``). ``--out`` keeps each prompt's
outcome too (``outcomes``: prompt id -> [domain, correct, samples]), so that two checkpoints
evaluated on the same ``--data`` compare prompt by prompt (``scripts/eval_diff.py``). Only generators and the grader are started (no
learner, no buffer, no weight sync); an Aim run only with ``--aim``. The console holds only the
project's lines, as a training run's (:mod:`prorl_async.console`): the actors' output goes to
``<out>-logs/`` beside ``--out``, named on the last line; without ``--out`` to a temporary folder,
removed after a good evaluation and named on stderr after a failed one that started actors.
``--verbose`` streams it to the console instead.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ray

from prorl_async.checkpoint import policy_folder
from prorl_async.config import Config, config_to_dict
from prorl_async.console import ActorWarnings, quiet_driver, verbose
from prorl_async.data.datasets import load_source
from prorl_async.engines.prompts import drop_unfit
from prorl_async.metrics import PromptOutcome, answer_prior, pass_at_k_stderr
from prorl_async.models import BUILTIN_PREFIX, context_length, load_tokenizer, resolve_model_path
from prorl_async.tracking import Tracker

from actors.cluster import Actors, generator_placement, get, grader_options, init_ray
from actors.evaluation import evaluate
from actors.generator import GeneratorActor
from actors.grader import GraderActor


def model_override(model: str) -> str:
    """``model.path=...`` for MODEL: a ``builtin:`` name, an HF folder, a checkpoint or a run directory."""
    return f"model.path={model if model.startswith(BUILTIN_PREFIX) else policy_folder(model)}"


def report(result: dict, k: int) -> str:
    """pass@1 and pass@k per domain (``all`` first), one row each, with one standard error of each
    over the prompts (``se@1`` / ``se@k``, :func:`prorl_async.metrics.pass_at_k_stderr`) and the
    rows' ``prior@1`` / ``prior@k`` (:func:`prorl_async.metrics.answer_prior`) beside them when the
    data has answers."""
    domains = ["all"] + sorted({key.split("/", 1)[1] for key in result if key.startswith("pass@1/")})
    w = max(16, *(len(d) + 2 for d in domains))
    cols = (["pass@1", f"pass@{k}", "se@1", f"se@{k}"][:3 + (k > 1)]
            + (["prior@1", f"prior@{k}"][:1 + (k > 1)] if "prior@1" in result else []))
    rows = ["".join([f"{'domain':<{w}}", *(f"{c:>10}" for c in cols)])]
    for d in domains:
        suffix = "" if d == "all" else f"/{d}"
        cells = [result.get(f"{c}{suffix}") for c in cols]
        rows.append("".join([f"{d:<{w}}", *(f"{'-' if v is None else f'{v:.3f}':>10}" for v in cells)]))
    rows.append("se@: one standard error over the prompts (the choice of prompts and samples; a second "
                "training run adds its own spread); two checkpoints on the same --data: scripts/eval_diff.py")
    if "prior@1" in result:
        rows.append("prior@: what the answers alone score, no model (prior@1: always the most common of the "
                    "other prompts' answers; prior@k: k guesses drawn from them); a pass@ near it is no sign of skill")
    return "\n".join(rows)


def run_eval(cfg: Config, data: str, samples: int, out: str = "", aim: bool = False) -> dict:
    """Evaluate ``cfg.model.path`` on ``data``; prints the table, writes ``out`` (JSON) if given."""
    t0 = time.time()
    log_dir = Path(f"{Path(out).with_suffix('')}-logs").resolve() if out else Path(tempfile.mkdtemp(prefix="prorl-eval-logs-"))
    restore = quiet_driver(log_dir)  # other packages' warnings and log records to log_dir/driver.log
    ok = False
    try:
        result = _run_eval(cfg, data, samples, out, aim, log_dir, t0)
        ok = True
        return result
    finally:
        restore()
        if not out:  # a temporary folder: kept (and named) only after a failure with actors' output in it
            if ok or verbose() or not any(p.name != "driver.log" for p in log_dir.iterdir()):
                shutil.rmtree(log_dir, ignore_errors=True)  # a bad argument fails before any actor starts
            else:
                print(f"actors' output: {log_dir}", file=sys.stderr, flush=True)


def _run_eval(cfg: Config, data: str, samples: int, out: str, aim: bool, log_dir: Path, t0: float) -> dict:
    model_path = resolve_model_path(cfg.model, seed=cfg.train.seed)
    for module in cfg.reward.extra_modules:  # custom verifiers register their domains on import
        importlib.import_module(module)
    rows = load_source(data, cfg.data)
    if not rows:
        raise ValueError(f"--data {data}: no rows")
    rows, dropped = drop_unfit(rows, load_tokenizer(model_path), context_length(model_path), cfg.rollout.max_new_tokens,
                               f"--data {data}", strict=cfg.data.strict)
    started = init_ray(cfg, log_dir=log_dir)  # the actors' output to log_dir/<role>.log
    actors, tracker, held = None, Tracker(cfg.tracking.aim_repo, cfg.tracking.experiment, cfg.tracking.run_name or "eval",
                                    config_to_dict(cfg), enabled=aim), ActorWarnings()
    try:
        placed = [generator_placement(cfg, i) for i in range(cfg.rollout.num_generators)]
        gens = [GeneratorActor.options(**opts).remote(cfg, model_path, i) for i, (opts, _) in enumerate(placed)]
        actors = Actors(gens, GraderActor.options(**grader_options(cfg)).remote(cfg), None, None,
                        [pg for _, pg in placed if pg is not None])
        get([g.ready.remote() for g in gens] + [actors.grader.ready.remote()], 600, "starting the actors")
        outcomes: dict[str, PromptOutcome] = {}
        val = evaluate(cfg, actors, rows, 0, tracker, show=True, samples=samples, outcomes=outcomes)
        for line in held.poll(actors.all(), wait_s=5.0):  # the project's warnings raised in the actors
            print(line, file=sys.stderr, flush=True)
    finally:
        tracker.close()
        if actors is not None:
            actors.shutdown()
        if started:
            ray.shutdown()
    result = {key.split("/", 1)[1]: v for key, v in val.items()}  # val/pass@1/math -> pass@1/math
    result.update(pass_at_k_stderr(outcomes, samples))
    result.update(answer_prior(rows, samples))
    result.update({"model": cfg.model.path, "data": data, "prompts": len(rows), "prompts_dropped": dropped,
                   "samples": samples,
                   "wall_time_s": time.time() - t0, "aim_run_hash": tracker.hash,
                   "outcomes": {pid: list(o) for pid, o in outcomes.items()}})
    print(report(result, samples), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}", flush=True)
    if out and not verbose():
        print(f"actors' output: {log_dir}", flush=True)
    return result
