"""The weight-sync group between real processes: gloo here, NCCL on GPUs (same code)."""

from __future__ import annotations

import re
import socket
import threading

import pytest
import torch
import torch.multiprocessing as mp

from prorl_async.weight_sync import WeightSyncError, WeightSyncGroup, free_port, serve_store, tensor_checksum
from tests._sync_worker import bound_member, member, named, reform_member


def _run(scenario: str, backend: str = "gloo", device: str = "cpu", timeout: float = 90.0) -> dict:
    ctx = mp.get_context("spawn")
    q, port_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, port_q, backend, device, scenario, q)) for r in range(2)]
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
@pytest.mark.parametrize("scenario", ["ok", "full"])
def test_versioned_broadcast_arrives_bit_exact(scenario):
    out = _run(scenario)  # sampled integrity check (default) and the full one
    (s1, v1, c1, d1, _), (s2, v2, c2, _, _) = out["receiver"]
    assert (s1, v1, s2, v2) == ("ok", 1, "ok", 2)
    assert c1 == tensor_checksum([t for _, t in named(1)]) and c2 == out["sender"][0]
    assert c1 != c2
    assert d1 == ["torch.float32", "torch.float32", "torch.bfloat16"]  # dtypes as sent: nothing announced


@pytest.mark.distributed
def test_receiver_announcing_bf16_gets_bf16_on_the_wire():
    out = _run("wire_bf16")
    (s1, v1, c1, d1, nbytes), (s2, _, c2, _, _) = out["receiver"]
    assert (s1, s2, v1) == ("ok", "ok", 1)
    assert d1 == ["torch.bfloat16"] * 3
    # the same bits as casting the fp32 weights on arrival, in half the fp32 bytes
    assert c1 == tensor_checksum([t.bfloat16() for _, t in named(1)]) and c2 == out["sender"][0]
    assert nbytes == sum(t.numel() * 2 for _, t in named(1)) and out["sender"][1] * 1e9 == nbytes


@pytest.mark.distributed
def test_update_for_a_different_model_is_refused_and_the_group_stays_usable():
    out = _run("mismatch")
    first, second = out["receiver"]
    assert first[0] == "refused" and "models differ" in first[1] and "version 1 discarded" in first[1]
    assert second[0] == "ok" and second[1] == 2 and second[2] == out["sender"][0]  # the next sync still works


@pytest.mark.distributed
def test_a_sync_that_never_comes_times_out_instead_of_hanging():
    out = _run("silent")
    [(status, message, waited)] = out["receiver"]
    assert status == "refused" and "weight broadcast" in message and "timeout 5 s" in message
    assert waited < 30  # the 5 s timeout, not forever


@pytest.mark.distributed
def test_a_sender_that_went_away_fails_the_receive_at_once_and_says_how_soon():
    out = _run("gone")
    [(status, message, waited), (closed, again, pg_gone)] = out["receiver"]
    took = re.search(r"weight broadcast failed after (\d+\.\d) s \(timeout 5 s\)", message)
    assert status == "refused" and took, message
    assert float(took.group(1)) < 4.5 and waited < 4.5  # a closed connection, not the timeout
    # the failure closed the group (an NCCL communicator would be aborted there): the next update is
    # refused with what to do, instead of running a collective on a broken group
    assert closed == "closed" and pg_gone and "must be re-formed" in again, again


@pytest.mark.distributed
def test_a_re_formed_group_closes_the_old_one_leaving_no_sockets_or_listeners():
    """Six groups in turn between the same two processes, each old one still referenced: closed
    first, the fds and listening sockets stay flat; not closed, each re-form leaks its gloo
    sockets and (rank 0) its store listener -- the control shows the probe sees a leak."""
    ctx = mp.get_context("spawn")
    seen = {}
    for replaced in ("close", "keep"):
        q, port_q = ctx.Queue(), ctx.Queue()  # ports picked as the stores bind them: none can be taken first
        procs = [ctx.Process(target=reform_member, args=(r, 6, replaced, q, port_q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = dict(q.get(timeout=120) for _ in range(2))
        finally:
            for p in procs:
                p.join(timeout=20)
                p.kill() if p.is_alive() else None
        assert all(isinstance(v, list) for v in got.values()), got
        seen[replaced] = got
    for rank in (0, 1):
        assert seen["close"][rank][-1] == seen["close"][rank][0], seen["close"]  # fds, listeners flat
        fds, listening = seen["keep"][rank][-1]
        assert fds >= seen["keep"][rank][0][0] + 5 and listening >= seen["keep"][rank][0][1] + 5, seen["keep"]


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(WeightSyncError, match="already in use"):
            WeightSyncGroup("127.0.0.1", s.getsockname()[1], 0, 2, "gloo", timeout_s=2)


@pytest.mark.distributed
def test_a_served_store_holds_its_port_until_the_group_forms_on_it():
    """The learner's weight-sync store listens from the moment its address is handed out (a port
    found free and bound later could be taken in between): the port is not free for anyone else,
    and rank 0 forms the group on the store it was handed while a receiver joins by address."""
    store, port = serve_store("127.0.0.1")
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))
    got: list = []

    def receive():
        g = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
        t = torch.zeros(4)
        g._bcast(t)
        got.append(t)

    th = threading.Thread(target=receive)
    th.start()
    sender = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, store=store)
    sender._bcast(torch.arange(4.0))
    th.join(timeout=60)
    assert got and torch.equal(got[0], torch.arange(4.0))


