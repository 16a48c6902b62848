"""``train.reuse_freed_memory``: a CPU learner reuses freed memory instead of fresh pages.

glibc's ``malloc`` serves every block above its mmap threshold (at most 32 MiB on 64-bit
Linux) with a fresh ``mmap`` and unmaps it on ``free``; the next block of that size is faulted
in again, page by page, each page zero-filled by the kernel. A CPU learner step allocates
hundreds of such blocks: the chunked LM head's ``[chunk, vocab]`` fp32 logits (200 MB at 1,024
x 49,152), their exp / softmax / gradient temporaries, the fp32 gradient of the head weight.
On this project's 2-core Xeon the page faults cost a SmolLM2-135M bf16 learner step about a
third of its time (benchmarks/RESULTS.md, "SmolLM2-135M full learner step").

``mallopt(M_MMAP_MAX, 0)`` serves large blocks from the heap, and a trim threshold of 2 GiB (the
largest ``mallopt`` takes) keeps what is freed there for the next allocation: after the first step the process holds the
step's peak and reuses it, which is what jemalloc and tcmalloc (the allocators PyTorch's CPU
performance guide recommends) do for a steady loop, with the allocator already in the process.
Costs: resident memory stays at the step's peak instead of shrinking between steps, and the
first rounds of a repeated allocation may still fault while torch's aligned blocks fragment the
heap (a repeated 64 MiB block: 1 or 8 rounds; a SmolLM2 step: 2 steps). Only the
calling process changes (a CPU learner's actor; each rank of a learner group sets its own);
a GPU learner's tensors are not host memory and it keeps the default. Values:
:data:`prorl_async.config.REUSE_FREED_MEMORY_CHOICES`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from prorl_async import machine

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults
KEEP_BYTES = 2**31 - 1  # trim threshold: hand the heap's top back only above 2 GiB free


def reuse_applies(setting: str, device) -> bool:
    """Whether ``train.reuse_freed_memory = setting`` changes the allocator of a learner on ``device``."""
    return setting == "always" or (setting == "auto" and torch.device(device).type == "cpu")


@functools.cache
def _glibc():
    """glibc's ``mallopt`` (``None`` on a C library without it, e.g. musl or macOS)."""
    lib = machine.glibc()
    if lib is None:
        return None
    fn = lib.mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


_applied = False  # this process's allocator was switched by reuse_freed_memory


def reuse_freed_memory() -> bool:
    """Large blocks from the heap, kept after ``free`` (module docstring), for this process;
    whether the allocator took the setting (False without glibc: nothing changes)."""
    global _applied
    mallopt = _glibc()
    if mallopt is None:
        return False
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    return _applied


def configure(setting: str, device) -> bool:
    """A learner's start-up: :func:`reuse_freed_memory` when ``train.reuse_freed_memory = setting``
    applies on ``device``; whether this process now keeps freed blocks."""
    return reuse_applies(setting, device) and reuse_freed_memory()


def restore_default() -> None:
    """glibc's defaults again (large blocks mapped and unmapped; the heap's top trimmed above
    128 KiB) if :func:`reuse_freed_memory` changed them: for a process that built a learner and
    goes on to other work, e.g. a test run. A process it never changed is left alone (setting
    either value would also end glibc's dynamic mmap threshold)."""
    global _applied
    mallopt = _glibc()
    if _applied and mallopt is not None:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        _applied = False
