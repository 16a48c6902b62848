"""RNG state of one process (python, numpy, torch CPU and CUDA), for exact resume.

Each process that draws random numbers (the driver, every learner rank) saves its own state
into a checkpoint and restores it on resume, so a resumed run draws what the original would
have drawn.
"""

from __future__ import annotations

import random


def rng_state() -> dict:
    """python, numpy and torch (CPU, and CUDA when present) RNG states of this process."""
    import numpy as np
    import torch

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
