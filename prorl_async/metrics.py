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
* ``se@1`` / ``se@k`` (:func:`pass_at_k_stderr`): one standard error of pass@1 / pass@k as means
  over prompts, and :func:`paired_difference`: two evaluations of the same prompts compared prompt
  by prompt. They measure what the choice of prompts and samples adds, not how much two training
  runs of one config differ.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from typing import Any, Iterable, NamedTuple

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


class PromptOutcome(NamedTuple):
    """One held-out prompt's samples: its domain, how many were correct, and how many were drawn."""

    domain: str
    correct: int
    samples: int


def prompt_outcomes(samples: Iterable[tuple[str, str, float, bool]]) -> dict[str, PromptOutcome]:
    """``{prompt_id: PromptOutcome}`` from ``(prompt_id, domain, reward, valid)`` of every sample
    (an invalid sample counts as drawn and not correct)."""
    correct: dict[str, int] = defaultdict(int)
    drawn: dict[str, int] = defaultdict(int)
    domain_of: dict[str, str] = {}
    for pid, dom, reward, valid in samples:
        correct[pid] += bool(valid and is_correct(reward))
        drawn[pid] += 1
        domain_of[pid] = dom
    return {pid: PromptOutcome(domain_of[pid], correct[pid], drawn[pid]) for pid in drawn}


def _by_domain(outcomes: dict[str, PromptOutcome]) -> dict[str, list[str]]:
    """``{"all": every prompt id, domain: its prompt ids}``, in first-seen order."""
    groups = {"all": list(outcomes)}
    for pid, o in outcomes.items():
        groups.setdefault(o.domain, []).append(pid)
    return groups


def pass_at_k(samples: Iterable[tuple[str, str, float, bool]], k: int | None, prefix: str = "val") -> dict[str, float]:
    """``{prefix}/pass@1`` and ``{prefix}/pass@{k}`` (omitted when ``k`` is None), overall and per
    domain (``.../<domain>``), from ``(prompt_id, domain, reward, valid)`` of every sample."""
    outcomes = prompt_outcomes(samples)
    out = {}
    for dom, pids in _by_domain(outcomes).items():
        key = "" if dom == "all" else f"/{dom}"
        out[f"{prefix}/pass@1{key}"] = sum(outcomes[p].correct / outcomes[p].samples for p in pids) / len(pids)
        if k is not None:
            out[f"{prefix}/pass@{k}{key}"] = sum(outcomes[p].correct > 0 for p in pids) / len(pids)
    return out


def stderr_of_mean(values: list[float]) -> float:
    """Standard error of the mean of ``values``: sample standard deviation over sqrt(n), n >= 2."""
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def pass_at_k_stderr(outcomes: dict[str, PromptOutcome], k: int) -> dict[str, float]:
    """``se@1`` and ``se@{k}`` (``k`` > 1), overall and per domain (``.../<domain>``): one standard
    error of pass@1 and pass@k, each the mean over prompts of a per-prompt score (the share of its
    samples correct; whether any is). Omitted for a domain of fewer than 2 prompts. With n prompts
    a pass@1 near p has a standard error near sqrt(p(1-p)/n) or less: 16 prompts at p = 0.5 read
    to about ±0.12, so two evaluations 0.05 apart on them are not told apart."""
    out = {}
    for dom, pids in _by_domain(outcomes).items():
        if len(pids) < 2:
            continue
        key = "" if dom == "all" else f"/{dom}"
        out[f"se@1{key}"] = stderr_of_mean([outcomes[p].correct / outcomes[p].samples for p in pids])
        if k > 1:
            out[f"se@{k}{key}"] = stderr_of_mean([float(outcomes[p].correct > 0) for p in pids])
    return out


class Difference(NamedTuple):
    """``after - before`` of a mean over prompts, prompt by prompt, and its standard error."""

    before: float
    after: float
    diff: float
    se: float
    prompts: int


def paired_difference(before: dict[str, PromptOutcome], after: dict[str, PromptOutcome], pids: list[str],
                      any_correct: bool = False) -> Difference:
    """pass@1 (``any_correct``: pass@k) of ``pids`` in two evaluations of the same prompts, and the
    standard error of their difference from the per-prompt differences (a prompt easy in both
    cancels out, which an unpaired comparison cannot use). ``se`` is 0 below 2 prompts."""
    def score(o: PromptOutcome) -> float:
        return float(o.correct > 0) if any_correct else o.correct / o.samples

    missing = [p for p in pids if p not in before or p not in after]
    if missing or not pids:
        raise ValueError(f"paired_difference: {len(missing)} of {len(pids)} prompts are not in both evaluations "
                         f"(e.g. {missing[:3]}); compare evaluations of the same --data")
    b, a = [score(before[p]) for p in pids], [score(after[p]) for p in pids]
    d = [y - x for x, y in zip(b, a)]
    n = len(pids)
    return Difference(sum(b) / n, sum(a) / n, sum(d) / n, stderr_of_mean(d) if n > 1 else 0.0, n)


def mean_of(parts: list[Difference]) -> Difference:
    """The unweighted mean of per-domain differences (the docs' "mean over the easy pools"), its
    standard error from theirs (domains' prompts drawn independently)."""
    m = len(parts)
    return Difference(sum(p.before for p in parts) / m, sum(p.after for p in parts) / m,
                      sum(p.diff for p in parts) / m, math.sqrt(sum(p.se ** 2 for p in parts)) / m,
                      sum(p.prompts for p in parts))


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
