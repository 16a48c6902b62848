"""DeepSpeed ZeRO learner: the ProRL v2 update of :class:`prorl_async.learners.core.LearnerCore`,
data-parallel over several learner processes.

The update (batch preparation, logprobs, loss, mini-batches, the non-finite rule, metric
names) is the core's, as for :class:`~prorl_async.learners.torch_learner.TorchLearner`. This
class owns only what DeepSpeed owns:

* the engine: ZeRO stage ``train.zero_stage``, fp32 or bf16 from ``model.dtype``, gradient
  clipping by DeepSpeed; the optimizer is torch's AdamW handed to DeepSpeed (no fused/CPU
  Adam JIT builds); the LR schedule is stepped once per learner step, as TorchLearner does;
* the data-parallel world: each rank holds whole groups; the whitening statistics, the
  mini-batch token counts and the mismatch statistics are all-reduced on the backend's
  device (CUDA for NCCL), so every rank sees what one rank would compute on the whole batch
  (LESSONS: per-rank normalisation); each micro-batch loss is divided by the mini-batch's
  global token count and multiplied by the world size (DeepSpeed averages gradients over
  ranks), so the update equals the single-process token mean;
* gradient accumulation: the accumulation boundary is set explicitly at the last micro-batch
  of each mini-batch, and every rank runs as many micro-batches (and no-grad forwards) as the
  busiest rank (zero-gradient passes on the others), so uneven shards keep the collectives
  paired and each mini-batch is exactly one optimizer step;
* the non-finite rule: a micro-batch with a non-finite loss back-propagates NaN (its backward
  still runs so the collectives stay in step); DeepSpeed's ZeRO optimizer then finds a
  non-finite gradient norm and discards the step (weights and optimizer state unchanged,
  ``was_step_applied()`` false), which the core counts. Relies on ZeRO stages 1-3
  (``bf16.check_grad_overflow`` is set); stage 0 has no such check;
* full parameters for broadcast, saving and reference resets are gathered under ZeRO-3 one
  parameter at a time (``GatheredParameters``), and only rank 0, which sends and saves, keeps a
  copy; the reference policy is a frozen plain-torch copy on the learner's device;
* DeepSpeed's own checkpoint.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import torch
import torch.distributed as dist

from prorl_async.learners import host_memory
from prorl_async.learners.core import LearnerCore, algo_state
from prorl_async.learners.files import write_deepspeed_learner
from prorl_async.machine import cpu_has_bf16, scoped_env
from prorl_async.models import load_model
from prorl_async.weight_sync import STORE_TIMEOUT, free_port


def _base_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO / bf16), each of which holds the
    one it wraps as ``.optimizer``."""
    wrapper = opt
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"DeepSpeed's optimizer {type(wrapper).__name__} wraps no torch.optim.Optimizer "
                        f"(ended at {type(opt).__name__}); hand deepspeed.initialize a torch optimizer")
    return opt


def ensure_process_group(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                         master_port: int = 0, backend: str = "gloo", served_store: bool = False) -> None:
    """The learners' own torch.distributed world (separate from the weight-sync group). An explicit
    ``master_port`` wins over an inherited ``MASTER_PORT`` (a parent's world, whose port is taken);
    the variables are set only while the world is built. ``served_store``: a TCPStore already
    listens at ``master_addr:master_port`` (:func:`~prorl_async.weight_sync.serve_store`) and every
    rank, rank 0 included, is its client -- no rank binds a port that was free a moment ago."""
    if dist.is_initialized():
        return
    _forget_dead_groups()
    addr = master_addr if master_port else os.environ.get("MASTER_ADDR", master_addr)
    port = str(master_port) if master_port else os.environ.get("MASTER_PORT") or str(free_port(master_addr))
    import deepspeed
    with scoped_env({"MASTER_ADDR": addr, "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                     "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}):
        if served_store:  # DeepSpeed then adopts the world (and still reads the variables for its shm ops)
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=STORE_TIMEOUT)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, rank=rank, world_size=world_size)


