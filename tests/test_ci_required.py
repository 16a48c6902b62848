"""tests/ci_required.py: under CI=true a skip fails unless its test is marked ``gpu`` (a missing
vllm / deepspeed / reasoning_gym says what to install); without CI the same skips skip."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

MISSING_EXTRA = '''
import pytest

pytest.importorskip("deepspeed.no_such_module_for_the_ci_test")

def test_never_runs():
    pass
'''

SKIPS = '''
import pytest

def test_skips_without_gpu_mark():
    pytest.skip("needs a thing CI lacks")

@pytest.mark.skipif(True, reason="a skipif the CI machine meets")
def test_skipif_without_gpu_mark():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu_marked_skip():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

def test_passes():
    pass
'''


def _pytest(tmp_path, ci: str, case: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(case)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.ci_required", "-p", "no:cacheprovider",
                           "--strict-markers", "--rootdir", str(tmp_path), str(tmp_path / "test_case.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_missing_extra_fails_in_ci_and_skips_elsewhere(tmp_path):
    ci = _pytest(tmp_path, "true", MISSING_EXTRA)
    assert ci.returncode != 0, ci.stdout[-2000:]
    assert "CI=true requires vllm, deepspeed, reasoning_gym: install them" in ci.stdout, ci.stdout[-2000:]
    assert "1 error" in ci.stdout, ci.stdout[-2000:]
    local = _pytest(tmp_path, "", MISSING_EXTRA)
    assert local.returncode in (0, 5) and "1 skipped" in local.stdout and "error" not in local.stdout, local.stdout[-2000:]


def test_any_skip_but_a_gpu_marked_one_fails_in_ci(tmp_path):
    ci = _pytest(tmp_path, "true", SKIPS)
    out = ci.stdout
    assert ci.returncode == 1, out[-3000:]
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out, out[-3000:]  # a skipif skips in set-up
    assert "FAILED test_case.py::test_skips_without_gpu_mark - Skipped: needs a thing CI lacks" in out, out[-3000:]
    assert "ERROR test_case.py::test_skipif_without_gpu_mark - Skipped: a skipif the CI machine meets" in out, out[-3000:]
    assert "CI=true allows a skip only in a test marked `gpu`" in out, out[-3000:]
    assert "SKIPPED [1] test_case.py:" in out and "needs a CUDA GPU" in out, out[-3000:]
    local = _pytest(tmp_path, "", SKIPS)
    assert local.returncode == 0 and "1 passed, 3 skipped, 1 xfailed" in local.stdout, local.stdout[-3000:]
