"""What every learner implements: :class:`Learner`, the whole contract between the learner
actor (``actors/learner.py``) and a learner, and :class:`LearnerOps`, what the update loop both
learners share (:class:`~prorl_async.learners.core.LearnerCore`) reads and calls on its learner.

:class:`~prorl_async.learners.torch_learner.TorchLearner` and
:class:`~prorl_async.learners.deepspeed.DeepSpeedLearner` implement every member of both, so
neither the actor nor the core asks a learner what it can do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import pyarrow as pa
import torch

if TYPE_CHECKING:
    from prorl_async.algo.reference import ReferenceResetPolicy
    from prorl_async.algo.shaping import LengthPenaltySchedule


class Learner(Protocol):
    """One learner process: trains the policy on graded batches, hands out its weights, and
    writes and reads its part of a checkpoint (the files: :mod:`prorl_async.learners.files`)."""

    device: torch.device  # where the policy's weights live
    version: int          # the policy version: learner steps done

    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict[str, float]:
        """One update on a table in the rollout schema; returns the step's metrics."""
        ...

    def ledger_rows(self) -> Optional[pa.Table]:
        """The last step's rows for the ledger (:func:`prorl_async.ledger.step_rows`), None
        with ``train.record_rollouts`` off."""
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


class LearnerOps(Protocol):
    """What :class:`~prorl_async.learners.core.LearnerCore` reads and calls on its learner: the
    torch learner owns AdamW and clipping, the DeepSpeed learner its engine and ZeRO; the core
    owns the update loop itself."""

    device: torch.device              # where the batch's tensors go
    autocast: bool                    # a bf16 autocast around each forward
    compiled: bool                    # decoder layers compiled (``train.compile``; the LM head's chunks then too)
    run_all_micro_batches: bool       # every rank runs every backward (collectives): never stop a mini-batch early
    policy: Any                       # what the forward calls (DeepSpeed: its engine)
    ref: Optional[torch.nn.Module]    # the frozen reference policy, None without a KL term or resets
    pad_id: int
    version: int                      # the policy version: learner steps done (the core advances it)
    skipped_in_row: int               # consecutive updates not applied (the core counts them)
    skipped_total: int
    length_schedule: LengthPenaltySchedule
    ref_policy: ReferenceResetPolicy
    lr_sched: Any                     # torch's LR scheduler, stepped once per applied learner step

    @property
    def micro(self) -> int:
        """Rows of a padded micro-batch."""
        ...

    @property
    def refused_updates(self) -> int:
        """Updates refused as too large (``train.max_update_ratio``) so far."""
        ...

    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """``x`` summed (``sum``) or maxed (``max``) over the learners' ranks (one process: ``x``)."""
        ...

    def zero_grad(self) -> None:
        ...

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Back-propagate one micro-batch's loss; ``last``: the mini-batch's last one."""
        ...

    def finish_update(self, finite: bool) -> tuple[bool, float]:
        """Step the optimizer after a mini-batch: ``(applied, grad_norm)``; ``finite`` false: skip it."""
        ...

    def reset_reference(self, cause: str) -> None:
        """The reference policy to the current weights (and AdamW cleared, if configured)."""
        ...
