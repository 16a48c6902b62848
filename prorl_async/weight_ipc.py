"""Same-device weight sync: handles to the learner's memory instead of a broadcast.

Backend ``ipc`` (:class:`IpcWeightSender` / :class:`IpcWeightReceiver`): when the learner and a
generator share one GPU (the one-GPU colocated setup), NCCL refuses two ranks on one device, so
the learner packs the same buckets as :class:`~prorl_async.weight_sync.WeightSyncGroup` (same
manifest, wire dtype and checksums) into a snapshot it owns and hands out *handles* to them
instead of bytes: ``torch.multiprocessing.reductions.reduce_tensor`` of each bucket, i.e. a CUDA
IPC handle for a CUDA bucket (as verl's and OpenRLHF's colocated engines do) and, by the same
mechanism, a shared-memory file for a CPU bucket (``file_system`` sharing: any process on the
host can open it by name). The payload is plain data (bytes, numbers, strings), so it travels
through Ray and through vLLM's ``collective_rpc`` to the worker process unchanged; the receiver
maps the buckets, checks manifest, checksums and finiteness exactly as after a broadcast, and copies them
into its engine. The sender keeps the snapshot alive until it is told every receiver answered
(:meth:`IpcWeightSender.release`); training may go on meanwhile, as it writes the parameters,
not the snapshot. Each receiver gets handles of its own (one sharing reference each), and a
handle names its device (GPU UUID, or the host for shared memory): a receiver on another device
raises :class:`WeightSyncError` naming the fix instead of mapping the wrong memory.
"""

from __future__ import annotations

import json
import pickle
import socket
import time
from typing import Optional, Sequence, Union

import torch

from prorl_async.weight_sync import (DEFAULT_BUCKET_BYTES, VERIFY_MODES, WeightSyncError, _as_dtype, _checksum,
                                     _manifest, _pack, _read_plan, _unpack, checksums_match, first_nonfinite,
                                     nonfinite_error, plan_buckets)


def device_key(device) -> str:
    """What two processes must share for a handle to map: the GPU (its UUID) or, for CPU
    shared memory, the host."""
    d = torch.device(device)
    if d.type == "cuda":  # pragma: no cover - needs a GPU
        index = d.index if d.index is not None else torch.cuda.current_device()
        return f"cuda:{torch.cuda.get_device_properties(index).uuid}"
    return f"host:{socket.gethostname()}"


def _local_cuda_index(key: str) -> Optional[int]:  # pragma: no cover - needs a GPU
    """This process's index of the GPU a handle names (CUDA_VISIBLE_DEVICES may renumber it)."""
    for i in range(torch.cuda.device_count()):
        if f"cuda:{torch.cuda.get_device_properties(i).uuid}" == key:
            return i
    return None


