"""vLLM's default multiprocess engine core, as a real run starts it (tests/engines/test_vllm.py
runs the in-process engine and sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for its session, so
this runs in a fresh interpreter, once per weight-sync backend): generation, weight sync into the
worker process over gloo or by shared-memory handles (ipc, the one-GPU path's mechanism on CPU),
generation with the received weights, and (gloo) an in-flight weight update mid-request (tests/engines/_vllm_multiprocess_main.py, tests/engines/_inflight.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.engines._inflight import check_inflight

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _run(tiny_model, tmp_path_factory, backend: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "engines" / "_vllm_multiprocess_main.py"), tiny_model, backend],
                         cwd=tmp_path_factory.mktemp("mp"), env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def findings(tiny_model, tmp_path_factory):
    return _run(tiny_model, tmp_path_factory, "gloo")


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_default_multiprocess_engine_generates_and_receives_weights(findings, tiny_model, tmp_path_factory, backend):
    out = {k: v for k, v in (findings if backend == "gloo" else _run(tiny_model, tmp_path_factory, backend)).items()
           if k != "inflight"}
    assert "MP" in out["engine_core"], out  # SyncMPClient: the engine core runs in its own process
    assert all(out["greedy_equal_before"]), out
    assert out["received_version"] == 1 and out["version"] == 1 and out["checksum_equal"], out
    assert all(out["greedy_equal_after"]) and out["policy_versions"] == [1] * 4, out


def test_inflight_update_lands_mid_request_multiprocess(findings):
    """The engine core runs ahead of the front end: tokens it sampled under the old weights are
    still on their way when the update lands, and must keep the old version."""
    summary = check_inflight(findings["inflight"])
    print(f"multiprocess in-flight update: {summary}")
