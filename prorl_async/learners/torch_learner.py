"""The torch learner: one ProRL v2 update per call, on a batch of graded rollouts.

Per step (DESIGN.md section 1; formulas in :mod:`prorl_async.algo`):

1. shape rewards (scheduled cosine length reward, overlong filter / DAPO soft punishment);
2. REINFORCE++-baseline advantages (group mean baseline, global token whitening);
3. recompute ``old_logprobs`` with the current weights when the batch is split into several
   optimizer steps (otherwise they equal the first forward's detached values), and reference
   logprobs when the KL penalty is on;
4. importance-corrected PPO-Clip with Clip-Higher + ``kl_coef`` * KL(k1/k2/k3) - entropy bonus,
   token-mean over the *mini-batch's* valid tokens, accumulated across micro-batches;
5. AdamW with gradient clipping; a non-finite loss or gradient norm skips the update;
6. reference reset on interval / KL spike / validation stall (optionally clearing Adam state).

The same class runs on CPU (this machine) and CUDA; the DeepSpeed learner reuses its tensor
preparation and loss.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Optional

import numpy as np
import pyarrow as pa
import torch

from prorl_async.algo.advantages import compute_advantages
from prorl_async.algo.losses import kl_penalty, logprobs_from_logits, entropy_from_logits, policy_loss
from prorl_async.algo.reference import ReferenceResetPolicy
from prorl_async.algo.shaping import LengthPenaltySchedule, shape_rewards
from prorl_async.metrics import is_correct
from prorl_async.models import load_model


class NonFiniteStepError(RuntimeError):
    """Too many consecutive non-finite steps."""


def batch_to_tensors(table: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
    """Rollout rows -> right-padded sequences and response-aligned [N, T] tensors."""
    cols = table.to_pydict()
    prompts, responses = cols["prompt_ids"], cols["response_ids"]
    n = len(prompts)
    plen = torch.tensor([len(p) for p in prompts])
    rlen = torch.tensor([len(r) for r in responses])
    S = int((plen + rlen).max())
    T = max(1, int(rlen.max()))
    input_ids = torch.full((n, S), pad_id, dtype=torch.long)
    attention = torch.zeros((n, S), dtype=torch.long)
    beh = torch.zeros((n, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        input_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, :len(seq)] = 1
        beh[i, :len(r)] = torch.tensor(cols["behavior_logprobs"][i], dtype=torch.float32)
    mask = (torch.arange(T)[None, :] < rlen[:, None]).float()
    # logits at sequence position P+j-1 predict response token j
    gather_idx = (plen[:, None] + torch.arange(T)[None, :] - 1).clamp(max=S - 2)
    response_ids = torch.zeros((n, T), dtype=torch.long)
    for i, r in enumerate(responses):
        response_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    _, group_index = np.unique(np.asarray(cols["prompt_id"]), return_inverse=True)
    return {
        "input_ids": input_ids, "attention_mask": attention, "gather_idx": gather_idx,
        "response_ids": response_ids, "mask": mask, "behavior_logprobs": beh,
        "raw_reward": torch.tensor(cols["raw_reward"], dtype=torch.float32),
        "valid": torch.tensor(cols["reward_valid"], dtype=torch.bool),
        "lengths": rlen, "truncated": torch.tensor([f == "length" for f in cols["finish_reason"]]),
        "group_index": torch.as_tensor(group_index, dtype=torch.long),
        "policy_version": torch.tensor(cols["policy_version"], dtype=torch.long),
    }


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
        self.length_schedule, self.ref_policy = algo_state(a)
        self.version = 0
        self.skipped_in_row = 0
        self.skipped_total = 0
        self.autocast = cfg.model.autocast_bf16 and (self.device.type == "cuda" or _cpu_has_bf16())

    # ------------------------------------------------------------------ forward
    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def token_logprobs(self, model, b: dict, rows: slice, with_entropy: bool = False):
        """Per-response-token logprobs (and entropies) at temperature ``rollout.temperature``."""
        ids = b["input_ids"][rows].to(self.device)
        att = b["attention_mask"][rows].to(self.device)
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=att).logits
        logits = logits.float() / self.cfg.rollout.temperature
        idx = b["gather_idx"][rows].to(self.device)
        picked = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [n, T, V]
        logp = logprobs_from_logits(picked, b["response_ids"][rows].to(self.device))
        ent = entropy_from_logits(picked.detach()) if with_entropy else None
        return logp, ent

    @torch.no_grad()
    def _no_grad_logprobs(self, model, b: dict) -> torch.Tensor:
        n, mbs = b["mask"].shape[0], self.cfg.train.micro_batch_size
        return torch.cat([self.token_logprobs(model, b, slice(i, i + mbs))[0] for i in range(0, n, mbs)])

    # ------------------------------------------------------------------ one step
    def train_step(self, table: pa.Table, step: Optional[int] = None) -> dict:
        cfg, a, t = self.cfg, self.cfg.algo, self.cfg.train
        step = self.version if step is None else step
        t0 = time.perf_counter()
        b = batch_to_tensors(table, self.pad_id)
        n = b["mask"].shape[0]
        correct = is_correct(b["raw_reward"])
        rewards, keep, shape_metrics = shape_rewards(
            b["raw_reward"], correct, b["lengths"], b["truncated"],
            max_length=cfg.rollout.max_new_tokens, step=step,
            schedule=self.length_schedule, cosine=a.length_penalty, valid=b["valid"],
            overlong_mode=a.overlong, overlong_buffer=a.overlong_buffer, overlong_factor=a.overlong_factor)
        keep = keep & b["valid"]
        # an engine that returned a non-finite behaviour logprob loses that sample, counted
        beh_bad = ~torch.where(b["mask"] > 0, b["behavior_logprobs"], torch.zeros_like(b["behavior_logprobs"])).isfinite().all(dim=1)
        keep = keep & ~beh_bad
        b["behavior_logprobs"] = torch.nan_to_num(b["behavior_logprobs"], nan=0.0, posinf=0.0, neginf=0.0)
        mask = b["mask"] * keep[:, None].float()
        # grading failures are masked out of baselines and whitening, never scored 0
        adv = compute_advantages(a.advantage, rewards, b["group_index"], mask, valid=b["valid"])
        b["mask"], b["advantages"] = mask, adv

        multi = t.mini_batches * t.ppo_epochs > 1
        old_all = self._no_grad_logprobs(self.model, b) if multi else None
        ref_all = self._no_grad_logprobs(self.ref, b) if a.kl_coef > 0 else None

        agg: dict[str, list[float]] = {}
        mb_size = n // t.mini_batches
        mbs = t.micro_batch_size
        grad_norms, updates = [], 0
        for _ in range(t.ppo_epochs):
            for m0 in range(0, n, mb_size):
                mb = slice(m0, min(n, m0 + mb_size))
                mb_tokens = float(mask[mb].sum().clamp(min=1.0))
                self.opt.zero_grad(set_to_none=True)
                finite = True
                for i in range(mb.start, mb.stop, mbs):
                    rows = slice(i, min(mb.stop, i + mbs))
                    logp, ent = self.token_logprobs(self.model, b, rows, with_entropy=True)
                    mk = mask[rows].to(logp.device)
                    if not torch.isfinite(torch.where(mk > 0, logp, torch.zeros_like(logp))).all():
                        finite = False  # the model itself produced NaN/inf: skip this update
                        break
                    old = old_all[rows].to(logp.device) if multi else logp.detach()
                    loss, sums = micro_batch_loss(
                        a, logp, ent, old, adv[rows].to(logp.device), b["behavior_logprobs"][rows].to(logp.device),
                        ref_all[rows].to(logp.device) if ref_all is not None else None, mk, mb_tokens)
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    loss.backward()
                    for k, v in sums.items():
                        _acc(agg, k, v)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip) if finite else torch.tensor(float("nan"))
                if not finite or not torch.isfinite(grad_norm):
                    self.opt.zero_grad(set_to_none=True)
                    self.skipped_total += 1
                    self.skipped_in_row += 1
                    if self.skipped_in_row >= t.max_skipped_steps:
                        raise NonFiniteStepError(
                            f"{self.skipped_in_row} consecutive updates had a non-finite loss or gradient norm "
                            f"(train.max_skipped_steps={t.max_skipped_steps}); stopping with the last good weights")
                    continue
                self.skipped_in_row = 0
                self.opt.step()
                updates += 1
                grad_norms.append(float(grad_norm))
        if updates:
            self.lr_sched.step()
        self.version += 1

        tokens = max(sum(agg.pop("_tokens", [0.0])), 1.0)  # valid tokens seen, over epochs
        metrics = {k: sum(v) / tokens for k, v in agg.items()}  # token means
        kl_mean = metrics.get("kl/loss_term")
        cause = self.ref_policy.update(step, kl=kl_mean)
        if cause:
            self.reset_reference(cause)
        dt = time.perf_counter() - t0
        metrics.update(shape_metrics)
        metrics.update({
            "actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "actor/lr": self.opt.param_groups[0]["lr"],
            "actor/skipped_updates": float(self.skipped_total),
            "is/nonfinite_behavior_samples": float(beh_bad.sum()),
            "actor/updates": float(updates),
            **batch_metrics(b, self.version, dt, t.ppo_epochs, cause),
        })
        return metrics

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



def algo_state(a) -> tuple[LengthPenaltySchedule, ReferenceResetPolicy]:
    """A learner's algo state objects from ``cfg.algo``: length-penalty schedule, reference-reset policy."""
    return (LengthPenaltySchedule(a.length_on_steps, a.length_off_steps, a.length_start_step),
            ReferenceResetPolicy(interval=a.ref_reset_interval, kl_spike_factor=a.ref_kl_spike_factor,
                                 kl_window=a.ref_kl_window, val_patience=a.ref_val_patience,
                                 reset_optimizer=a.ref_reset_optimizer))

