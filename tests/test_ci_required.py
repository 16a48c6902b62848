"""tests/ci_required.py: a skipped vllm / deepspeed / reasoning_gym import fails under CI=true and skips otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

CASE = '''
import pytest

pytest.importorskip("deepspeed.no_such_module_for_the_ci_test")

def test_never_runs():
    pass
'''


def _pytest(tmp_path, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(CASE)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.ci_required", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_case.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_missing_extra_fails_in_ci_and_skips_elsewhere(tmp_path):
    ci = _pytest(tmp_path, "true")
    assert ci.returncode != 0, ci.stdout[-2000:]
    assert "CI=true requires vllm, deepspeed, reasoning_gym: install them" in ci.stdout, ci.stdout[-2000:]
    assert "1 error" in ci.stdout, ci.stdout[-2000:]
    local = _pytest(tmp_path, "")
    assert local.returncode in (0, 5) and "1 skipped" in local.stdout and "error" not in local.stdout, local.stdout[-2000:]
