"""Versioned weight broadcast from learner rank 0 to every generator.

A dedicated, *stateless* torch.distributed process group on its own TCP store (not the
default world group, which the learner's data-parallel ranks may own): rank 0 is the
learner, ranks 1..G are generators. The backend is a parameter — gloo on CPU, NCCL on GPU —
and the code is the same. Every operation has a timeout, so a dead peer raises instead of
hanging forever (LESSONS: raw NCCL broadcasts that never return; OpenRLHF #533 and
open-instruct #1535 on sync time: one collective per bucket, never one RPC per parameter).

Protocol of one sync: rank 0 broadcasts a header ``[version, n_buckets, manifest_bytes,
full_check]`` (4 x float64), then the manifest (JSON ``{"params": [[name, shape, dtype], ...],
"buckets": [params per bucket, ...]}`` as uint8), then each bucket — a flat buffer of
same-dtype tensors in parameter order, one collective per bucket — and last the bucket
checksums (integers below 2^31, sent as float64 and compared exactly; each seeded with its
bucket's index, so buckets delivered in each other's place are refused). A receiver then refuses
an update holding a NaN or an infinity, so no engine ever loads one. The bucket plan travels
in the manifest, so a receiver needs no bucket size of its own, and a vLLM worker (whose
parameters are fused and repacked) needs no copy of the learner's layout; it checks the manifest against the layout it expects when
it has one, and a mismatch raises :class:`WeightSyncError` after draining the remaining
collectives (the group stays usable) with the old weights left in use.

The hot path is pipelined: up to four buckets are on the wire at once (asynchronous
collectives, run by the backend's own threads) while the sender packs and checks the next
one and the receiver checks the ones that have arrived. A tensor of 1 MiB or more is a
bucket of its own and, when contiguous and of the wire dtype, is sent in place without a
copy; only small tensors (norms, biases) are packed. The integrity check is *sampled* by
default — a position-weighted sum over every 251st 32-bit word of each bucket plus its word
count, which catches a wrong layout, a shifted or truncated buffer and gross corruption at
negligible cost (TCP and NCCL already check the bytes in transit) — and *full*, every word,
on demand (``verify="full"``, e.g. at the first sync or in tests), still overlapped with
the wire.

Wire dtype: a receiver announces the floating dtype its engine runs
(``WeightSyncGroup(..., wire_dtype=torch.bfloat16)``) in the group's store before the
group forms; when every receiver announces the same one, the sender casts floating tensors
to it while packing (``send(wire_dtype="auto")``), so an fp32 learner feeding a bf16 engine
moves half the bytes. The receiver gets the same bits it would get by casting on arrival
(round to nearest even either way).

The same-device transport (backend ``ipc``, one GPU shared by learner and generator) is in
:mod:`prorl_async.weight_ipc`; it uses this module's manifest, buckets and checksums.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024  # small tensors are packed into buckets of at most this
DIRECT_BYTES = 1 << 20  # a tensor at least this large is a bucket of its own, sent in place
IN_FLIGHT = 4  # collectives on the wire at once
VERIFY_MODES = ("sampled", "full")


class WeightSyncError(RuntimeError):
    pass


@contextmanager
def nccl_errors_raise() -> Iterator[None]:
    """For the NCCL groups made inside: a failed or timed-out collective aborts the communicator
    and raises (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, clean-up only), where torch's default tears
    the whole process down. A weight-sync peer that dies then costs a re-formed group, not the
    learner. Torch reads the variable when it makes a group, so other groups (the learners' own
    world) keep theirs; a value the user set wins."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ[key] = before or "2"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


def close_group(member) -> None:
    """Close a weight-sync member that is being replaced: a :class:`WeightSyncGroup` (its
    communicator, sockets and store), an IPC sender (the snapshots it holds); ``None``: nothing."""
    if member is not None:
        member.close()