@pytest.mark.distributed
@pytest.mark.parametrize("ifname, expect", [("", [("127.0.0.2",), ("127.0.0.3",)]),
                                            ("lo", [("127.0.0.1",), ("127.0.0.1",)])], ids=["node-ip", "ifname"])
def test_gloo_groups_listen_on_the_node_ip_or_gloo_socket_ifname(ifname, expect):
    """bind_gloo: every gloo group of a process -- torch's (the world, a new group) and the
    weight-sync group -- listens on the node's IP, not on what the hostname resolves to;
    GLOO_SOCKET_IFNAME, when set, wins (``lo`` holds 127.0.0.1)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=bound_member, args=(r, ports, ifname, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(2):
            rank, listens, total = q.get(timeout=90)
            got[rank] = listens
            assert total == 2.0, listens
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert [got[0], got[1]] == expect, got


@pytest.mark.gpu
@pytest.mark.distributed
def test_nccl_broadcast_between_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL needs one device per rank)")
    out = _run("ok", backend="nccl", device="cuda")
    assert [r[0] for r in out["receiver"]] == ["ok", "ok"] and out["receiver"][1][2] == out["sender"][0]


def test_sampled_checksum_catches_layout_errors_and_the_full_one_a_single_flipped_bit():
    from prorl_async.weight_sync import _checksum

    x = torch.randn(1_000_003)
    assert _checksum(x, full=False) == _checksum(x.clone(), full=False)
    shifted = torch.cat([x[1:], x[:1]])
    assert _checksum(shifted, full=False) != _checksum(x, full=False)  # a shifted buffer
    assert _checksum(x[:-1], full=False) != _checksum(x, full=False)  # a truncated one
    assert _checksum(x.bfloat16(), full=False) != _checksum(x.bfloat16()[torch.randperm(x.numel())], full=False)
    flipped = x.clone()
    flipped.view(torch.int32)[123_457] ^= 1  # one bit of one word that the sample skips
    assert _checksum(flipped, full=False) == _checksum(x, full=False)
    assert _checksum(flipped, full=True) != _checksum(x, full=True)


def test_bucket_checksums_are_compared_exactly():
    from prorl_async.weight_sync import _checksum, checksums_match

    torch.manual_seed(0)
    x = torch.randn(1_000_003)
    last_chunk_start = (x.numel() // (1 << 18)) * (1 << 18)
    flipped = x.clone()
    flipped.view(torch.int32)[last_chunk_start] ^= 1  # the checksum moves by 1 of about 2^31
    a, b = _checksum(x), _checksum(flipped)
    assert a != b and abs(a - b) <= 1e-6 * abs(a)  # what a relative tolerance of 1e-6 would have let through
    assert not checksums_match([b], [a]) and checksums_match([a], [a]) and not checksums_match([a], [a, a])


def test_all_finite_finds_every_nan_and_inf_and_passes_finite_values_whose_sum_overflows():
    from prorl_async.weight_sync import all_finite

    good = [torch.randn(1000), torch.randn(64, 32).bfloat16(), torch.randn(7).half(), torch.arange(5)]
    assert all_finite(good)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = torch.randn(500).to(dtype)
            t[321] = bad
            assert not all_finite([*good, t]), (dtype, bad)
    both = torch.zeros(10)
    both[2], both[7] = float("inf"), float("-inf")  # their sum is nan
    assert not all_finite([both])
    # finite values whose sum is not finite: the value-by-value check decides
    assert all_finite([torch.full((4,), 3e38), torch.full((4,), -3e38, dtype=torch.bfloat16)])
    assert all_finite([torch.full((8,), 60000.0, dtype=torch.float16)])  # fp16's own sum would be inf


def test_a_tensor_on_cuda_0_is_on_the_device_cuda(monkeypatch):
    """The learner's device is ``"cuda"``, its parameters' ``cuda:0``: the sender packs a single
    contiguous parameter in place only if the two are recognised as one device."""
    from prorl_async.weight_sync import on_device

    assert torch.device("cuda:0") != torch.device("cuda")  # why a plain == never matched
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert on_device(torch.device("cuda:0"), "cuda") and on_device(torch.device("cuda:0"), torch.device("cuda"))
    assert on_device(torch.device("cuda:1"), "cuda:1") and not on_device(torch.device("cuda:1"), "cuda")
    assert not on_device(torch.device("cuda:0"), "cuda:1") and not on_device(torch.device("cuda:0"), "cpu")
    assert on_device(torch.device("cpu"), "cpu") and not on_device(torch.device("cpu"), "cuda")


@pytest.mark.gpu
def test_a_single_cuda_parameter_is_sent_in_place():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from prorl_async.weight_sync import _pack

    t = torch.randn(1000, device="cuda")
    assert str(t.device) == "cuda:0"
    flat = _pack([t], t.dtype, "cuda")  # the learner's device string
    assert flat.data_ptr() == t.data_ptr()  # no copy
    assert _pack([t], torch.bfloat16, "cuda").data_ptr() != t.data_ptr()  # a cast still copies