def share_tensor(t: torch.Tensor) -> bytes:
    """A handle to ``t``'s memory (no copy of the data): ``reduce_tensor`` pickled the way
    multiprocessing does, with CPU storage moved to a named shared-memory file."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp
    from torch.multiprocessing.reductions import reduce_tensor

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # named files: a process that is not our child can open them
    try:
        return bytes(ForkingPickler.dumps(reduce_tensor(t.detach())))
    finally:
        tmp.set_sharing_strategy(old)


def open_tensor(handle: bytes, key: str) -> torch.Tensor:
    """The tensor a :func:`share_tensor` handle names, mapped into this process (no copy)."""
    rebuild, args = pickle.loads(handle)
    if key.startswith("cuda:"):  # pragma: no cover - needs a GPU
        index = _local_cuda_index(key) if torch.cuda.is_available() else None
        if index is None:
            raise WeightSyncError(f"the learner's weights are on GPU {key[5:]}, which this process does not see; "
                                  "ipc weight sync needs learner and generator on the same GPU "
                                  "(ray.weight_sync_backend=nccl for separate GPUs)")
        args = list(args)
        args[6] = index  # rebuild_cuda_tensor's storage_device
    return rebuild(*args)


class IpcWeightSender:
    """The learner's side of a same-device sync to ``n_receivers`` receiving processes.

    ``device``: where the snapshot lives (the learner's device). ``wire_dtype``: the floating
    dtype the receivers announced (None: as the learner holds them)."""

    def __init__(self, n_receivers: int, device: str = "cpu", wire_dtype: Union[None, str, torch.dtype] = None,
                 verify: str = "sampled"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight sync verify must be one of {VERIFY_MODES}, got {verify!r}")
        if n_receivers < 1:
            raise ValueError(f"ipc weight sync needs at least one receiver, got {n_receivers}")
        self.n_receivers, self.device, self.verify = n_receivers, device, verify
        self.wire_dtype = _as_dtype(wire_dtype)
        self.key = device_key(device)
        self._held: dict[int, list[torch.Tensor]] = {}  # version -> snapshot buckets receivers may still map
        self.last_seconds = 0.0
        self.last_bytes = 0

    @property
    def held_versions(self) -> list[int]:
        return sorted(self._held)

    def send(self, named: Sequence[tuple[str, torch.Tensor]], version: int,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, wire_dtype: Union[None, str, torch.dtype] = "auto",
             verify: Optional[str] = None) -> tuple[dict, dict]:
        """Snapshot ``[(name, tensor)]`` as weights ``version``; returns (payload for the receivers,
        ``perf/sync_*`` metrics). The snapshot stays alive until :meth:`release`."""
        verify = verify or self.verify
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight sync verify must be one of {VERIFY_MODES}, got {verify!r}")
        wire = self.wire_dtype if wire_dtype == "auto" else _as_dtype(wire_dtype)
        full = verify == "full"
        t0 = time.perf_counter()
        shapes = [(n, tuple(t.shape), wire if (wire is not None and t.is_floating_point()) else t.dtype)
                  for n, t in named]
        buckets = plan_buckets(shapes, bucket_bytes)
        flats, checksums = [], []
        for k, b in enumerate(buckets):
            src = [named[i][1] for i in b]
            flat = _pack(src, shapes[b[0]][2], self.device)
            if len(src) == 1 and flat.untyped_storage().data_ptr() == src[0].untyped_storage().data_ptr():
                flat = flat.clone()  # a snapshot: the optimizer may step while receivers still read
            flats.append(flat)
            checksums.append(_checksum(flat, full, k))
        if self.device != "cpu" and torch.cuda.is_available():  # pragma: no cover - needs a GPU
            torch.cuda.current_stream().synchronize()  # packed before any receiver maps it
        handles = [[share_tensor(f) for f in flats] for _ in range(self.n_receivers)]
        self._held[int(version)] = flats
        payload = {"version": int(version), "device": self.key, "full": full, "checksums": checksums,
                   "manifest": json.dumps({"params": _manifest(shapes), "buckets": [len(b) for b in buckets]}),
                   "handles": handles}
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(f.numel() * f.element_size() for f in flats)
        return payload, {"perf/sync_s": self.last_seconds, "perf/sync_gb": self.last_bytes / 1e9,
                         "perf/sync_gbps": self.last_bytes / 1e9 / max(self.last_seconds, 1e-9)}

    def release(self, upto_version: Optional[int] = None) -> list[int]:
        """Drop the snapshots every receiver has answered for (all, or those up to a version)."""
        gone = [v for v in self._held if upto_version is None or v <= upto_version]
        for v in gone:
            del self._held[v]
        return sorted(gone)

    def close(self) -> None:
        self._held.clear()


class IpcWeightReceiver:
    """A receiving process of a same-device sync; ``rank`` (1..n) picks its handles."""

    def __init__(self, rank: int, device: str = "cpu", wire_dtype: Union[None, str, torch.dtype] = None):
        if rank < 1:
            raise ValueError(f"an ipc receiver's rank starts at 1, got {rank}")
        self.rank, self.device = rank, device
        self.wire_dtype = _as_dtype(wire_dtype)
        self.last_seconds = 0.0
        self.last_bytes = 0

    def receive(self, payload: dict, shapes: Optional[Sequence[tuple[str, tuple, torch.dtype]]] = None
                ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Map one snapshot; returns (version, [(name, tensor)]) after the manifest, checksum and
        finiteness checks (each failure raises :class:`WeightSyncError`). The tensors are views
        of the learner's memory: copy them before answering (the sender frees the snapshot once
        every receiver answered)."""
        t0 = time.perf_counter()
        version = int(payload["version"])
        m = json.loads(payload["manifest"])
        if self.rank > len(payload["handles"]):
            raise WeightSyncError(f"ipc weight sync: receiver rank {self.rank} has no handles "
                                  f"({len(payload['handles'])} receivers were planned); re-form the group")
        handles = payload["handles"][self.rank - 1]
        sent, buckets, error = _read_plan(m, len(handles), shapes)
        if error is not None:
            raise WeightSyncError(f"{error}; update to version {version} discarded")
        key = payload["device"]
        if key.startswith("host:") and key != device_key("cpu"):
            raise WeightSyncError(f"the learner's weights are in shared memory on {key[5:]}, not on this host; "
                                  "ipc weight sync needs learner and generator on one node (use gloo or nccl)")
        try:
            flats = [open_tensor(h, key) for h in handles]
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(f"cannot map weights version {version} from the learner ({e}); "
                                  "was the snapshot released before this receiver answered?") from e
        for k, (flat, b) in enumerate(zip(flats, buckets)):
            numel = sum(int(torch.Size(sent[i][1]).numel()) for i in b)
            if flat.numel() != numel or flat.dtype != sent[b[0]][2]:
                raise WeightSyncError(f"weight bucket {k} maps {flat.numel()} x {flat.dtype}, the manifest says "
                                      f"{numel} x {sent[b[0]][2]}; update to version {version} discarded")
            got, want = _checksum(flat, bool(payload["full"]), k), float(payload["checksums"][k])
            if not checksums_match([got], [want]):
                raise WeightSyncError(f"weight bucket checksum mismatch ({got:.0f} != {want:.0f}); "
                                      f"update to version {version} discarded")
        name = first_nonfinite(buckets, flats, sent)
        if name is not None:
            raise WeightSyncError(nonfinite_error(name, version))
        out = _unpack(buckets, flats, sent)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(f.numel() * f.element_size() for f in flats)
        return version, out

    def close(self) -> None:
        pass
