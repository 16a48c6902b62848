"""DeepSpeed ZeRO learner: the ProRL v2 update of :mod:`prorl_async.learners.torch_learner`,
data-parallel over several learner processes.

Same math, per step (DESIGN.md section 1): shaped rewards, REINFORCE++-baseline advantages,
importance-corrected PPO-Clip with Clip-Higher, KL (k1/k2/k3) to a reference, token-mean
aggregation, reference resets. What differs from :class:`TorchLearner`:

* the model is a DeepSpeed engine (ZeRO stage ``train.zero_stage``, fp32 or bf16 from
  ``model.dtype``, gradient clipping by DeepSpeed); the optimizer is torch's AdamW handed to
  DeepSpeed (no fused/CPU Adam JIT builds);
* each rank holds whole groups (``train.num_learners`` ranks split the groups); the global
  batch whitening of the advantages all-reduces ``[sum, sum_sq, count]`` across ranks
  (``reinforce_pp_baseline(stats_reduce=...)``), so every rank sees exactly what one rank would
  compute on the whole batch (LESSONS: per-rank normalisation);
* gradient accumulation with the *global* token count: each micro-batch loss is divided by the
  number of valid tokens of the mini-batch summed over all ranks and multiplied by the world
  size (DeepSpeed averages gradients over ranks), so the update equals the single-process
  token-mean. ``backward(scale_wrt_gas=False)`` keeps DeepSpeed from dividing again;
* full parameters for broadcast and saving are gathered with ``GatheredParameters`` under
  ZeRO-3;
* the reference policy is a frozen plain-torch copy on CPU (or the training device); a reset
  copies the gathered policy weights into it and optionally clears optimizer state.

Deviation: a micro-batch with a non-finite loss contributes a zero gradient (its backward is
still run so the ZeRO collectives stay in step across ranks) and is counted in
``actor/skipped_microbatches``; the optimizer step itself is not skipped.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from prorl_async.algo.advantages import compute_advantages
from prorl_async.algo.losses import entropy_from_logits, logprobs_from_logits
from prorl_async.algo.shaping import LengthPenaltySchedule, shape_rewards
from prorl_async.learners.torch_learner import _acc, _cpu_has_bf16, algo_state, batch_metrics, batch_to_tensors, micro_batch_loss
from prorl_async.weight_sync import free_port
from prorl_async.metrics import is_correct
from prorl_async.models import load_model


def prepare_batch(table: pa.Table, pad_id: int, cfg, step: int, schedule: LengthPenaltySchedule,
                  stats_reduce: Optional[Callable] = None) -> tuple[dict, dict]:
    """Rollout rows -> tensors with shaped rewards, loss mask and advantages (one rank's share)."""
    a = cfg.algo
    b = batch_to_tensors(table, pad_id)
    correct = is_correct(b["raw_reward"])
    rewards, keep, shape_metrics = shape_rewards(
        b["raw_reward"], correct, b["lengths"], b["truncated"],
        max_length=cfg.rollout.max_new_tokens, step=step, schedule=schedule, cosine=a.length_penalty,
        valid=b["valid"], overlong_mode=a.overlong, overlong_buffer=a.overlong_buffer,
        overlong_factor=a.overlong_factor)
    keep = keep & b["valid"]
    b["mask"] = b["mask"] * keep[:, None].float()
    kw = {"valid": b["valid"]}
    if a.advantage == "reinforce_pp_baseline" and stats_reduce is not None:
        kw["stats_reduce"] = stats_reduce
    b["advantages"] = compute_advantages(a.advantage, rewards, b["group_index"], b["mask"], **kw)
    return b, shape_metrics


def token_logprobs(model, b: dict, rows: slice, temperature: float, device, autocast: bool,
                   with_entropy: bool = False):
    """Per-response-token logprobs (and entropies) at the sampling temperature."""
    ids = b["input_ids"][rows].to(device)
    att = b["attention_mask"][rows].to(device)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits.float() / temperature
    idx = b["gather_idx"][rows].to(device)
    picked = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))
    logp = logprobs_from_logits(picked, b["response_ids"][rows].to(device))
    ent = entropy_from_logits(picked.detach()) if with_entropy else None
    return logp, ent