def joined(receiver):
    """An engine's weight receiver (a :class:`WeightSyncGroup` or an IPC receiver), or one clear
    :class:`WeightSyncError` where the engine has none: its generator started again (Ray restarted
    it) after the group formed, and a sync reached it before the driver re-formed the group."""
    if receiver is None:
        raise WeightSyncError("this engine has not joined the weight-sync group (its generator was restarted "
                              "after the group formed); the group must be re-formed before the next update")
    return receiver


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now. Whoever binds it later may find it taken (another process picked it in
    between): where one process can listen at once, :func:`serve_store` has no such window."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


STORE_TIMEOUT = timedelta(minutes=10)  # a served store's calls: members joining, and their collectives' store use


def serve_store(host: str, timeout: timedelta = STORE_TIMEOUT) -> tuple[dist.TCPStore, int]:
    """A TCPStore server on a port the OS picks as it binds it, and that port: for a group whose
    members all join as clients (or whose rank 0 is handed the store); alive as long as the
    returned store is referenced."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, store.port


def bind_gloo(host: str) -> None:
    """Every gloo group this process makes from now on listens on ``host`` (its node's IP as Ray
    knows it; ``""`` undoes it): the groups torch makes (``init_process_group``, ``new_group``:
    the learners' world under DeepSpeed) and :class:`WeightSyncGroup`. Without it gloo listens on
    the address the machine's hostname resolves to, which is 127.0.1.1 on many Debian hosts and
    unreachable from the other nodes. ``GLOO_SOCKET_IFNAME``, torch's own setting (interface
    names), wins when set. Torch takes a device for the groups it makes from nowhere else, so the
    class ``distributed_c10d`` builds them with (``dist.ProcessGroupGloo`` stays torch's) is
    replaced by a subclass that passes one."""
    gloo = dist.ProcessGroupGloo

    class NodeGloo(dist.ProcessGroupGloo):
        def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
            if isinstance(timeout, gloo._Options) or len(os.environ.get("GLOO_SOCKET_IFNAME", "")) > 1:
                super().__init__(store, rank, size, timeout)  # torch reads GLOO_SOCKET_IFNAME itself
                return
            opts = gloo._Options()
            opts._devices = [gloo.create_device(hostname=host)]
            opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    distributed_c10d.ProcessGroupGloo = NodeGloo if host else gloo


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of one tensor of ``shape`` in ``dtype``."""
    return int(torch.Size(shape).numel()) * dtype.itemsize


def plan_buckets(shapes: Sequence[tuple[str, tuple, torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int = DIRECT_BYTES):
    """Group parameters (in order) into buckets of one dtype and at most ``bucket_bytes``; a
    tensor of ``direct_bytes`` or more is a bucket of its own (sent without a copy when it is
    contiguous and already of the wire dtype)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_bytes, cur_dtype = 0, None
    for i, (_, shape, dtype) in enumerate(shapes):
        size = nbytes(shape, dtype)
        if size >= direct_bytes:
            if cur:
                buckets.append(cur)
                cur, cur_bytes = [], 0
            buckets.append([i])
            continue
        if cur and (dtype != cur_dtype or cur_bytes + size > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += size
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return buckets


def _manifest(shapes) -> list:
    return [[n, [int(d) for d in shape], str(dtype).removeprefix("torch.")] for n, shape, dtype in shapes]


def _from_manifest(m: list) -> list[tuple[str, tuple, torch.dtype]]:
    return [(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in m]


def _read_plan(m: dict, n_buckets: int, shapes) -> tuple[list, list[list[int]], Optional[str]]:
    """A receiver's reading of the sender's manifest: (params as sent, parameter indices per bucket,
    the reason to refuse the update or None). ``n_buckets`` is how many buckets the sender said it
    sends; ``shapes`` the receiver's expected layout (None accepts the sender's)."""
    sent = _from_manifest(m["params"])
    bounds = [0]
    for count in m["buckets"]:
        bounds.append(bounds[-1] + count)
    buckets = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    if n_buckets != len(buckets) or bounds[-1] != len(sent):
        return sent, buckets, f"corrupt weight-sync manifest ({n_buckets} buckets sent, {len(buckets)} planned)"
    if shapes is not None and _manifest(shapes) != _manifest(sent):
        diff = next(((a, b) for a, b in zip(_manifest(shapes), _manifest(sent)) if a != b),
                    (len(shapes), len(sent)))
        return sent, buckets, (f"learner and generator models differ (expected/received: {diff[0]} / {diff[1]}); "
                               "a dtype difference means the receiver must announce its dtype (wire_dtype)")
    return sent, buckets, None


def _as_dtype(d: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if d is None or isinstance(d, torch.dtype):
        return d
    dt = getattr(torch, str(d).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"wire_dtype must be a floating torch dtype such as 'bfloat16', got {d!r}")
    return dt


_CHECKSUM_MOD = 2_147_483_647  # 2^31 - 1: values stay exact in the float64 header
_CHUNK = 1 << 18  # words per chunk of the full checksum: int64 temporaries stay in cache
_STRIDE = 251  # the sampled checksum reads every 251st word (a prime: no alignment with row sizes)
_WEIGHTS: dict = {}


def _words(flat: torch.Tensor) -> torch.Tensor:
    raw = flat.detach().contiguous().reshape(-1)
    return raw.view(torch.int32) if (raw.numel() * raw.element_size()) % 4 == 0 else raw.view(torch.int16)


def _weights(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)
    return _WEIGHTS[key]


def _checksum(flat: torch.Tensor, full: bool = True, position: int = 0) -> int:
    """Position-sensitive checksum of the raw bits, in integer arithmetic (exact, cheap).

    The buffer is read as 32-bit words (16-bit when its size demands it); each chunk's words
    are weighted by their position in the chunk and summed in int64 (wrap-around is modular,
    so the result does not depend on summation order or device), and the chunk sums are
    chained mod 2^31 - 1. ``full=False`` reads every 251st word and the last one (0.4% of the
    bytes), each weighted by its position in the buffer, plus the word count.
    ``position`` (the buffer's index among those of one update) seeds the chain, so the same
    bytes at another index check differently: two same-shape buckets or tensors delivered in
    each other's place are refused even when their checksums travel swapped with them.
    """
    words = _words(flat)
    n = words.numel()
    total = (position * 1_000_003 + n) % _CHECKSUM_MOD
    if not full:
        idx = torch.arange(0, n, _STRIDE, dtype=torch.int64, device=words.device)
        if n and int(idx[-1]) != n - 1:
            idx = torch.cat([idx, idx.new_tensor([n - 1])])
        s = int((words[idx].to(torch.int64) * (idx % _CHECKSUM_MOD + 1)).sum())
        return (total * 1_000_003 + s % _CHECKSUM_MOD) % _CHECKSUM_MOD
    weights = _weights(words.device)
    for start in range(0, n, _CHUNK):
        w = words[start:start + _CHUNK]
        s = int((w.to(torch.int64) * weights[:w.numel()]).sum())
        total = (total * 1_000_003 + s % _CHECKSUM_MOD) % _CHECKSUM_MOD
    return total


def all_finite(tensors) -> bool:
    """Whether every value of ``tensors`` is finite, in one summing pass per tensor: a NaN or an
    infinity makes the sum non-finite, so only a tensor whose sum is not finite (a bad value, or
    finite values whose sum overflows) is checked value by value. ``isfinite(t).all()`` on every
    tensor writes a bool per value first: 1.0 s for 0.85 GB of fp32 here, the sums 0.04 s."""
    for t in tensors:
        if not t.is_floating_point():
            continue
        if not torch.isfinite(t.sum(dtype=torch.float32)) and not bool(torch.isfinite(t).all()):
            return False
    return True


def tensor_checksum(tensors) -> int:
    """Full checksum of a list of tensors in order (learner and generator compare theirs): each
    tensor's checksum is taken at its index and chained mod 2^31 - 1, so two same-shape tensors
    in each other's place give another value."""
    return chain_checksums(_checksum(t.detach().reshape(-1), True, i) for i, t in enumerate(tensors))


def chain_checksums(per_tensor) -> int:
    """One checksum from per-tensor checksums taken at their indices (``_checksum(t, True, i)``),
    in index order: what :func:`tensor_checksum` returns for those tensors."""
    total = 0
    for c in per_tensor:
        total = (total * 1_000_003 + c) % _CHECKSUM_MOD
    return total


def first_nonfinite(buckets, flats, sent) -> Optional[str]:
    """The name of the first received tensor holding a NaN or an infinity, or None: one
    :func:`all_finite` pass per bucket, and a tensor-by-tensor pass only in a bucket that fails."""
    for b, flat in zip(buckets, flats):
        if not all_finite([flat]):
            return next(name for name, t in _unpack([b], [flat], sent) if not all_finite([t]))
    return None


def nonfinite_error(name: str, version: int) -> str:
    return (f"weights of version {version} hold non-finite values (NaN or inf in {name}): the learner diverged "
            "(lower train.lr or check the loss for NaN); update discarded, the previous weights stay in use")


def checksums_match(got: Sequence[float], expected: Sequence[float]) -> bool:
    """Whether received bucket checksums equal the sender's: exactly, as they are integers below
    2^31 that float64 holds without rounding (a tolerance would pass a flipped low bit)."""
    return len(got) == len(expected) and all(int(g) == int(e) for g, e in zip(got, expected))


def on_device(have: torch.device, device) -> bool:
    """Whether a tensor on ``have`` already lives on ``device``. A tensor's CUDA device always
    carries its index (``cuda:0``) while ``"cuda"`` names the current GPU, and
    ``torch.device("cuda:0") == torch.device("cuda")`` is False: a missing index is read as the
    current device's."""
    want = torch.device(device)
    if want.type != have.type:
        return False
    if want.index is None:
        return want.type != "cuda" or have.index == torch.cuda.current_device()
    return want.index == have.index


def _pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """One flat buffer of ``dtype`` on ``device`` holding ``tensors`` in order; no copy when it
    is a single contiguous tensor already of that dtype and device."""
    if len(tensors) == 1:
        t = tensors[0].detach()
        if t.dtype == dtype and t.is_contiguous() and on_device(t.device, device):
            return t.reshape(-1)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset:offset + n].copy_(t.detach().reshape(-1))  # casts to the wire dtype in the same pass
        offset += n
    return out


def _empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Receive buffer (the one place a receiver allocates)."""
    return torch.empty(numel, dtype=dtype, device=device)


class WeightSyncGroup:
    """One member of the weight-sync group. ``rank == 0`` sends, the others receive.

    ``wire_dtype`` (receivers): the floating dtype this receiver's engine runs, announced to
    the sender so that it casts before sending (``None``: take what is sent).
    ``verify``: ``"sampled"`` (default) or ``"full"`` integrity check; the sender's choice,
    carried in the header, is what every receiver applies.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, group_name: str = "prorl-weight-sync",
                 device: str = "cpu", wire_dtype: Union[None, str, torch.dtype] = None,
                 verify: str = "sampled", store: Optional[dist.Store] = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight sync verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        self.verify = verify
        self.wire_dtype = _as_dtype(wire_dtype)
        self.timeout = timedelta(seconds=timeout_s)
        try:  # ``store``: the one already listening at host:port (:func:`serve_store`), handed to rank 0
            store = store or dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=self.timeout,
                                           wait_for_workers=False)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" in str(e):
                raise WeightSyncError(f"weight-sync port {port} on {host} is already in use; set "
                                      "ray.weight_sync_port to a free port, or 0 to pick one") from None
            raise WeightSyncError(f"cannot reach the weight-sync store at {host}:{port}: {e}") from e
        store = dist.PrefixStore(group_name, store)
        self._store = store
        if rank != 0:  # announced before the group forms, so the sender can read it once formed
            store.set(f"wire_dtype/{rank}", str(self.wire_dtype or "none").removeprefix("torch."))
        if backend == "gloo":  # on the node's address once bind_gloo was called
            self.pg = distributed_c10d.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:  # pragma: no cover - needs GPUs
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            with nccl_errors_raise():
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        self._receiver_dtype: Optional[tuple] = None
        self.last_seconds = 0.0
        self.last_bytes = 0

    def _failed(self, began: float, e: Exception) -> WeightSyncError:
        """The error of a failed broadcast: how long it ran, against the timeout (a peer that went away
        fails it at once, a peer that never came at the timeout). The group is closed here (an NCCL
        communicator aborted at once, not left to the watchdog): no collective can run on it again."""
        took = time.monotonic() - began
        self.close()
        return WeightSyncError(f"weight broadcast failed after {took:.1f} s "
                               f"(timeout {self.timeout.total_seconds():.0f} s): {e}")

    def _check_open(self) -> None:
        if self.pg is None:
            raise WeightSyncError("this weight-sync group was closed (a broadcast on it failed, or it was "
                                  "replaced); the group must be re-formed before the next update")

    def _start(self, t: torch.Tensor):
        self._check_open()
        began = time.monotonic()
        try:
            return self.pg.broadcast(t, 0, self.timeout)
        except RuntimeError as e:
            raise self._failed(began, e) from e

    def _wait(self, work) -> None:
        began = time.monotonic()
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:  # gloo raises on timeout or a peer that went away
            raise self._failed(began, e) from e
        if not ok:
            raise WeightSyncError(f"weight broadcast timed out (timeout {self.timeout.total_seconds():.0f} s)")

    def _bcast(self, t: torch.Tensor) -> None:
        self._wait(self._start(t))

    def receivers_wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype every receiver announced, or None when they differ or announced none."""
        if self._receiver_dtype is None:
            got = {self._store.get(f"wire_dtype/{r}").decode() for r in range(1, self.world_size)}
            one = got.pop() if len(got) == 1 else "none"
            self._receiver_dtype = (None if one == "none" else getattr(torch, one),)
        return self._receiver_dtype[0]

    # ------------------------------------------------------------------ sender
    def send(self, named: Sequence[tuple[str, torch.Tensor]], version: int,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, wire_dtype: Union[None, str, torch.dtype] = "auto",
             verify: Optional[str] = None) -> dict:
        """Broadcast ``[(name, tensor)]`` as weights ``version``; returns ``perf/sync_*`` metrics.

        ``wire_dtype``: ``"auto"`` casts floating tensors to the dtype the receivers announced
        (none announced: sent as they are), a dtype forces it, ``None`` never casts.
        ``verify``: ``"sampled"`` / ``"full"`` for this sync (default: the group's).
        """
        assert self.rank == 0, "only rank 0 sends"
        self._check_open()
        verify = verify or self.verify
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight sync verify must be one of {VERIFY_MODES}, got {verify!r}")
        wire = self.receivers_wire_dtype() if wire_dtype == "auto" else _as_dtype(wire_dtype)
        full = verify == "full"
        t0 = time.perf_counter()
        shapes = [(n, tuple(t.shape), wire if (wire is not None and t.is_floating_point()) else t.dtype)
                  for n, t in named]
        buckets = plan_buckets(shapes, bucket_bytes)
        manifest = json.dumps({"params": _manifest(shapes), "buckets": [len(b) for b in buckets]}).encode()
        manifest = torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(self.device)
        header = torch.tensor([float(version), float(len(buckets)), float(manifest.numel()), float(full)],
                              dtype=torch.float64, device=self.device)
        self._bcast(header)
        self._bcast(manifest)
        checksums, sent, inflight = [], 0, []
        for k, b in enumerate(buckets):  # pack and check the next bucket while earlier ones are on the wire
            flat = _pack([named[i][1] for i in b], shapes[b[0]][2], self.device)
            checksums.append(_checksum(flat, full, k))
            sent += flat.numel() * flat.element_size()
            if len(inflight) >= IN_FLIGHT:
                self._wait(inflight.pop(0))
            inflight.append(self._start(flat))
        for work in inflight:
            self._wait(work)
        self._bcast(torch.tensor(checksums or [0.0], dtype=torch.float64, device=self.device))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sent
        return {"perf/sync_s": self.last_seconds, "perf/sync_gb": self.last_bytes / 1e9,
                "perf/sync_gbps": self.last_bytes / 1e9 / max(self.last_seconds, 1e-9)}

    # ------------------------------------------------------------------ receiver
    def receive(self, shapes: Optional[Sequence[tuple[str, tuple, torch.dtype]]] = None
                ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receive one full set of weights; returns (version, [(name, tensor)]) after checks.

        ``shapes`` is the layout this receiver expects (``[(name, shape, dtype)]``); the
        sender's manifest (names, shapes, wire dtypes) must equal it. ``None`` accepts the
        sender's layout as sent. The tensors are views into the received buckets. Raises
        :class:`WeightSyncError` (nothing returned, so the caller's weights stay in use) on a
        manifest or checksum mismatch and on a NaN or an infinity in any received value.
        """
        assert self.rank != 0, "rank 0 sends"
        self._check_open()
        t0 = time.perf_counter()
        header = torch.zeros(4, dtype=torch.float64, device=self.device)
        self._bcast(header)
        version, n_buckets, m_bytes, full = (int(x) for x in header[:4].tolist())
        manifest = torch.zeros(m_bytes, dtype=torch.uint8, device=self.device)
        self._bcast(manifest)
        m = json.loads(manifest.cpu().numpy().tobytes().decode())
        sent, buckets, error = _read_plan(m, n_buckets, shapes)
        flats = [_empty(sum(int(torch.Size(sent[i][1]).numel()) for i in b), sent[b[0]][2], self.device)
                 for b in buckets]
        got: list[float] = []
        inflight: list = []
        for k, flat in enumerate(flats):  # check earlier buckets while the next ones arrive
            inflight.append((self._start(flat), flat))  # drained even after an error: the group stays in step
            if len(inflight) > IN_FLIGHT:
                work, done = inflight.pop(0)
                self._wait(work)
                if error is None:
                    got.append(_checksum(done, bool(full), len(got)))
        for work, done in inflight:
            self._wait(work)
            if error is None:
                got.append(_checksum(done, bool(full), len(got)))
        expected = torch.zeros(max(1, len(buckets)), dtype=torch.float64, device=self.device)
        self._bcast(expected)
        if error is None:
            bad = [(g, e) for g, e in zip(got, expected.tolist()) if not checksums_match([g], [e])]
            error = f"weight bucket checksum mismatch ({bad[0][0]:.0f} != {bad[0][1]:.0f})" if bad else None
        if error is not None:
            raise WeightSyncError(f"{error}; update to version {version} discarded")
        name = first_nonfinite(buckets, flats, sent)
        if name is not None:
            raise WeightSyncError(nonfinite_error(name, version))
        out = _unpack(buckets, flats, sent)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(f.numel() * f.element_size() for f in flats)
        return version, out

    def close(self) -> None:
        """End this member's part of the group, for good (idempotent): an NCCL communicator is
        aborted first (a peer may be gone mid-collective: waiting for it would hang), then the
        group is shut down and its store released (rank 0's listener closes with its last
        reference). Called on re-forming a group, so each re-form does not leak a communicator,
        its sockets and a store listener."""
        pg, self.pg, self._store = self.pg, None, None
        if pg is None:
            return
        for name in (("abort", "shutdown") if self.backend == "nccl" else ("shutdown",)):
            try:
                getattr(pg, name, lambda: None)()
            except Exception:  # noqa: BLE001 - a group already broken by its peer; nothing else to free
                pass


def _unpack(buckets, flats, sent) -> list[tuple[str, torch.Tensor]]:
    """Views of each received flat bucket as the named tensors of the manifest ``sent``."""
    out: list[tuple[str, torch.Tensor]] = []
    for b, flat in zip(buckets, flats):
        offset = 0
        for i in b:
            name, shape, _ = sent[i]
            n = int(torch.Size(shape).numel())
            out.append((name, flat[offset:offset + n].view(shape)))
            offset += n
    return out
