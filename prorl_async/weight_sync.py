"""Versioned weight broadcast from learner rank 0 to every generator.

A dedicated, *stateless* torch.distributed process group on its own TCP store (not the
default world group, which the learner's data-parallel ranks may own): rank 0 is the
learner, ranks 1..G are generators. The backend is a parameter — gloo on CPU, NCCL on GPU —
and the code is the same. Every operation has a timeout, so a dead peer raises instead of
hanging forever (LESSONS: raw NCCL broadcasts that never return).

Protocol of one sync: rank 0 broadcasts a header ``[version, n_buckets, manifest_bytes,
checksum_0, ...]`` (float64), then the manifest (JSON ``[[name, shape, dtype], ...]`` as
uint8), then each bucket, a flat buffer of same-dtype tensors packed in parameter order
(one collective per bucket, not per parameter). A receiver learns names, shapes and dtypes
from the manifest (so a vLLM worker, whose own parameters are fused and repacked, needs no
copy of the learner's layout), checks it against the layout it expects when it has one,
unpacks into its own staging buffers, recomputes each checksum, and only then reports the
new version; a mismatch raises :class:`WeightSyncError` after draining the remaining
buckets (so the group stays usable) and leaves the old weights in use.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class WeightSyncError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_buckets(shapes: Sequence[tuple[str, tuple, torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Group parameters (in order) into buckets of one dtype and at most ``bucket_bytes``."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_bytes, cur_dtype = 0, None
    for i, (_, shape, dtype) in enumerate(shapes):
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if cur and (dtype != cur_dtype or cur_bytes + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return buckets


def _manifest(shapes) -> list:
    return [[n, [int(d) for d in shape], str(dtype).removeprefix("torch.")] for n, shape, dtype in shapes]


def _from_manifest(m: list) -> list[tuple[str, tuple, torch.dtype]]:
    return [(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in m]


_CHECKSUM_MOD = 2_147_483_647  # 2^31 - 1: values stay exact in the float64 header
_CHUNK = 1 << 22
_WEIGHTS: dict = {}


def _checksum(flat: torch.Tensor) -> float:
    """Position-sensitive checksum of the raw bits, in integer arithmetic (exact, cheap).

    The buffer is read as 32-bit words (16-bit when its size demands it); each chunk's words
    are weighted by their position in the chunk and summed in int64 (wrap-around is modular,
    so the result does not depend on summation order or device), and the chunk sums are
    chained mod 2^31 - 1. Far cheaper than a float64 ``sum(x * sin(i))``; fp32 and bf16 alike.
    """
    raw = flat.detach().contiguous().reshape(-1)
    words = raw.view(torch.int32) if (raw.numel() * raw.element_size()) % 4 == 0 else raw.view(torch.int16)
    key = (words.device.type, words.device.index)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=words.device)
    weights = _WEIGHTS[key]
    total = words.numel() % _CHECKSUM_MOD
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK]
        s = int((w.to(torch.int64) * weights[:w.numel()]).sum())
        total = (total * 1_000_003 + s % _CHECKSUM_MOD) % _CHECKSUM_MOD
    return float(total)


def tensor_checksum(tensors) -> float:
    """Checksum over a list of tensors (used by tests to compare learner and generator)."""
    return sum(_checksum(t.detach().reshape(-1)) for t in tensors)


class WeightSyncGroup:
    """One member of the weight-sync group. ``rank == 0`` sends, the others receive."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, group_name: str = "prorl-weight-sync",
                 device: str = "cpu"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        self.timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=self.timeout,
                                  wait_for_workers=False)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" in str(e):
                raise WeightSyncError(f"weight-sync port {port} on {host} is already in use; set "
                                      "ray.weight_sync_port to a free port, or 0 to pick one") from None
            raise WeightSyncError(f"cannot reach the weight-sync store at {host}:{port}: {e}") from e
        store = dist.PrefixStore(group_name, store)
        self._store = store
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:  # pragma: no cover - needs GPUs
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        self.last_seconds = 0.0
        self.last_bytes = 0

    def _bcast(self, t: torch.Tensor) -> None:
        try:
            work = self.pg.broadcast(t, 0, self.timeout)
            ok = work.wait(self.timeout)
        except RuntimeError as e:  # gloo raises on timeout or a peer that went away
            raise WeightSyncError(f"weight broadcast failed (timeout {self.timeout}): {e}") from e
        if not ok:
            raise WeightSyncError(f"weight broadcast timed out after {self.timeout}")

    # ------------------------------------------------------------------ sender
    def send(self, named: Sequence[tuple[str, torch.Tensor]], version: int,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        assert self.rank == 0, "only rank 0 sends"
        t0 = time.perf_counter()
        shapes = [(n, tuple(t.shape), t.dtype) for n, t in named]
        buckets = plan_buckets(shapes, bucket_bytes)
        flats = [torch.cat([named[i][1].detach().reshape(-1) for i in b]).to(self.device) for b in buckets]
        manifest = torch.frombuffer(bytearray(json.dumps(_manifest(shapes)).encode()), dtype=torch.uint8)
        header = torch.tensor([float(version), float(len(flats)), float(manifest.numel())]
                              + [_checksum(f) for f in flats], dtype=torch.float64, device=self.device)
        size = torch.tensor([float(header.numel())], dtype=torch.float64, device=self.device)
        self._bcast(size)
        self._bcast(header)
        self._bcast(manifest.to(self.device))
        for f in flats:
            self._bcast(f)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(f.numel() * f.element_size() for f in flats)
        return {"perf/sync_s": self.last_seconds, "perf/sync_gb": self.last_bytes / 1e9,
                "perf/sync_gbps": self.last_bytes / 1e9 / max(self.last_seconds, 1e-9)}

    # ------------------------------------------------------------------ receiver
    def receive(self, shapes: Optional[Sequence[tuple[str, tuple, torch.dtype]]] = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receive one full set of weights; returns (version, [(name, tensor)]) after checks.

        ``shapes`` is the layout this receiver expects (``[(name, shape, dtype)]``); the
        sender's manifest must equal it. ``None`` accepts the sender's layout as sent.
        """
        assert self.rank != 0, "rank 0 sends"
        t0 = time.perf_counter()
        size = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._bcast(size)
        header = torch.zeros(int(size.item()), dtype=torch.float64, device=self.device)
        self._bcast(header)
        version, n_buckets, m_bytes = (int(x) for x in header[:3].tolist())
        manifest = torch.zeros(m_bytes, dtype=torch.uint8, device=self.device)
        self._bcast(manifest)
        sent = _from_manifest(json.loads(manifest.cpu().numpy().tobytes().decode()))
        buckets = plan_buckets(sent, bucket_bytes)
        error = None
        if n_buckets != len(buckets):
            error = (f"sender has {n_buckets} weight buckets, its manifest plans {len(buckets)}: "
                     "learner and generator use different weight_sync bucket sizes")
        elif shapes is not None and _manifest(shapes) != _manifest(sent):
            diff = next(((a, b) for a, b in zip(_manifest(shapes), _manifest(sent)) if a != b),
                        (len(shapes), len(sent)))
            error = f"learner and generator models differ (expected/received: {diff[0]} / {diff[1]})"
        out: list[tuple[str, torch.Tensor]] = []
        for b, expected in zip(buckets, header[3:].tolist()):
            numel = sum(int(torch.Size(sent[i][1]).numel()) for i in b)
            flat = torch.empty(numel, dtype=sent[b[0]][2], device=self.device)
            self._bcast(flat)  # drained even after an error, so the group stays in step
            if error is not None:
                continue
            got = _checksum(flat)
            if not (abs(got - expected) <= 1e-6 * max(1.0, abs(expected))):
                error = f"weight bucket checksum mismatch ({got} != {expected})"
                continue
            offset = 0
            for i in b:
                name, shape, _ = sent[i]
                n = int(torch.Size(shape).numel())
                out.append((name, flat[offset:offset + n].view(shape)))
                offset += n
        if error is not None:
            raise WeightSyncError(f"{error}; update to version {version} discarded")
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in out)
        return version, out

    def close(self) -> None:
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:
            pass
        self.pg = None
