"""Verifiable rewards: one verifier per domain, dispatched through a plain dict.

ProRL v2 trains on programmatic rewards over five domains (math, code, STEM, logic puzzles,
instruction following; Liu et al., "ProRL: Prolonged Reinforcement Learning Expands Reasoning
Boundaries in Large Language Models", 2025, Sec. 3), plus the tiny ``arithmetic`` task this
project uses as its default CPU training set.

``grade(row, response, **options)`` looks up ``VERIFIERS[row["domain"]]`` (or, for a domain
``FAMILY:NAME`` that is not registered itself, ``VERIFIERS[FAMILY]``: every Reasoning Gym task is
a domain ``rg:TASK`` of the ``rg`` verifier) and returns a :class:`Grade`. ``valid=False`` means the verifier could not decide (see
:mod:`prorl_async.rewards.base`); the learner masks such samples out. Exceptions raised by a
verifier propagate from :func:`grade` (let errors propagate); :class:`~prorl_async.rewards.pool.GraderPool`
is where they are caught, counted and turned into ``valid=False`` grades, under a hard,
kill-based time limit.

Options (keyword arguments of :func:`grade`, defaults in ``DEFAULT_OPTIONS``):

* ``code_mode``: ``"fraction"`` (reward = fraction of tests passed) or ``"all"`` (1 iff all pass);
* ``instruction_mode``: ``"fraction"`` or ``"all"``, the same for instruction constraints;
* ``stem_rel_tol``: relative tolerance of numeric STEM answers;
* ``code_time_limit_s``, ``code_total_time_s``, ``code_memory_mb``, ``code_max_procs``,
  ``code_max_output_bytes``, ``code_isolation``: sandbox limits (see :mod:`.sandbox`);
* ``time_budget_s``: set by the grader pool to its per-sample limit, so that the code
  verifier fits its sandbox time into it (a program that loops forever is *wrong*, a verifier
  that the pool had to kill is *invalid*).

Custom verifiers: ``register("mydomain", fn)`` where ``fn(row, response) -> Grade``; a
function that also accepts ``**options`` receives the options.
"""

from __future__ import annotations

import inspect
from typing import Callable

from prorl_async.rewards.base import Grade, checked, invalid

__all__ = ["Grade", "VERIFIERS", "DEFAULT_OPTIONS", "register", "grade", "invalid", "verifier_domain"]

Verifier = Callable[..., Grade]

#: domain name -> verifier(row, response[, **options]) -> Grade
VERIFIERS: dict[str, Verifier] = {}
_TAKES_OPTIONS: dict[str, bool] = {}

DEFAULT_OPTIONS: dict[str, object] = {
    "code_mode": "fraction",
    "instruction_mode": "fraction",
    "stem_rel_tol": 1e-4,
    "code_time_limit_s": 2.0,
    "code_total_time_s": 6.0,
    "code_memory_mb": 512,
    "code_max_procs": 16,
    "code_max_output_bytes": 1 << 20,
    "code_isolation": "auto",
    "time_budget_s": None,
}


def register(domain: str, fn: Verifier) -> None:
    """Register (or replace) the verifier of ``domain``."""
    if not isinstance(domain, str) or not domain:
        raise ValueError(f"domain must be a non-empty string, got {domain!r}")
    params = inspect.signature(fn).parameters.values()
    VERIFIERS[domain] = fn
    _TAKES_OPTIONS[domain] = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def verifier_domain(domain) -> str | None:
    """The registered name that grades ``domain``: itself, or its family (the part before ``:``)."""
    if not isinstance(domain, str):
        return None
    if domain in VERIFIERS:
        return domain
    family = domain.split(":", 1)[0]
    return family if ":" in domain and family in VERIFIERS else None


def resolve_options(options: dict) -> dict:
    """``DEFAULT_OPTIONS`` updated with ``options``; unknown names and bad modes raise ValueError."""
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown grading option(s) {unknown}; known: {sorted(DEFAULT_OPTIONS)}")
    resolved = {**DEFAULT_OPTIONS, **options}
    for key in ("code_mode", "instruction_mode"):
        if resolved[key] not in ("fraction", "all"):
            raise ValueError(f"{key} must be 'fraction' or 'all', got {resolved[key]!r}")
    return resolved


def grade(row: dict, response: str, **options) -> Grade:
    """Grade ``response`` against ``row`` with the verifier of ``row["domain"]``.

    Raises ValueError for an unknown domain (naming the row id and the known domains) or an
    unknown option. A non-finite reward comes back as ``Grade(valid=False, reason="non_finite")``.
    """
    domain = row.get("domain")
    name = verifier_domain(domain)
    if name is None:
        raise ValueError(
            f"row {row.get('id')!r}: unknown domain {domain!r}; known domains: {sorted(VERIFIERS)}"
        )
    fn = VERIFIERS[name]
    if _TAKES_OPTIONS[name]:
        result = fn(row, response, **resolve_options(options))
    else:
        if options:
            resolve_options(options)  # reject typos even where the verifier takes no options
        result = fn(row, response)
    if not isinstance(result, Grade):
        raise TypeError(f"verifier of domain {domain!r} returned {type(result).__name__}, not Grade")
    return checked(result)


def _register_builtins() -> None:
    from prorl_async.rewards import arithmetic, chat_arith, code, instruction, logic, math, reasoning_gym, stem

    register("arithmetic", arithmetic.verify)
    register("math", math.verify)
    register("code", code.verify)
    register("stem", stem.verify)
    register("logic", logic.verify)
    register("instruction", instruction.verify)
    register("chat-arith", chat_arith.verify)
    register("rg", reasoning_gym.verify)  # domains rg:TASK[@LEVEL] (prorl_async.data.reasoning_gym)


_register_builtins()
