"""Metric arithmetic of a run, as pure functions: correctness, per-step rollout and timing
metrics, held-out pass@1 / pass@k, and what a set's answers alone score.

* ``is_correct``: a response is correct iff its verifier reward is 1 (within ``CORRECT_TOL``);
  partial credit (a fraction of tests passed) is not. The one rule every reader uses (buffer
  stats, learners' length shaping, evaluation).
* ``pass@k`` here is the empirical one of the k samples drawn per prompt (any of them
  correct), and ``pass@1`` the mean correctness over those samples; Chen et al. 2021
  (arXiv 2107.03374, eq. 1) with n = k, i.e. no unbiased estimator from n > k samples.
* Invalid samples (the grader could not decide) count as not correct in evaluation; in the
  rollout metrics they are left out of the means and counted as ``reward/invalid``.
* ``prior@1`` / ``prior@k`` (:func:`answer_prior`): the pass@1 of always giving a set's most
  common answer and the pass@k of guessing from its answers, with no model: the line a pass@ must
  clear before it says anything of skill on a task whose answers are mostly a few values.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any, Iterable

CORRECT_TOL = 1e-6


def is_correct(reward: Any) -> Any:
    """True where ``reward`` (a float, numpy array or torch tensor of verifier rewards) is 1."""
    return reward >= 1.0 - CORRECT_TOL


def rollout_metrics(window: dict, dt: float) -> dict[str, float]:
    """Rollout metrics of one learner step from the sums ``window`` gathered since the last one
    (``samples``, ``valid``, ``correct``, ``reward_sum``, ``response_tokens``, ``gen_time_s``), over ``dt`` seconds.
    Means over no sample are left out, not reported as 0: an asynchronous run's last step, whose
    batch was generated during the step before it, grades nothing new."""
    w = defaultdict(float, window)
    dt = max(dt, 1e-9)
    means = {}
    if w["valid"]:
        means.update({"reward/mean": w["reward_sum"] / w["valid"], "reward/accuracy": w["correct"] / w["valid"]})
    if w["samples"]:
        means["len/generated_mean"] = w["response_tokens"] / w["samples"]
    return {
        **means,
        "reward/invalid": w["samples"] - w["valid"],
        "perf/gen_tok_s": w["response_tokens"] / dt,
        # per second the engines spent generating (each request's generate() wall time): an
        # engine's own speed inside the run, comparable with the engine measured alone
        "perf/gen_engine_tok_s": w["response_tokens"] / max(w["gen_time_s"], 1e-9),
        "perf/samples_s": w["samples"] / dt,
        "perf/step_s": dt,
    }


def domain_metrics(window: dict) -> dict[str, dict[str, float]]:
    """Per domain: ``reward/accuracy`` and ``reward/mean`` from the ``domain_*/<domain>`` sums."""
    w = defaultdict(float, window)
    out = {}
    for key, v in window.items():
        if key.startswith("domain_valid/"):
            dom = key.split("/", 1)[1]
            out[dom] = {"reward/accuracy": w[f"domain_correct/{dom}"] / max(v, 1.0),
                        "reward/mean": w[f"domain_reward/{dom}"] / max(v, 1.0)}
    return out


def utilisation_metrics(elapsed: float, train_busy_s: float, gen_busy_s: list, busy_s: dict) -> dict[str, float]:
    """Idle fractions since the start and cumulative busy seconds of every role."""
    elapsed = max(elapsed, 1e-9)
    busy = defaultdict(float, busy_s)
    return {
        "async/learner_idle_frac": 1.0 - train_busy_s / elapsed,
        "async/generator_idle_frac": 1.0 - sum(gen_busy_s) / (elapsed * len(gen_busy_s)),
        "async/grader_idle_frac": 1.0 - busy["grade"] / elapsed,
        "time/generate_s": sum(gen_busy_s), "time/grade_s": busy["grade"],
        "time/train_s": train_busy_s, "time/sync_s": busy["sync"], "time/eval_s": busy["eval"],
    }


def rss_mb() -> float:
    """This process's resident memory in MiB (``/proc/self/statm``; 0 where there is none):
    every actor reports its own as ``sys/rss_mb/<role>``, so growth over a long run is visible."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def pass_at_k(samples: Iterable[tuple[str, str, float, bool]], k: int, prefix: str = "val") -> dict[str, float]:
    """``{prefix}/pass@1`` and ``{prefix}/pass@{k}`` (omitted when ``k`` is None), overall and per
    domain (``.../<domain>``), from ``(prompt_id, domain, reward, valid)`` of every sample."""
    per_prompt: dict[str, list[float]] = defaultdict(list)
    domain_of: dict[str, str] = {}
    for pid, dom, reward, valid in samples:
        per_prompt[pid].append(1.0 if valid and is_correct(reward) else 0.0)
        domain_of[pid] = dom
    groups = {"all": list(per_prompt)}
    for pid, dom in domain_of.items():
        groups.setdefault(dom, []).append(pid)
    out = {}
    for dom, pids in groups.items():
        key = "" if dom == "all" else f"/{dom}"
        out[f"{prefix}/pass@1{key}"] = sum(sum(per_prompt[p]) / len(per_prompt[p]) for p in pids) / len(pids)
        if k is not None:
            out[f"{prefix}/pass@{k}{key}"] = sum(max(per_prompt[p]) for p in pids) / len(pids)
    return out


def answer_prior(rows: Iterable[dict], k: int) -> dict[str, float]:
    """What a set's gold answers alone score, with no model: ``prior@1`` and ``prior@{k}``,
    overall and per domain (``.../<domain>``), for the rows that have an ``answer``.

    A task whose answers are mostly one value can be passed by a policy that has learned that value
    instead of the task (a count of letters in three words is 1 for most of them), and a pass@k
    near the share of the answers it can guess says nothing of reasoning. So, per prompt, from the
    answers of the *other* prompts of its domain (leave-one-out: a prompt's own answer never counts
    for it, so a set of distinct answers scores 0):

    * ``prior@1``: whether its answer is the most common of theirs (the pass@1 of always answering
      that one value; a tie of t values counts 1/t when the answer is among them);
    * ``prior@k``: ``1 - (1 - p)**k``, ``p`` the share of their answers equal to its answer (the
      pass@k of k answers drawn at random from them; only for ``k`` > 1).

    Answers compare as stripped strings. Rows without one (code, instruction following) are left
    out, as is a domain with fewer than 2 answered rows; the overall means are over the prompts
    scored."""
    answers: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        if isinstance(row.get("answer"), (str, int, float)) and str(row["answer"]).strip():
            answers[row["domain"]].append(str(row["answer"]).strip())
    scored: dict[str, list[tuple[float, float]]] = {}
    for dom, golds in answers.items():
        if len(golds) < 2:
            continue
        counts = Counter(golds)
        per_prompt = []
        for g in golds:
            others = {a: c - (a == g) for a, c in counts.items()}
            top = max(others.values())
            tied = [a for a, c in others.items() if c == top]
            p = others[g] / (len(golds) - 1)
            per_prompt.append(((g in tied) / len(tied), 1.0 - (1.0 - p) ** k))
        scored[dom] = per_prompt
    out: dict[str, float] = {}
    everything = [s for per_prompt in scored.values() for s in per_prompt]
    for dom, per_prompt in [("all", everything), *sorted(scored.items())]:
        if per_prompt:
            key = "" if dom == "all" else f"/{dom}"
            out[f"prior@1{key}"] = sum(s[0] for s in per_prompt) / len(per_prompt)
            if k > 1:
                out[f"prior@{k}{key}"] = sum(s[1] for s in per_prompt) / len(per_prompt)
    return out