def _base_optimizer(opt):
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO / bf16)."""
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    return getattr(opt, "optimizer", opt)


def ensure_process_group(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                         master_port: int = 0, backend: str = "gloo") -> None:
    """The learners' own torch.distributed world (separate from the weight-sync group)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port or free_port(master_addr)))
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    import deepspeed
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, rank=rank, world_size=world_size)


class DeepSpeedLearner:
    def __init__(self, cfg, model_path: str, device: str = "cpu", rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 0):
        import deepspeed

        self.cfg = cfg
        self.device = torch.device(device)
        a, t = cfg.algo, cfg.train
        ensure_process_group(rank, world_size, master_addr, master_port,
                             backend="nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(t.seed)
        model = load_model(model_path, "float32")  # DeepSpeed casts to bf16 itself when asked
        model.config.use_cache = False
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.use_ref = a.kl_coef > 0 or a.ref_reset_interval > 0
        self.ref = None
        if self.use_ref:
            self.ref = copy.deepcopy(model).to(getattr(torch, cfg.model.dtype)).eval()
            self.ref.requires_grad_(False)
        rows_per_rank = cfg.samples_per_step // self.world_size
        mini = max(1, rows_per_rank // t.mini_batches)
        self.micro = min(t.micro_batch_size, mini)
        self.gas = -(-mini // self.micro)
        bf16 = cfg.model.dtype == "bfloat16"
        ds_config = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            "train_batch_size": self.micro * self.gas * self.world_size,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": t.zero_stage},
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warm = max(1, t.warmup_lr_steps)
        per_step = t.mini_batches * t.ppo_epochs  # DeepSpeed steps the schedule per optimizer step;
        # count learner steps instead, as TorchLearner does
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s // per_step + 1) / warm))
        self.engine, self.opt, _, self.lr_sched = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=ds_config,
            dist_init_required=False)
        self.model = self.engine.module
        self.autocast = (not bf16) and cfg.model.autocast_bf16 and (self.device.type == "cuda" or _cpu_has_bf16())
        self.length_schedule, self.ref_policy = algo_state(a)
        self.version = 0
        self.skipped_total = 0

    # ------------------------------------------------------------------ helpers
    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def _logprobs(self, model, b, rows, with_entropy=False):
        return token_logprobs(model, b, rows, self.cfg.rollout.temperature, self.engine.device
                              if model is self.engine else self.device, self.autocast, with_entropy)

    @torch.no_grad()
    def _no_grad_logprobs(self, model, b: dict) -> torch.Tensor:
        n = b["mask"].shape[0]
        return torch.cat([self._logprobs(model, b, slice(i, i + self.micro))[0] for i in range(0, n, self.micro)])

    # ------------------------------------------------------------------ one step
    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict:
        """One update on this rank's share of the groups; every rank must call it together."""
        cfg, a, t = self.cfg, self.cfg.algo, self.cfg.train
        step = self.version if step is None else step
        t0 = time.perf_counter()
        b, shape_metrics = prepare_batch(table, self.pad_id, cfg, step, self.length_schedule,
                                         stats_reduce=self._allreduce)
        mask, adv = b["mask"], b["advantages"]
        n = mask.shape[0]
        self.engine.train()
        multi = t.mini_batches * t.ppo_epochs > 1
        old_all = self._no_grad_logprobs(self.engine, b) if multi else None
        ref_all = self._no_grad_logprobs(self.ref, b) if a.kl_coef > 0 else None
        agg: dict[str, list[float]] = {}
        mb_size = max(1, n // t.mini_batches)
        updates, grad_norms, skipped = 0, [], 0
        for _ in range(t.ppo_epochs):
            for m0 in range(0, n, mb_size):
                mb = slice(m0, min(n, m0 + mb_size))
                global_tokens = float(self._allreduce(mask[mb].sum().double().reshape(1)).clamp(min=1.0))
                for i in range(mb.start, mb.stop, self.micro):
                    rows = slice(i, min(mb.stop, i + self.micro))
                    logp, ent = self._logprobs(self.engine, b, rows, with_entropy=True)
                    mk = mask[rows].to(logp.device)
                    old = old_all[rows].to(logp.device) if multi else logp.detach()
                    loss, sums = micro_batch_loss(
                        a, logp, ent, old, adv[rows].to(logp.device), b["behavior_logprobs"][rows].to(logp.device),
                        ref_all[rows].to(logp.device) if ref_all is not None else None, mk, global_tokens)
                    if not torch.isfinite(loss):
                        skipped += 1
                        loss = logp.sum() * 0.0  # zero gradient, collectives stay in step
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    self.engine.step()
                    for k, v in sums.items():
                        _acc(agg, k, v)
                updates += 1
                gn = self.engine.get_global_grad_norm()
                if gn is not None:
                    grad_norms.append(float(gn))
        self.version += 1
        self.skipped_total += skipped
        tokens = max(sum(agg.pop("_tokens", [0.0])), 1.0)
        metrics = {k: sum(v) / tokens for k, v in agg.items()}
        cause = self.ref_policy.update(step, kl=metrics.get("kl/loss_term"))
        if cause:
            self.reset_reference(cause)
        dt = time.perf_counter() - t0
        metrics.update(shape_metrics)
        metrics.update({
            "actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "actor/lr": self.lr_sched.get_last_lr()[0] if self.lr_sched is not None else t.lr,
            "actor/skipped_microbatches": float(self.skipped_total),
            "actor/updates": float(updates),
            **batch_metrics({**b, "mask": mask}, self.version, dt, t.ppo_epochs, cause),
        })
        return metrics

    # ------------------------------------------------------------------ reference, weights
    def _gathered(self):
        if self.cfg.train.zero_stage == 3:
            import deepspeed
            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    @torch.no_grad()
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Full parameters in HF layout and the run's dtype (gathered under ZeRO-3; collective)."""
        dtype = getattr(torch, self.cfg.model.dtype)
        with self._gathered():
            return [(n, p.detach().to(dtype).clone()) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def reset_reference(self, cause: str) -> None:
        if self.ref is not None:
            ref_params = dict(self.ref.named_parameters())
            for n, p in self.named_tensors():
                ref_params[n].copy_(p)
        if self.cfg.algo.ref_reset_optimizer:
            _base_optimizer(self.opt).state.clear()

    def observe_validation(self, step: int, score: float) -> Optional[str]:
        cause = self.ref_policy.update(step, val_score=score)
        if cause:
            self.reset_reference(cause)
        return cause

    def save_model(self, path: str) -> str:
        named = dict(self.named_tensors())
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=named)
        return path

    # ------------------------------------------------------------------ checkpoint
    def save_state(self, path) -> None:
        """DeepSpeed's own checkpoint (module, ZeRO-partitioned optimizer, LR scheduler; every rank
        writes its part) under ``path/learner/deepspeed`` with our algo state as client state, plus
        this rank's RNG states. A collective: every rank calls it."""
        from pathlib import Path

        from prorl_async.rng import rng_state

        d = Path(path) / "learner" / "deepspeed"
        self.engine.save_checkpoint(str(d), tag="state", save_latest=False, client_state={
            "length_schedule": self.length_schedule.state_dict(), "ref_policy": self.ref_policy.state_dict(),
            "version": self.version, "skipped_total": self.skipped_total})
        torch.save(rng_state(), d / f"rng-rank{self.rank}.pt")

    @torch.no_grad()
    def load_state(self, path) -> None:
        """Inverse of :meth:`save_state` (same ``train.num_learners``); reference weights from
        ``path/learner/reference.safetensors`` when the run has a reference."""
        from pathlib import Path

        from prorl_async.rng import set_rng_state

        d = Path(path) / "learner" / "deepspeed"
        loaded, client = self.engine.load_checkpoint(str(d), tag="state", load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
        if loaded is None:
            raise ValueError(f"checkpoint: no DeepSpeed state in {d}")
        self.length_schedule.load_state_dict(client["length_schedule"])
        self.ref_policy.load_state_dict(client["ref_policy"])
        self.version, self.skipped_total = int(client["version"]), int(client["skipped_total"])
        ref = Path(path) / "learner" / "reference.safetensors"
        if self.ref is not None and ref.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(ref))
            for n, p in self.ref.named_parameters():
                p.copy_(tensors[n].to(p.dtype))
        set_rng_state(torch.load(d / f"rng-rank{self.rank}.pt", weights_only=False))
