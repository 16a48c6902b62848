"""Learners: one ProRL v2 update per call on a batch of graded rollouts, and the weights and
checkpoint files that come out of it -- the :class:`~prorl_async.learners.base.Learner`
protocol, which each of them implements:

- :mod:`prorl_async.learners.torch_learner` -- plain torch, one process (``train.learner=torch``);
- :mod:`prorl_async.learners.deepspeed` -- DeepSpeed ZeRO, data-parallel ranks (``train.learner=deepspeed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prorl_async.config import Config
    from prorl_async.learners.base import Learner


def make_learner(cfg: Config, model_path: str, device: str = "cpu", rank: int = 0, world_size: int = 1,
                 master: tuple[str, int] = ("127.0.0.1", 0), served_store: bool = False) -> Learner:
    """The learner ``train.learner`` names; ``rank`` / ``world_size`` / ``master``: its place in
    the learners' own data-parallel world (DeepSpeed only; ``served_store``: a store already listens
    at ``master``, see :func:`~prorl_async.weight_sync.serve_store`)."""
    if cfg.train.learner == "deepspeed":
        from prorl_async.learners.deepspeed import DeepSpeedLearner
        return DeepSpeedLearner(cfg, model_path, device=device, rank=rank, world_size=world_size,
                                master_addr=master[0], master_port=master[1], served_store=served_store)
    from prorl_async.learners.torch_learner import TorchLearner
    return TorchLearner(cfg, model_path, device=device)
