"""Bounded staleness by admission control (AReaL, Fu et al. 2025, arXiv 2505.24298, sec. 5).

A generator holding weights of version ``v`` may start a request for ``k`` prompts only while

    consumed + live + k <= (v + max_staleness + 1) * prompts_per_step

``consumed`` counts groups already handed to the learner, ``live`` those in flight or
waiting in the buffer. Groups are trained oldest-first, ``prompts_per_step`` per learner
version, so a group admitted under this rule is trained at a learner version of at most
``v + max_staleness``. Nothing is dropped for being slow (dropping slow samples biases
training toward short responses); the buffer re-checks the bound when it hands groups out.
With ``max_staleness = 0`` this is the synchronous, on-policy schedule.
"""

from __future__ import annotations

from typing import Optional


def admission_budget(generator_version: int, max_staleness: int, prompts_per_step: int,
                     consumed: int, live: int) -> int:
    """How many more prompts (groups) a generator at ``generator_version`` may start now."""
    return max(0, (generator_version + max_staleness + 1) * prompts_per_step - consumed - live)


def staleness(learner_version: int, policy_version: int) -> int:
    """Versions between the weights that generated a sample and the learner training on it."""
    return learner_version - policy_version


def plan_requests(generator_versions: list[int], generator_busy: list[bool], max_staleness: int,
                  prompts_per_step: int, prompts_per_request: int, consumed: int, live: int,
                  max_groups: Optional[int] = None) -> list[tuple[int, int]]:
    """``(generator index, prompts)`` of every request that may start now, in generator order.

    Each idle generator gets ``min(prompts_per_request, budget)`` prompts while its admission
    budget is positive; planned requests count as live for the generators after it.
    ``max_groups`` (the run's ``total_steps * prompts_per_step``) caps consumed + live: no group
    is generated that no remaining step would train (a group dynamic sampling drops leaves
    ``live`` and makes room for its refill). This is the driver's dispatch rule, shared with
    the scale simulation (``benchmarks/bench_scale_sim.py``).
    """
    plan = []
    for i, (version, busy) in enumerate(zip(generator_versions, generator_busy)):
        if busy:
            continue
        budget = admission_budget(version, max_staleness, prompts_per_step, consumed, live)
        if max_groups is not None:
            budget = min(budget, max_groups - consumed - live)
        if budget < 1:
            continue
        k = min(prompts_per_request, budget)
        plan.append((i, k))
        live += k
    return plan
