"""Entry point of the spawned processes in test_weight_sync.py (one weight-sync group member each)."""

import time

import torch


def named(seed: int, device: str = "cpu", extra: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = [("embed.weight", torch.randn(50, 16, generator=g)), ("layer.bias", torch.randn(16, generator=g)),
           ("head.weight", torch.randn(16, 16, generator=g).bfloat16())]
    if extra:
        out.append(("extra.weight", torch.randn(3, generator=g)))
    return [(n, t.to(device)) for n, t in out]


def pair_group(rank: int, port_q, backend: str = "gloo", **options):
    """This process's member of a two-process weight-sync group: rank 0 serves the group's store on
    a port the OS picks as it binds (as the learner does) and hands the port to rank 1 through
    ``port_q``; ``options`` go to :class:`WeightSyncGroup`."""
    from prorl_async.weight_sync import WeightSyncGroup, serve_store

    if rank == 0:
        served, port = serve_store("127.0.0.1")
        port_q.put(port)
        return WeightSyncGroup("127.0.0.1", port, 0, 2, backend, store=served, **options)
    return WeightSyncGroup("127.0.0.1", port_q.get(timeout=60), 1, 2, backend, **options)


def member(rank: int, port_q, backend: str, device: str, scenario: str, q) -> None:
    """One member of a two-process group (:func:`pair_group`) in ``scenario``."""
    from prorl_async.weight_sync import WeightSyncError, tensor_checksum

    try:
        dev = f"{device}:{rank}" if device == "cuda" else device
        if device == "cuda":
            torch.cuda.set_device(rank)
        wire = torch.bfloat16 if scenario == "wire_bf16" else None  # a receiver whose engine runs bf16
        verify = "full" if scenario == "full" else "sampled"
        group = pair_group(rank, port_q, backend, timeout_s=5.0, device=dev, wire_dtype=wire, verify=verify)
        if rank == 0:
            if scenario == "silent":  # never sends: the receiver must time out, not hang
                time.sleep(8)
                q.put(("sender", "done"))
                return
            if scenario == "gone":  # goes away once the group is formed: the receiver fails at once
                q.put(("sender", "gone"))
                time.sleep(1.0)  # the queue's feeder thread delivers the message
                import os
                os._exit(0)
            for version, seed in ((1, 1), (2, 2)):
                weights = named(seed, dev, extra=(scenario == "mismatch" and version == 1))
                info = group.send(weights, version, bucket_bytes=1024)  # several buckets: the pipelined path
            sent = [t.to(wire) if wire is not None and t.is_floating_point() else t for _, t in named(2, dev)]
            q.put(("sender", (tensor_checksum(sent), info["perf/sync_gb"])))
        else:
            expect = [(n, tuple(t.shape), wire or t.dtype) for n, t in named(0, dev)]
            results = []
            for _ in range(2):
                t0 = time.time()
                try:
                    version, got = group.receive(expect)
                    results.append(("ok", version, tensor_checksum([t for _, t in got]),
                                    [str(t.dtype) for _, t in got], group.last_bytes))
                except WeightSyncError as e:
                    results.append(("refused", str(e), time.time() - t0))
                if scenario in ("silent", "gone"):
                    if scenario == "gone":  # the failed group was closed: the next update says so
                        try:
                            group.receive(expect)
                        except WeightSyncError as e:
                            results.append(("closed", str(e), group.pg is None))
                    break
            q.put(("receiver", results))
    except Exception as e:  # reported to the test, which fails with it
        q.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def bound_member(rank: int, ports: tuple, ifname: str, q) -> None:
    """A process whose gloo groups listen on 127.0.0.<2 + rank> (``bind_gloo``), or on ``ifname``'s
    address when GLOO_SOCKET_IFNAME names one: the learners' world (``init_process_group`` and a
    ``new_group``, as DeepSpeed makes them) and a weight-sync group; puts the addresses it listens on."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from actors.placement import listening_addresses
    from prorl_async.weight_sync import WeightSyncGroup, bind_gloo

    try:
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        bind_gloo(f"127.0.0.{2 + rank}")
        store = dist.TCPStore("127.0.0.1", ports[0], 2, is_master=rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        t = torch.ones(2)
        dist.all_reduce(t, group=dist.new_group([0, 1]))
        sync = WeightSyncGroup("127.0.0.1", ports[1], rank, 2, "gloo", timeout_s=30.0)
        q.put((rank, listening_addresses(), float(t[0])))
        dist.barrier()
        sync.close()
        dist.destroy_process_group()
    except Exception as e:  # pragma: no cover - reported to the test
        q.put((rank, f"error: {type(e).__name__}: {e}", 0.0))


def reform_member(rank: int, rounds: int, replaced: str, q, port_q) -> None:
    """Forms a weight-sync group ``rounds`` times in turn (one update through each), as a
    re-forming generator or learner does (each a :func:`pair_group`). The old group stays
    referenced (as a traceback or a pending work object can hold it) and is ``replaced`` by
    ``"close"`` (closed first) or ``"keep"`` (not closed); puts this process's open fds and
    listening sockets after each group."""
    import psutil

    from prorl_async.weight_sync import close_group

    try:
        me, seen, old = psutil.Process(), [], []
        group = None
        for k in range(rounds):
            if replaced == "close":
                close_group(group)
            old.append(group)
            group = pair_group(rank, port_q, timeout_s=30.0)
            if rank == 0:
                group.send(named(k), k + 1)
            else:
                group.receive()
            seen.append((me.num_fds(), sum(c.status == "LISTEN" for c in me.net_connections("tcp"))))
        close_group(group)
        q.put((rank, seen))
    except Exception as e:  # pragma: no cover - reported to the test
        q.put((rank, f"error: {type(e).__name__}: {e}"))
