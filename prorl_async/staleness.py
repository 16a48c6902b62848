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


def admission_budget(generator_version: int, max_staleness: int, prompts_per_step: int,
                     consumed: int, live: int) -> int:
    """How many more prompts (groups) a generator at ``generator_version`` may start now."""
    return max(0, (generator_version + max_staleness + 1) * prompts_per_step - consumed - live)


def staleness(learner_version: int, policy_version: int) -> int:
    """Versions between the weights that generated a sample and the learner training on it."""
    return learner_version - policy_version
