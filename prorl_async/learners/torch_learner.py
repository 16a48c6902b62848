"""The torch learner: one ProRL v2 update per call, on a batch of graded rollouts.

The update itself (batch preparation, logprobs, loss, mini-batches, the non-finite rule,
metrics) is :class:`prorl_async.learners.core.LearnerCore`, shared with the DeepSpeed
learner; this class owns what plain torch does: the model on one device, AdamW with
gradient clipping (a non-finite gradient norm skips the update), the LR schedule, the
reference copy, and its checkpoint state. The same class runs on CPU and CUDA.
"""

from __future__ import annotations

import copy
from typing import Optional

import pyarrow as pa
import torch

from prorl_async.learners.core import (  # noqa: F401  (re-exported for callers of this module)
    LearnerCore, NonFiniteStepError, algo_state, batch_metrics, batch_to_tensors, cpu_has_bf16, micro_batch_loss,
    prepare_batch)
from prorl_async.learners.update_guard import UpdateGuard
from prorl_async.models import load_model



class TorchLearner:
    def __init__(self, cfg, model_path: str, device: str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        torch.manual_seed(cfg.train.seed)
        self.model = load_model(model_path, cfg.model.dtype).to(self.device)
        self.model.config.use_cache = False
        self.model.train()
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        a, t = cfg.algo, cfg.train
        self.use_ref = a.kl_coef > 0 or a.ref_reset_interval > 0
        self.ref = None
        if self.use_ref:
            self.ref = copy.deepcopy(self.model).eval()
            self.ref.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warm = max(1, t.warmup_lr_steps)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))
        self.guard = UpdateGuard(self.opt, t.max_update_ratio)  # refuses a ruinous (finite) update
        self.length_schedule, self.ref_policy = algo_state(a)
        self.version = 0
        self.skipped_in_row = 0
        self.skipped_total = 0
        self.autocast = cfg.model.autocast_bf16 and (self.device.type == "cuda" or cpu_has_bf16())
        self.micro = t.micro_batch_size
        self.run_all_micro_batches = False  # one process: a non-finite micro-batch ends the mini-batch
        self.policy = self.model
        self.core = LearnerCore(cfg, self)

    # ------------------------------------------------------------------ what the core calls
    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return x  # one process

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def finish_update(self, finite: bool) -> tuple[bool, float]:
        """Clip and step; a non-finite loss or gradient norm, or an update larger than
        ``train.max_update_ratio`` times the weights' norm, leaves weights and AdamW untouched."""
        if not finite:
            self.opt.zero_grad(set_to_none=True)
            return False, float("nan")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        if not torch.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            return False, float(grad_norm)
        return self.guard.step(), float(grad_norm)

    def token_logprobs(self, model, b: dict, rows: slice, with_entropy: bool = False):
        """Per-response-token logprobs (and entropies) at temperature ``rollout.temperature``."""
        return self.core._logprobs(model, b, rows, with_entropy)

    # ------------------------------------------------------------------ one step
    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict:
        return self.core.learner_step(table, step)

    # ------------------------------------------------------------------ reference, weights
    @torch.no_grad()
    def reset_reference(self, cause: str) -> None:
        if self.ref is not None:
            self.ref.load_state_dict(self.model.state_dict())
        if self.cfg.algo.ref_reset_optimizer:
            self.opt.state.clear()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def observe_validation(self, step: int, score: float) -> Optional[str]:
        cause = self.ref_policy.update(step, val_score=score)
        if cause:
            self.reset_reference(cause)
        return cause

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything an exact resume needs: weights (policy, reference), AdamW and LR-scheduler
        state, the algo state objects, counters, and this process's RNG states."""
        from prorl_async.rng import rng_state

        return {
            "model": {n: p.detach() for n, p in self.model.state_dict().items()},
            "reference": {n: p.detach() for n, p in self.ref.state_dict().items()} if self.ref is not None else None,
            "optimizer": self.opt.state_dict(),
            "lr_scheduler": self.lr_sched.state_dict(),
            "length_schedule": self.length_schedule.state_dict(),
            "ref_policy": self.ref_policy.state_dict(),
            "version": self.version,
            "skipped_in_row": self.skipped_in_row,
            "skipped_total": self.skipped_total,
            "rng": rng_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        from prorl_async.rng import set_rng_state

        _load_weights(self.model, sd["model"], "policy")
        self.guard.forget_norm()
        if self.ref is not None:
            _load_weights(self.ref, sd["reference"] if sd.get("reference") is not None else sd["model"], "reference")
        self.opt.load_state_dict(sd["optimizer"])
        self.lr_sched.load_state_dict(sd["lr_scheduler"])
        self.length_schedule.load_state_dict(sd["length_schedule"])
        self.ref_policy.load_state_dict(sd["ref_policy"])
        self.version = int(sd["version"])
        self.skipped_in_row = int(sd["skipped_in_row"])
        self.skipped_total = int(sd["skipped_total"])
        set_rng_state(sd["rng"])


@torch.no_grad()
def _load_weights(model, tensors: dict, what: str) -> None:
    """Copy ``tensors`` into ``model``; a tied weight (lm_head = embeddings) may be absent."""
    params = dict(model.named_parameters())  # tied weights appear once
    missing = [n for n in params if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint: {what} weights lack {missing[:5]} ({len(missing)} tensors)")
    for n, t in model.state_dict().items():
        if n in tensors:
            t.copy_(tensors[n].to(t.dtype))
