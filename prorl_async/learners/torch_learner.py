"""The torch learner: one ProRL v2 update per call, on a batch of graded rollouts.

The update itself (batch preparation, logprobs, loss, mini-batches, the non-finite rule,
metrics) is :class:`prorl_async.learners.core.LearnerCore`, shared with the DeepSpeed
learner; this class owns what plain torch does: the model on one device, AdamW with
gradient clipping (a non-finite gradient norm skips the update), the LR schedule, the
reference copy, and its checkpoint state. The same class runs on CPU and CUDA.

Precision: the learner computes in bf16 when the policy's dtype is bf16 (``model.dtype:
bfloat16``, or ``auto`` on a GPU or a CPU with AMX / AVX-512 bf16, the engines generating in
bf16 too), or when ``model.autocast_bf16`` asks for it on such hardware with fp32 engines. With
``model.bf16_params`` (the default) the standard mixed-precision recipe (Micikevicius et al.
2018, "Mixed Precision Training", arXiv:1710.03740, with bf16 instead of fp16 so without loss
scaling; as FSDP's ``param_dtype=bf16`` in verl / OpenRLHF): the module's parameters are bf16
and run the forward and backward without any cast, AdamW updates fp32 *master* copies, each
parameter's bf16 gradient is added into an fp32 gradient buffer of its master as soon as
autograd has accumulated it (so micro-batches sum in fp32), and after every applied update the
masters are copied (rounded) into the bf16 parameters once. The reference model is bf16
outright. Buffers (rotary ``inv_freq``) stay fp32. What leaves the learner — weights for the
engines (:meth:`TorchLearner.named_tensors`) and checkpoints — are the fp32 masters; the wire
converts to the engine's dtype. Deviation from autocast: activations, the residual stream
included, are bf16 (autocast kept the residual stream fp32); the loss and gradients agree to
bf16 tolerance (tests/learners/test_bf16_params.py). ``model.bf16_params=false`` keeps fp32
parameters under a bf16 autocast per forward. Without bf16 hardware ``autocast_bf16`` leaves
the learner fp32; an explicit ``model.dtype: bfloat16`` does not.
AdamW runs fused (one pass per tensor) where torch has the kernel (CPU, CUDA).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import pyarrow as pa
import torch

from prorl_async.learners import host_memory
from prorl_async.learners.compile import compile_applies, compile_decoder_layers
from prorl_async.learners.core import LearnerCore, algo_state
from prorl_async.learners.files import read_learner, write_torch_learner
from prorl_async.machine import cpu_has_bf16
from prorl_async.learners.update_guard import UpdateGuard
from prorl_async.models import load_model, machine_dtype



class TorchLearner:
    """:class:`~prorl_async.learners.base.Learner` in plain torch, one process (module docstring)."""

    def __init__(self, cfg, model_path: str, device: str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        # large temporaries reuse freed heap memory instead of fresh pages (learners/host_memory.py)
        self.reuses_freed_memory = host_memory.configure(cfg.train.reuse_freed_memory, self.device)
        torch.manual_seed(cfg.train.seed)
        # bf16 compute: the policy's dtype is bf16 (the engines generate in it), or the learner alone
        # asks for it where the hardware has bf16; the weights always load in fp32, so that the masters
        # (or the fp32 parameters under autocast) start exact
        self.autocast = (machine_dtype(cfg.model.dtype, device) == "bfloat16"
                         or cfg.model.autocast_bf16 and (self.device.type == "cuda" or cpu_has_bf16()))
        self.model = load_model(model_path, "float32").to(self.device)
        self.model.config.use_cache = False
        self.model.train()
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        a, t = cfg.algo, cfg.train
        # bf16 parameters for compute, fp32 masters in AdamW (module docstring); else the module's own
        self.masters = _Bf16Masters(self.model) if self.autocast and cfg.model.bf16_params else None
        self.use_ref = a.kl_coef > 0 or a.ref_reset_interval > 0
        self.ref = None
        if self.use_ref:
            self.ref = copy.deepcopy(self.model).eval()  # bf16 outright with bf16 parameters
            self.ref.requires_grad_(False)
        self.compiled = compile_applies(t.compile, self.device)  # decoder layers and the LM head's chunks
        if self.compiled:
            for m in (self.model, self.ref):
                if m is not None:
                    compile_decoder_layers(m)
        params = self.masters.params if self.masters is not None else list(self.model.parameters())
        self.opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, **_fused_kwargs(self.device))
        warm = max(1, t.warmup_lr_steps)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))
        self.guard = UpdateGuard(self.opt, t.max_update_ratio)  # refuses a ruinous (finite) update
        self.length_schedule, self.ref_policy = algo_state(a)
        self.version = 0
        self.skipped_in_row = 0
        self.skipped_total = 0
        self.micro = t.micro_batch_size
        self.run_all_micro_batches = False  # one process: a non-finite micro-batch ends the mini-batch
        self.policy = self.model
        self.core = LearnerCore(cfg, self)

    # ------------------------------------------------------------------ what the core calls
    @property
    def refused_updates(self) -> int:
        return self.guard.refused_total

    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return x  # one process

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.zero_grad()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def finish_update(self, finite: bool) -> tuple[bool, float]:
        """Clip and step; a non-finite loss or gradient norm, or an update larger than
        ``train.max_update_ratio`` times the weights' norm, leaves weights and AdamW untouched."""
        if not finite:
            self.zero_grad()
            return False, float("nan")
        params = self.masters.params if self.masters is not None else self.model.parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
        if not torch.isfinite(grad_norm):
            self.zero_grad()
            return False, float(grad_norm)
        applied = self.guard.step()
        if applied and self.masters is not None:
            self.masters.copy_to_params()
        return applied, float(grad_norm)

    def token_logprobs(self, model, b: dict, rows: slice, with_entropy: bool = False):
        """Per-response-token logprobs (and entropies) at temperature ``rollout.temperature``."""
        return self.core._logprobs(model, b, rows, with_entropy)

    # ------------------------------------------------------------------ one step
    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict:
        return self.core.learner_step(table, step)

    # ------------------------------------------------------------------ reference, weights
    def ledger_rows(self) -> Optional[pa.Table]:
        return self.core.ledger_rows()

    @torch.no_grad()
    def reset_reference(self, cause: str) -> None:
        if self.ref is not None:
            self.ref.load_state_dict(self.model.state_dict())
        if self.cfg.algo.ref_reset_optimizer:
            self.opt.state.clear()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights by parameter name: the fp32 masters with bf16 parameters."""
        if self.masters is not None:
            return [(n, self.masters.of(p)) for n, p in self.model.named_parameters()]
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def observe_validation(self, step: int, score: float) -> Optional[str]:
        cause = self.ref_policy.update(step, val_score=score)
        if cause:
            self.reset_reference(cause)
        return cause

    def base_optimizer(self) -> torch.optim.Optimizer:
        return self.opt  # AdamW itself: no wrapper

    def save_model(self, path: str) -> str:
        """The module as it is (with ``model.bf16_params``: its bf16 parameters) as a HF folder."""
        self.model.save_pretrained(path)
        return path

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, path: str | Path, tokenizer_path: str = "") -> None:
        write_torch_learner(self, path, tokenizer_path)

    def load_checkpoint(self, path: str | Path) -> int:
        self.load_state_dict(read_learner(path))
        return self.version

    def state_dict(self) -> dict:
        """Everything an exact resume needs: weights (policy, reference), AdamW and LR-scheduler
        state, the algo state objects, counters, and this process's RNG states."""
        from prorl_async.rng import rng_state

        return {
            "model": self._policy_state(),
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

    def _policy_state(self) -> dict:
        """The policy's state dict (tied weights under every name), fp32 masters in place of bf16 parameters."""
        sd = self.model.state_dict(keep_vars=True)
        if self.masters is None:
            return {n: t.detach() for n, t in sd.items()}
        return {n: self.masters.of(t) if isinstance(t, torch.nn.Parameter) else t.detach() for n, t in sd.items()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        from prorl_async.rng import set_rng_state

        _load_weights(self.model, sd["model"], "policy")
        if self.masters is not None:
            self.masters.load(self.model, sd["model"])
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


def _fused_kwargs(device: torch.device) -> dict:
    """``fused=True`` for AdamW where torch has the fused kernel (CPU since torch 2.4, CUDA)."""
    return {"fused": True} if device.type in ("cpu", "cuda") else {}


class _Bf16Masters:
    """fp32 master weights of a module whose parameters are turned to bf16 (module docstring).

    ``params`` are the masters (what AdamW updates); each bf16 parameter's gradient is added
    into its master's fp32 gradient buffer by a post-accumulate-grad hook, which then frees the
    bf16 gradient, so micro-batches sum in fp32 and no bf16 gradient outlives its backward."""

    def __init__(self, model: torch.nn.Module):
        self.model_params = list(model.parameters())  # tied weights once
        self.params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self._grads = [torch.zeros_like(m) for m in self.params]  # reused: no fresh pages every step
        self._index = {id(p): i for i, p in enumerate(self.model_params)}
        with torch.no_grad():
            for p in self.model_params:  # parameters only: buffers (rotary inv_freq) stay fp32
                p.data = p.data.to(torch.bfloat16)
        for i, p in enumerate(self.model_params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int):
        def add_into_master(p: torch.Tensor) -> None:
            m = self.params[i]
            if m.grad is None:
                m.grad = self._grads[i].copy_(p.grad)
            else:
                m.grad.add_(p.grad)
            p.grad = None
        return add_into_master

    def of(self, p: torch.Tensor) -> torch.Tensor:
        """The master of bf16 parameter ``p``."""
        return self.params[self._index[id(p)]].detach()

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """The masters, rounded to bf16, into the module's parameters (once per applied update)."""
        torch._foreach_copy_(self.model_params, self.params)

    @torch.no_grad()
    def load(self, model: torch.nn.Module, tensors: dict) -> None:
        """Masters from a checkpoint's ``tensors`` (by parameter name, fp32 kept exact), then the parameters."""
        for n, p in model.named_parameters():
            self.params[self._index[id(p)]].copy_(tensors[n].to(torch.float32))
        self.copy_to_params()
