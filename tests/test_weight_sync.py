"""The weight-sync group between real processes: gloo here, NCCL on GPUs (same code)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from prorl_async.weight_sync import WeightSyncError, WeightSyncGroup, free_port, tensor_checksum
from tests._sync_worker import member, named


def _run(scenario: str, backend: str = "gloo", device: str = "cpu", timeout: float = 90.0) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=member, args=(r, port, backend, device, scenario, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(2):
            kind, value = q.get(timeout=timeout)
            assert kind != "error", value
            out[kind] = value
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


@pytest.mark.distributed
def test_versioned_broadcast_arrives_bit_exact():
    out = _run("ok")
    (s1, v1, c1), (s2, v2, c2) = out["receiver"]
    assert (s1, v1, s2, v2) == ("ok", 1, "ok", 2)
    assert c1 == tensor_checksum([t for _, t in named(1)]) and c2 == out["sender"]
    assert c1 != c2


@pytest.mark.distributed
def test_update_for_a_different_model_is_refused_and_the_group_stays_usable():
    out = _run("mismatch")
    first, second = out["receiver"]
    assert first[0] == "refused" and "models differ" in first[1] and "version 1 discarded" in first[1]
    assert second[0] == "ok" and second[1] == 2 and second[2] == out["sender"]  # the next sync still works


@pytest.mark.distributed
def test_a_sync_that_never_comes_times_out_instead_of_hanging():
    out = _run("silent")
    [(status, message, waited)] = out["receiver"]
    assert status == "refused" and "weight broadcast" in message
    assert waited < 30  # the 5 s timeout, not forever


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(WeightSyncError, match="already in use"):
            WeightSyncGroup("127.0.0.1", s.getsockname()[1], 0, 2, "gloo", timeout_s=2)


@pytest.mark.gpu
@pytest.mark.distributed
def test_nccl_broadcast_between_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL needs one device per rank)")
    out = _run("ok", backend="nccl", device="cuda")
    assert [r[0] for r in out["receiver"]] == ["ok", "ok"] and out["receiver"][1][2] == out["sender"]
