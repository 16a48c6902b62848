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
heap (a repeated 64 MiB block: 1 or 8 rounds; a SmolLM2 step: 2 steps). With packed batches of
a different shape every step the fragmentation does not settle: in a SmolLM2 bf16 learner the
memory free inside the heap went 1.7 -> 5.2 GB over 20 steps while what was in use stayed
2.9-3.2 GB, and a 250-step run's learner grew 5.7 -> 14.6 GB. So after each step
(:func:`bound_free_heap`) the heap's free pages go back to the OS once the resident memory
beyond what is in use passes ``train.reuse_freed_memory_gb``; the next step faults those pages
in again (after every step: 5% of a SmolLM2 learner's time alone on the AMD machine,
benchmarks/bench_learner_memory.py). Only the
calling process changes (a CPU learner's actor; each rank of a learner group sets its own);
a GPU learner's tensors are not host memory and it keeps the default. Values:
:data:`prorl_async.config.REUSE_FREED_MEMORY_CHOICES`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

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


#: The caches of compiled matmul kernels in a CPU learner's process, each keyed by the matmul's
#: shape: oneDNN's primitive cache and that of ideep (PyTorch's oneDNN wrapper, behind bf16 matmuls
#: on a CPU with AVX-512 bf16 or AMX). Each reads its capacity from the environment once, at the
#: process's first oneDNN matmul; both default to 1024 entries.
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def kernel_cache_env(entries: int, on_gpu: bool) -> dict[str, str]:
    """``train.kernel_cache_entries``: the variables that hold each cache of
    :data:`KERNEL_CACHE_ENV` to ``entries`` kernels in a CPU learner's process, for its actor's
    runtime env (set before the process starts; an in-process learner leaves its caller's
    environment alone, which child processes would inherit). Nothing for 0, a GPU learner, or a
    variable the user exported (the actor inherits that one).

    A packed batch has a new token count every step, so every step compiles new kernels, and the
    caches keep them until their 1024 entries are full: a SmolLM2 bf16 learner's heap in use grew
    12-17 MB a step and levelled off about 0.7 GB higher after some 60 steps (the sixth and seventh
    runs of docs/prorl_in_miniature.md). A step reuses its kernels across layers, which a few
    dozen entries keep."""
    if entries <= 0 or on_gpu:
        return {}
    return {name: str(entries) for name in KERNEL_CACHE_ENV if name not in os.environ}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_counters() -> Optional[dict[str, int]]:
    """glibc's ``mallinfo2`` counters of this process, all arenas, by field name (``uordblks``:
    allocated from the heap, ``fordblks``: freed and still held, ``hblkhd``: in mmapped blocks);
    ``None`` where the C library has none (not glibc, or glibc before 2.33)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return {name: int(getattr(info, name)) for name, _ in _MallInfo2._fields_}


def heap_bytes() -> Optional[tuple[int, int]]:
    """``(in_use, free)`` bytes of this process's malloc heap (:func:`heap_counters`'
    ``uordblks``, ``fordblks``); ``None`` without ``mallinfo2``."""
    counters = heap_counters()
    return None if counters is None else (counters["uordblks"], counters["fordblks"])


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2`` (``None`` without it), its signature set once."""
    lib = machine.glibc()
    fn = getattr(lib, "mallinfo2", None) if lib is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = [], _MallInfo2
    return fn


def resident_bytes() -> Optional[int]:
    """This process's resident memory (``/proc/self/statm``); ``None`` off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def bound_free_heap(limit_gb: float) -> dict[str, float]:
    """A learner step's end in a process that keeps freed blocks (:func:`reuse_freed_memory`):
    when the resident memory beyond what the heap has in use passes ``limit_gb`` (what is
    kept free for reuse, plus the process's code and other mappings), the heap's free pages go
    back to the OS (``malloc_trim(0)``: also those below blocks still in use, which the trim
    threshold never reaches). Metrics (``perf/``: measurements of the machine, which a resumed or
    replayed step does not reproduce): ``perf/heap_rss_gb``, ``perf/heap_in_use_gb`` (both before
    a trim) and ``perf/heap_trimmed`` (1 when this step's end trimmed); none where nothing is
    kept or the C library cannot say."""
    usage = heap_bytes() if _applied else None
    rss = resident_bytes() if usage is not None else None
    if usage is None or rss is None:
        return {}
    trimmed = rss - usage[0] > limit_gb * 1e9 and machine.release_freed_heap()
    return {"perf/heap_rss_gb": rss / 1e9, "perf/heap_in_use_gb": usage[0] / 1e9, "perf/heap_trimmed": float(trimmed)}


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