def batch_metrics(b: dict, version: int, dt: float, ppo_epochs: int, cause: Optional[str]) -> dict[str, float]:
    """What one learner step reports about its batch, timing, staleness and reference reset.
    ``version`` is the learner's version after the step; ``b["mask"]`` the loss mask it used."""
    staleness = version - 1 - b["policy_version"]
    out = {
        "len/response_mean": float(b["lengths"].float().mean()),
        "len/truncated_frac": float(b["truncated"].float().mean()),
        "perf/train_s": dt,
        "perf/train_tok_s": float(b["attention_mask"].sum() * ppo_epochs) / dt,
        "perf/train_valid_tokens": float(b["mask"].sum()),
        "async/trained_staleness_max": float(staleness.max()),
        "async/trained_staleness_mean": float(staleness.float().mean()),
        "ref/reset": 1.0 if cause else 0.0,
        "policy_version": float(version),
    }
    if cause:
        out[f"ref/reset_{cause}"] = 1.0
    return out


def micro_batch_loss(a, logp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                     behavior: torch.Tensor, ref: Optional[torch.Tensor], mk: torch.Tensor,
                     num_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (``a`` = AlgoConfig): importance-corrected PPO-Clip + ``kl_coef`` *
    KL to the reference - ``entropy_coef`` * entropy, each a sum over valid tokens divided by
    ``num_tokens`` (the mini-batch's, or the global count), so micro-batches add up to the token
    mean. Returns the loss and token-weighted metric sums to accumulate (``_tokens`` = weight)."""
    pg, pm = policy_loss(logp, old, adv, mk, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                         behavior_logprobs=behavior, is_mode=a.is_mode, is_low=a.is_low, is_high=a.is_high,
                         num_tokens=num_tokens)
    zeros = torch.zeros_like(logp)
    loss = pg
    sums: dict[str, float] = {}
    if ref is not None:
        kl_term = torch.where(mk > 0, kl_penalty(logp, ref, a.kl_kind, mask=mk), zeros).sum() / num_tokens
        loss = loss + a.kl_coef * kl_term
        sums["kl/loss_term"] = float(kl_term.detach()) * num_tokens
    ent_term = torch.where(mk > 0, ent, zeros).sum() / num_tokens
    if a.entropy_coef:
        loss = loss - a.entropy_coef * ent_term
    w = float(mk.sum())  # metrics of this micro-batch weigh by its valid tokens
    sums["actor/pg_loss"] = float(pg.detach()) * num_tokens
    sums["actor/entropy"] = float(ent_term.detach()) * num_tokens
    for k, v in pm.items():
        sums[_metric_name(k)] = v * w
    sums["_tokens"] = w
    sums["is/logprob_abs_diff"] = float(torch.where(mk > 0, (old - behavior).abs(), zeros).sum())
    return loss, sums


def _acc(d: dict, k: str, v: float) -> None:
    d.setdefault(k, []).append(v)


def _metric_name(k: str) -> str:
    if k.startswith("is_"):
        return "is/" + k[3:]
    return "actor/" + k


def _cpu_has_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False