def _forget_dead_groups() -> None:
    """DeepSpeed caches the groups it makes (``deepspeed.utils.groups``: a clone of the world among
    them) and drops them only when it destroys the world itself. A world destroyed by someone else
    (an in-process vLLM engine's shutdown) leaves them cached, and the next engine broadcasts over a
    dead group ("Group ... is not registered"). With no world up, no cached group can be alive."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release()


def allreduce(x: torch.Tensor, op: str, device, world_size: int) -> torch.Tensor:
    """``x`` all-reduced (``sum`` or ``max``) over the default group, computed on ``device`` (the
    backend's: CUDA for NCCL, which refuses CPU tensors); returned on ``x``'s device."""
    if world_size == 1 or not dist.is_initialized():
        return x
    y = x.to(device)
    dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    out = y.to(x.device)
    if out.data_ptr() != x.data_ptr():
        x.copy_(out)  # stats_reduce callers may rely on in-place reduction
    return x


class DeepSpeedLearner:
    """:class:`~prorl_async.learners.base.Learner` on a DeepSpeed ZeRO engine, one rank of the
    learners' data-parallel world (module docstring)."""

    def __init__(self, cfg, model_path: str, device: str = "cpu", rank: int = 0, world_size: int = 1,
                 master_addr: str = "127.0.0.1", master_port: int = 0, served_store: bool = False):
        import deepspeed

        self.cfg = cfg
        self.device = torch.device(device)
        a, t = cfg.algo, cfg.train
        self.reuses_freed_memory = host_memory.configure(t.reuse_freed_memory, self.device)
        ensure_process_group(rank, world_size, master_addr, master_port,
                             backend="nccl" if self.device.type == "cuda" else "gloo", served_store=served_store)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(t.seed)
        model = load_model(model_path, "float32")  # DeepSpeed casts to bf16 itself when asked
        model.config.use_cache = False
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.use_ref = a.kl_coef > 0 or a.ref_reset_interval > 0
        self.ref = None
        if self.use_ref:
            self.ref = copy.deepcopy(model).to(device=self.device, dtype=getattr(torch, cfg.model.dtype)).eval()
            self.ref.requires_grad_(False)
        rows_per_rank = cfg.samples_per_step // self.world_size
        mini = max(1, rows_per_rank // t.mini_batches)
        self._micro = min(t.micro_batch_size, mini)
        self.gas = -(-mini // self._micro)  # nominal: the boundary is set per mini-batch (see train_step)
        bf16 = cfg.model.dtype == "bfloat16"
        ds_config = {
            "train_micro_batch_size_per_gpu": self._micro,
            "gradient_accumulation_steps": self.gas,
            "train_batch_size": self._micro * self.gas * self.world_size,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": t.zero_stage},
            "bf16": {"enabled": bf16, "check_grad_overflow": True},  # a non-finite gradient skips the step
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        with scoped_env({"LOCAL_RANK": "0"}):  # the engine reads its device's index from it, once
            self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                                               dist_init_required=False)
        # stepped once per learner step that updated, as TorchLearner does (not by DeepSpeed per optimizer step)
        warm = max(1, t.warmup_lr_steps)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(_base_optimizer(self.opt), lambda s: min(1.0, (s + 1) / warm))
        self.model = self.engine.module
        self.device = torch.device(self.engine.device)
        self.autocast = (not bf16) and cfg.model.autocast_bf16 and (self.device.type == "cuda" or cpu_has_bf16())
        self.run_all_micro_batches = True  # collectives in every backward: never break out early
        self.compiled = False  # train.compile is the torch learner's
        self.policy = self.engine
        self.core = LearnerCore(cfg, self)
        self.length_schedule, self.ref_policy = algo_state(a)
        self.version = 0
        self.skipped_total = 0
        self.skipped_in_row = 0

    # ------------------------------------------------------------------ what the core calls
    def reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """All-reduce (``sum`` / ``max``) on the backend's device (NCCL only moves CUDA tensors);
        returns the result where ``x`` was."""
        return allreduce(x, op, self.device, self.world_size)

    def zero_grad(self) -> None:
        pass  # DeepSpeed clears gradients after each optimizer step (or discarded step)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def finish_update(self, finite: bool) -> tuple[bool, float]:
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        return bool(self.engine.was_step_applied()), float("nan") if gn is None else float(gn)

    @property
    def micro(self) -> int:
        return self._micro

    @property
    def refused_updates(self) -> int:
        return 0  # no update guard: DeepSpeed steps its own optimizer (train.max_update_ratio is the torch learner's)

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(x, "sum")

    # ------------------------------------------------------------------ one step
    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict:
        """One update on this rank's share of the groups; every rank must call it together."""
        self.engine.train()
        return self.core.learner_step(table, step, stats_reduce=self._allreduce)

    # ------------------------------------------------------------------ reference, weights
    def _full_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Each parameter whole, one at a time: under ZeRO-3 a collective (every rank iterates to
        the end) that gathers one parameter, yields it and frees the gathered copy before the next,
        so no rank holds more than its shard and one full parameter; other stages hold them whole."""
        if self.cfg.train.zero_stage != 3:
            yield from self.model.named_parameters()
            return
        import deepspeed

        for n, p in self.model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield n, p

    @torch.no_grad()
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Full parameters in HF layout and the run's dtype, on rank 0 (the one that sends and
        saves them); the other ranks take part in the ZeRO-3 gathers (a collective: every rank
        calls it) and keep nothing."""
        dtype = getattr(torch, self.cfg.model.dtype)
        keep = self.rank == 0
        return [(n, p.detach().to(dtype).clone()) for n, p in self._full_parameters() if keep]

    @torch.no_grad()
    def reset_reference(self, cause: str) -> None:
        if self.ref is not None:  # every rank's reference takes the policy, a parameter at a time
            ref_params = dict(self.ref.named_parameters())
            for n, p in self._full_parameters():
                ref_params[n].copy_(p.detach())
        if self.cfg.algo.ref_reset_optimizer:
            _base_optimizer(self.opt).state.clear()

    def ledger_rows(self) -> Optional[pa.Table]:
        return self.core.ledger_rows()

    def observe_validation(self, step: int, score: float) -> Optional[str]:
        cause = self.ref_policy.update(step, val_score=score)
        if cause:
            self.reset_reference(cause)
        return cause

    def base_optimizer(self) -> torch.optim.Optimizer:
        return _base_optimizer(self.opt)

    def save_model(self, path: str) -> str:
        named = dict(self.named_tensors())
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=named)
        return path

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, path: str | Path, tokenizer_path: str = "") -> None:
        """A collective: every rank calls it (:func:`~prorl_async.learners.files.write_deepspeed_learner`)."""
        write_deepspeed_learner(self, path, tokenizer_path)

    def load_checkpoint(self, path: str | Path) -> int:
        """A collective: every rank reads its part (:meth:`load_state`)."""
        self.load_state(path)
        return self.version

    def save_state(self, path) -> None:
        """DeepSpeed's own checkpoint (module, ZeRO-partitioned optimizer; every rank writes its
        part) under ``path/learner/deepspeed`` with our LR schedule and algo state as client state, plus
        this rank's RNG states. A collective: every rank calls it."""
        from prorl_async.rng import rng_state

        d = Path(path) / "learner" / "deepspeed"
        self.engine.save_checkpoint(str(d), tag="state", save_latest=False, client_state={
            "length_schedule": self.length_schedule.state_dict(), "ref_policy": self.ref_policy.state_dict(),
            "version": self.version, "skipped_total": self.skipped_total, "skipped_in_row": self.skipped_in_row,
            "lr_scheduler": self.lr_sched.state_dict()})
        torch.save(rng_state(), d / f"rng-rank{self.rank}.pt")

    @torch.no_grad()
    def load_state(self, path) -> None:
        """Inverse of :meth:`save_state` (same ``train.num_learners``); reference weights from
        ``path/learner/reference.safetensors`` when the run has a reference."""
        from prorl_async.rng import set_rng_state

        d = Path(path) / "learner" / "deepspeed"
        loaded, client = self.engine.load_checkpoint(str(d), tag="state", load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
        if loaded is None:
            raise ValueError(f"checkpoint: no DeepSpeed state in {d}")
        self.length_schedule.load_state_dict(client["length_schedule"])
        self.ref_policy.load_state_dict(client["ref_policy"])
        self.version, self.skipped_total = int(client["version"]), int(client["skipped_total"])
        self.skipped_in_row = int(client.get("skipped_in_row", 0))
        self.lr_sched.load_state_dict(client["lr_scheduler"])
        ref = Path(path) / "learner" / "reference.safetensors"
        if self.ref is not None and ref.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(ref))
            for n, p in self.ref.named_parameters():
                p.copy_(tensors[n].to(p.dtype))
        set_rng_state(torch.load(d / f"rng-rank{self.rank}.pt", weights_only=False))
