"""Does a weight update fit where it is received? Checked once, when a receiver joins.

A receiver holds a whole update before it applies it (the buckets of a group sync, the staged
copy of the HF engine or of a vLLM worker that is mid-request), outside what the engine itself
reserved: vLLM's ``gpu_memory_utilization`` on a GPU, the model and KV cache in RAM on a CPU.
A layout whose update does not fit would run out of memory at the first sync, after the
generator has loaded, profiled and generated; this check refuses it when the group forms, with
the numbers and the setting to change.
"""

from __future__ import annotations

from typing import Sequence

import torch

from prorl_async.weight_sync import WeightSyncError, nbytes


def update_bytes(shapes: Sequence[tuple[str, tuple, torch.dtype]]) -> int:
    """Bytes of one update as received: every tensor of ``[(name, shape, wire dtype)]``."""
    return sum(nbytes(shape, dtype) for _, shape, dtype in shapes)


def free_bytes(device: str) -> int:
    """Memory free now on ``device``: the GPU's free memory (after what its engine reserved), or
    the RAM available on this node for ``cpu``."""
    if device.startswith("cuda"):  # pragma: no cover - needs a GPU (tests/test_gpu.py)
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    import psutil

    return int(psutil.virtual_memory().available)


def check_update_fits(shapes: Sequence[tuple[str, tuple, torch.dtype]], device: str, copies: int,
                      what: str) -> int:
    """Refuse a receiver whose ``copies`` of one update do not fit in what ``device`` has free;
    returns the bytes it needs. ``what``: the receiver, named in the error."""
    need = copies * update_bytes(shapes)
    free = free_bytes(device)
    if need > free:
        fix = ("lower rollout.gpu_memory_utilization (vLLM's share of the GPU) so the update fits beside it"
               if device.startswith("cuda") else
               "give the generator's node more memory, or fewer actors on it (rollout.generator_resources)")
        raise WeightSyncError(
            f"{what}: a weight update needs {need / 1e9:.2f} GB on {device} ({copies} x {len(shapes)} tensors, "
            f"{update_bytes(shapes) / 1e9:.2f} GB each, held until applied) and {free / 1e9:.2f} GB is free; {fix}")
    return need
