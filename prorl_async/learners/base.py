"""What every learner implements: :class:`Learner`, the whole contract between the learner
actor (``actors/learner.py``) and a learner.

:class:`~prorl_async.learners.torch_learner.TorchLearner` and
:class:`~prorl_async.learners.deepspeed.DeepSpeedLearner` implement every member, so the actor
never asks a learner what it can do. (What the shared update loop,
:class:`~prorl_async.learners.core.LearnerCore`, calls on a learner is listed in that class.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import pyarrow as pa
import torch


class Learner(Protocol):
    """One learner process: trains the policy on graded batches, hands out its weights, and
    writes and reads its part of a checkpoint (the files: :mod:`prorl_async.learners.files`)."""

    device: torch.device  # where the policy's weights live
    version: int          # the policy version: learner steps done

    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict[str, float]:
        """One update on a table in the rollout schema; returns the step's metrics."""
        ...

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights by parameter name, as the engines load them (a collective
        under ZeRO-3: every rank calls it)."""
        ...

    def observe_validation(self, step: int, score: float) -> Optional[str]:
        """A held-out score for the reference-reset policy; the reset's cause if it reset."""
        ...

    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under any wrapper (its ``state``: the AdamW moments)."""
        ...

    def save_model(self, path: str) -> str:
        """The policy as a HF folder at ``path`` (the run's final model); returns ``path``."""
        ...

    def save_checkpoint(self, path: str | Path, tokenizer_path: str = "") -> None:
        """This learner's files (``policy/``, ``learner/``) into checkpoint directory ``path``."""
        ...

    def load_checkpoint(self, path: str | Path) -> int:
        """Back to checkpoint directory ``path``; returns the policy version."""
        ...
