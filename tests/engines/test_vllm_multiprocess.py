"""vLLM's default multiprocess engine core, as a real run starts it (tests/engines/test_vllm.py
runs the in-process engine and sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for its session, so
this runs in a fresh interpreter): generation, weight sync into the worker process over gloo
or by shared-memory handles (ipc, the one-GPU path's mechanism on CPU), and generation with the received weights (tests/engines/_vllm_multiprocess_main.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_default_multiprocess_engine_generates_and_receives_weights(tiny_model, tmp_path, backend):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "engines" / "_vllm_multiprocess_main.py"), tiny_model, backend],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    assert "MP" in out["engine_core"], out  # SyncMPClient: the engine core runs in its own process
    assert all(out["greedy_equal_before"]), out
    assert out["received_version"] == 1 and out["version"] == 1 and out["checksum_equal"], out
    assert all(out["greedy_equal_after"]) and out["policy_versions"] == [1] * 4, out
