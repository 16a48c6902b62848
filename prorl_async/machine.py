"""What this machine is, for the config's ``auto`` settings: the facts are probed here
(:func:`probe_machine`) and resolved by :func:`prorl_async.config.resolve_auto`, which reads no
hardware itself. Imports nothing of the project; torch only when CUDA is asked about."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

#: CPU flags of native bf16 matmul (without them a bf16 matmul runs ~100x slower than fp32 on AVX2)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


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


@dataclass(frozen=True)
class MachineFacts:
    """The facts ``auto`` settings resolve against."""
    cpus: int                          # CPUs this process may run on (its affinity)
    omp_wait_policy_set: bool          # $OMP_WAIT_POLICY is set in this environment
    bf16: Optional[bool] = None        # native bf16 compute: a CUDA GPU, or a CPU with AMX / AVX-512 bf16; None: not probed


def probe_machine(bf16: bool = True) -> MachineFacts:
    """This process's facts; ``bf16=False`` leaves :attr:`MachineFacts.bf16` unprobed (no torch import)."""
    native = None
    if bf16:
        import torch

        native = torch.cuda.is_available() or any(f in cpu_flags() for f in BF16_CPU_FLAGS)
    return MachineFacts(cpus=len(os.sched_getaffinity(0)), omp_wait_policy_set="OMP_WAIT_POLICY" in os.environ,
                        bf16=native)
