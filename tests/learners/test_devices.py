"""Device correctness of the production path, with the device as a parameter (cpu here; cuda
under ``-m gpu``, skipped without the GPUs it needs):

* the weight-sync sender packs and broadcasts on the device its backend needs (CUDA for
  NCCL) and the HF engine receives on its own (learner -> engine over a real group);
* the HF engine's model lives on the device it was given (the GPU Ray reserved);
* the DeepSpeed reference model lives on the learner's device, so ``kl_coef > 0`` trains;
* all-reduced statistics on the backend's device: the 2-rank runs of test_multirank.py
  (whitening, token counts, mismatch), parametrised the same way.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from prorl_async.weight_sync import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _gpus(n: int):
    return [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPU(s)")]


@pytest.mark.distributed
@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), pytest.param("cuda", "nccl", marks=_gpus(2))])
def test_learner_sends_on_its_backends_device_and_hf_engine_receives_on_its_own(tiny_model, device, backend):
    from tests.learners._sync_devices import member

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=member, args=(r, port, backend, device, tiny_model, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(2):
            kind, value = q.get(timeout=300)
            assert kind != "error", value
            out[kind] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    version, sent, sync_dev, learner_dev = out["sender"]
    got_version, got, before, staged_dev, engine_dev, info_version, n_out = out["receiver"]
    want = "cpu" if backend == "gloo" else "cuda"
    assert learner_dev.startswith(device) and sync_dev.startswith(want) and staged_dev.startswith(want)
    assert engine_dev.startswith(device)  # the engine computes where it was put
    assert got_version == info_version == version == 1
    assert got == sent and got != before  # the trained weights arrived bit-exact and are in use
    assert n_out == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpus(1))])
def test_hf_engine_generates_on_its_device(tiny_model, device):
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine

    eng = HFEngine(tiny_model, device=device)
    assert all(p.device.type == device for p in eng.model.parameters())
    out = eng.generate([eng.tokenizer("12+34=")["input_ids"]], SamplingSpec(n=2, max_new_tokens=4, seed=1))
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 and all(lp <= 0 for lp in c.logprobs) for c in out[0])


@pytest.mark.distributed
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_gpus(1))])
def test_deepspeed_reference_model_on_the_learner_device_with_kl(tiny_model, tmp_path, device, ds_ext):
    pytest.importorskip("deepspeed")
    spec = {"out": str(tmp_path), "model": tiny_model, "device": device, "zero": 2, "world": 1, "steps": [1, 2]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "learners", "_ds_worker.py"),
                           str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": ds_ext})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = torch.load(tmp_path / "result-rank0.pt", weights_only=False)
    assert r["ref_device"].startswith(device)
    assert all(m["actor/updates"] == 1 and math.isfinite(m["kl/loss_term"]) for m in r["metrics"])
    assert r["metrics"][1]["kl/loss_term"] > 0  # the policy moved away from the reference
