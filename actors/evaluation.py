"""Held-out evaluation through the same generators and grader as the rollouts.

``val/pass@1`` is the mean correctness over ``train.eval_samples`` samples per prompt and
``val/pass@k`` whether any of them is correct (:func:`prorl_async.metrics.pass_at_k`);
``val/greedy/pass@1`` one greedy sample per prompt. The samples are drawn at
``train.eval_temperature`` (when set; else ``rollout.temperature``, the rollouts'). The seeds
are the same at every evaluation, so before/after differences come from the weights, not the draws.
"""

from __future__ import annotations

import ray

from prorl_async.algo.sampling import DEFAULT_TOL, group_counts
from prorl_async.config import Config
from prorl_async.metrics import PromptOutcome, pass_at_k, prompt_outcomes
from prorl_async.console import bar
from prorl_async.tracking import Tracker

from actors.cluster import Actors
from actors.stopping import raise_if_terminated


class StaleWeights(RuntimeError):
    """An evaluation sample came from weights other than the step's (a generator restarted since its sync)."""


def evaluate(cfg: Config, actors: Actors, rows: list[dict], step: int, tracker: Tracker, greedy: bool = False,
             show: bool = False, samples: int = 0, outcomes: dict[str, PromptOutcome] | None = None) -> dict:
    """Held-out pass@1 (mean over samples) and pass@k, overall and per domain; ``show``: a
    progress bar; ``samples``: per prompt, instead of ``train.eval_samples``; ``outcomes``: filled
    with each prompt's :class:`~prorl_async.metrics.PromptOutcome` (what ``prorl-async eval --out`` keeps)."""
    n, chunk = (1 if greedy else samples or cfg.train.eval_samples), cfg.rollout.prompts_per_request
    refs = []
    for i in range(0, len(rows), chunk):
        part, gen = rows[i:i + chunk], actors.generators[(i // chunk) % len(actors.generators)]
        seed = cfg.train.seed * 1_000_003 + 7919 * i + 17  # same seeds at every evaluation
        refs.append(actors.grader.grade.remote(part, gen.generate.remote(part, n, seed, greedy, cfg.train.eval_temperature)))
    samples, texts = [], []
    for b in gather(refs, f"{'greedy' if greedy else 'sampled'} held-out evaluation, step {step}" if show else ""):
        d = b.to_pydict()
        stale = {v for v in d["policy_version"] if v != step}
        if stale:
            raise StaleWeights(f"evaluation at step {step} got samples of policy versions {sorted(stale)}")
        for pid, dom, rew, valid, text in zip(d["prompt_id"], d["domain"], d["raw_reward"], d["reward_valid"],
                                              d["response_text"]):
            samples.append((pid, dom, rew, valid))
            if len(texts) < cfg.tracking.log_samples:
                texts.append(f"[{dom}] reward={rew:.2f} :: {text}")
    out = pass_at_k(samples, None if greedy else n, "val/greedy" if greedy else "val")
    if outcomes is not None:
        outcomes.update(prompt_outcomes(samples))
    tracker.track(out, step, {"split": "eval"})
    if texts and not greedy:
        tracker.text("val/samples", texts, step, {"split": "eval"})
    return out


def held_out(cfg: Config, actors: Actors, rows: list[dict], step: int, tracker: Tracker) -> dict:
    """The before/after table's metrics: sampled pass@1 and pass@k, and greedy pass@1 (with bars)."""
    return {**evaluate(cfg, actors, rows, step, tracker, show=True),
            **evaluate(cfg, actors, rows, step, tracker, greedy=True, show=True)}


def preflight(cfg: Config, actors: Actors, rows_by_pool: dict) -> dict:
    """The curriculum's preflight (:mod:`prorl_async.curriculum`): ``rollout.n`` samples of every row
    at the rollout's sampling settings, graded; ``{pool: GROUP_COUNTS}`` summed as the replay buffer
    sums them (:func:`~prorl_async.algo.sampling.group_counts`)."""
    rows = [row for pool in rows_by_pool.values() for row in pool]
    chunk, refs = cfg.rollout.prompts_per_request, []
    for i in range(0, len(rows), chunk):
        part, gen = rows[i:i + chunk], actors.generators[(i // chunk) % len(actors.generators)]
        seed = cfg.rollout.seed * 1_000_003 + 104_729 * (i + 1) + 3  # apart from the rollouts' and evaluations' seeds
        refs.append(actors.grader.grade.remote(part, gen.generate.remote(part, cfg.rollout.n, seed)))
    groups: dict = {}  # (domain, prompt_id) -> ([rewards], [valid])
    for b in gather(refs, "preflight: sampling every pool of the training mix"):
        d = b.to_pydict()
        for pid, dom, rew, valid in zip(d["prompt_id"], d["domain"], d["raw_reward"], d["reward_valid"]):
            rs, vs = groups.setdefault((dom, pid), ([], []))
            rs.append(rew)
            vs.append(valid)
    out: dict = {}
    for (dom, _), (rs, vs) in groups.items():
        pool = out.setdefault(dom, [0, 0, 0.0, 0, 0])
        for k, v in enumerate(group_counts(rs, vs, DEFAULT_TOL)):
            pool[k] += v
    return out


def gather(refs: list, label: str = "") -> list:
    """``ray.get(refs)`` in order; with a ``label``, a progress bar as the chunks finish. A SIGTERM
    taken while it waited stops the run here (:func:`actors.stopping.raise_if_terminated`)."""
    pending = list(refs)
    while label and pending:
        _, pending = ray.wait(pending, num_returns=1)
        raise_if_terminated()
        bar(label, len(refs) - len(pending), len(refs))
    out = ray.get(refs)
    raise_if_terminated()
    return out
