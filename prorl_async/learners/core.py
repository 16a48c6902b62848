"""The learner core shared by :class:`~prorl_async.learners.torch_learner.TorchLearner` and
:class:`~prorl_async.learners.deepspeed.DeepSpeedLearner`: one ProRL v2 update per call.

Per step (DESIGN.md section 1; formulas in :mod:`prorl_async.algo`):

1. rollout rows -> tensors from the learner's columns only, read from Arrow list offsets
   without Python lists (:mod:`prorl_async.learners.batch`); shaped rewards (scheduled cosine
   length reward, overlong filter / DAPO soft punishment); samples with an invalid grade or a
   non-finite behaviour logprob leave the loss mask, counted;
2. REINFORCE++-baseline advantages (group-mean baseline, whitening over the *global* batch:
   the statistics go through the optimizer's all-reduce on data-parallel ranks);
3. ``old_logprobs`` recomputed with the current weights when the batch takes several
   optimizer steps (otherwise the first forward's detached values), reference logprobs when
   the KL penalty is on;
4. exactly ``train.mini_batches`` x ``train.ppo_epochs`` optimizer steps: the rows are split
   into ``mini_batches`` near-equal slices whatever their count (63 rows, 4 mini-batches ->
   16/16/16/15), each a token-mean importance-corrected PPO-Clip + KL - entropy loss
   accumulated over micro-batches (the mini-batch's valid tokens summed over ranks);
5. the non-finite rule: a mini-batch whose loss or gradient norm is non-finite changes
   nothing (weights and optimizer state bitwise as before), is counted in
   ``actor/skipped_updates``, and ``train.max_skipped_steps`` of them in a row stop the run;
   an update with finite numbers that would wreck the weights (``train.lr=1e30``) is refused
   the same way by the learner's ``finish_update`` (:mod:`prorl_async.learners.update_guard`,
   also counted in ``actor/refused_updates``), so the weights a stop keeps are good ones;
6. training/inference mismatch (:mod:`prorl_async.algo.mismatch`) on the start-of-step
   logprobs: ``mismatch/*`` over tokens generated with the learner's current weights
   (``policy_version`` = learner version), ``mismatch/all_*`` over all tokens;
7. reference reset on interval / KL spike / validation stall.

Micro-batches (``train.micro_batch_tokens > 0``, the default): sequence packing as OpenRLHF's
``packing_samples`` and verl's dynamic batch size do. Each mini-batch's rows are grouped into
micro-batches of at most ``micro_batch_tokens`` prompt+response tokens
(:func:`~prorl_async.learners.packing.plan_micro_batches`), each packed into one row without
padding with position ids restarting per sequence and attention kept inside each sequence
(:mod:`prorl_async.learners.logprobs`), and the response logprobs / entropies come from the LM head in
chunks of ``train.logprob_chunk_tokens`` (:mod:`prorl_async.algo.token_logprobs`), never a
``tokens x vocab`` fp32 tensor. With ``train.share_prefixes`` a micro-batch is the prefix tree of
its sequences (:func:`~prorl_async.learners.packing.pack_shared_micro_batch`): a group's prompt
and any other common prefix are computed once, the budget counts them once. ``micro_batch_tokens=0`` keeps the padded path (right-padded
rows of ``train.micro_batch_size``, full logits). Both give the same loss and gradients to float
tolerance (tests/learners/test_packed_learner.py); only the micro-batch-dependent ``*_max`` /
``*_min`` metric means of ``actor/`` and ``is/`` differ.

What the core needs from a learner (``ops``) is :class:`~prorl_async.learners.base.LearnerOps`:
``policy`` (the module to call), ``device``, ``autocast``, ``micro`` (micro-batch rows),
``zero_grad()``, ``backward(loss)``, ``finish_update(finite) -> (applied, grad_norm)``,
``reduce(tensor, op)`` (identity on one process) and the step's state; the torch learner owns
AdamW and clipping, the DeepSpeed learner its engine, ZeRO and checkpoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import pyarrow as pa
import torch

from prorl_async.algo.losses import kl_penalty, policy_loss
from prorl_async.algo.mismatch import mismatch_metrics, mismatch_stats
from prorl_async.algo.reference import ReferenceResetPolicy
from prorl_async.algo.shaping import LengthPenaltySchedule
from prorl_async.learners import host_memory
from prorl_async.learners.batch import learner_columns, prepare_batch
from prorl_async.ledger import LEDGER_INPUTS, step_rows
from prorl_async.learners.logprobs import packed_token_logprobs, padded_token_logprobs
from prorl_async.learners.packing import plan_micro_batches, plan_shared_micro_batches

if TYPE_CHECKING:
    from prorl_async.config import Config
    from prorl_async.learners.base import LearnerOps


def algo_state(a) -> tuple[LengthPenaltySchedule, ReferenceResetPolicy]:
    """A learner's algo state objects from ``cfg.algo``: length-penalty schedule, reference-reset policy."""
    return (LengthPenaltySchedule(a.length_on_steps, a.length_off_steps, a.length_start_step),
            ReferenceResetPolicy(interval=a.ref_reset_interval, kl_spike_factor=a.ref_kl_spike_factor,
                                 kl_window=a.ref_kl_window, val_patience=a.ref_val_patience,
                                 reset_optimizer=a.ref_reset_optimizer, kl_max=a.ref_kl_max))


class NonFiniteStepError(RuntimeError):
    """Too many consecutive non-finite steps."""


# ---------------------------------------------------------------------- update plan
def mini_batch_slices(n: int, mini_batches: int) -> list[slice]:
    """``mini_batches`` contiguous slices of ``n`` rows, sizes differing by at most one
    (63 rows, 4 mini-batches -> 16, 16, 16, 15); some are empty when ``n < mini_batches``."""
    if mini_batches < 1:
        raise ValueError(f"train.mini_batches must be >= 1, got {mini_batches}")
    q, r = divmod(n, mini_batches)
    sizes = [q + (1 if i < r else 0) for i in range(mini_batches)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(mini_batches)]


def sync_device(backend: str, device) -> str:
    """Where weight-sync buffers live: the learner's / engine's CUDA device for NCCL (which only
    moves CUDA tensors), CPU for gloo."""
    return str(device) if backend == "nccl" else "cpu"


# ---------------------------------------------------------------------- loss, metrics
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


def batch_metrics(b: dict, version: int, dt: float, ppo_epochs: int, cause: Optional[str]) -> dict[str, float]:
    """What one learner step reports about its batch, timing, staleness and reference reset.
    ``version`` is the learner's version after the step; ``b["mask"]`` the loss mask it used."""
    staleness = version - 1 - b["policy_version"]
    out = {
        "len/response_mean": float(b["lengths"].float().mean()),
        "len/truncated_frac": float(b["truncated"].float().mean()),
        "perf/train_s": dt,
        "perf/train_tok_s": float(b["seq_lens"].sum() * ppo_epochs) / dt,
        "perf/train_valid_tokens": float(b["mask"].sum()),
        "async/trained_staleness_max": float(staleness.max()),
        "async/trained_staleness_mean": float(staleness.float().mean()),
        "ref/reset": 1.0 if cause else 0.0,
        "policy_version": float(version),
    }
    if cause:
        out[f"ref/reset_{cause}"] = 1.0
    return out


def _acc(d: dict, k: str, v: float) -> None:
    d.setdefault(k, []).append(v)


def _metric_name(k: str) -> str:
    if k.startswith("is_"):
        return "is/" + k[3:]
    return "actor/" + k


# ---------------------------------------------------------------------- the step
class LearnerCore:
    """The update loop over a learner's ``ops`` (see the module docstring)."""

    def __init__(self, cfg: Config, ops: LearnerOps):
        self.cfg, self.ops = cfg, ops
        self._ledger_inputs: Optional[tuple] = None  # the last step's table, tensors and step, for ledger_rows
        self.batch_kl: Optional[float] = None  # the last step's KL token mean over every rank (train_step)

    def ledger_rows(self) -> Optional[pa.Table]:
        """The last step's rows for the ledger (:func:`prorl_async.ledger.step_rows`); None with
        ``train.record_rollouts`` off. Built once, when asked (the learner actor asks after the step)."""
        if self._ledger_inputs is None:
            return None
        table, b, step = self._ledger_inputs
        self._ledger_inputs = None
        return step_rows(table, b, step, self.cfg)

    @property
    def packing(self) -> bool:
        return self.cfg.train.micro_batch_tokens > 0

    def _logprobs(self, model, b, rows, with_entropy=False):
        """Logprobs (and entropies) ``[len(rows), T]`` of ``rows`` (a slice on the padded path, an
        index array of packed rows with packing)."""
        o, t = self.ops, self.cfg.train
        temp = self.cfg.rollout.temperature
        if self.packing:
            return packed_token_logprobs(model, b, rows, temp, o.device, o.autocast, with_entropy,
                                         chunk_tokens=t.logprob_chunk_tokens, compiled=o.compiled,
                                         share_prefixes=t.share_prefixes)
        return padded_token_logprobs(model, b, rows, temp, o.device, o.autocast, with_entropy,
                              entropy_grad=self.cfg.algo.entropy_coef != 0)

    def micro_batches(self, b: dict, rows: slice) -> list:
        """The micro-batches of a slice of rows: ``train.micro_batch_size`` contiguous rows each
        (padded path), or with packing index arrays of rows holding at most
        ``train.micro_batch_tokens`` prompt+response tokens (first-fit decreasing; a sequence
        longer than that gets a micro-batch of its own), a shared prefix counted once with
        ``train.share_prefixes`` (rows in prefix-tree order). Planned once per batch and slice
        (kept in ``b``): a step asks for the same plan for its mini-batches, the rank's count of
        micro-batches and each no-grad pass, and a shared-prefix plan sorts every row."""
        if rows.start >= rows.stop:
            return []
        if not self.packing:
            mbs = self.ops.micro
            return [slice(i, min(rows.stop, i + mbs)) for i in range(rows.start, rows.stop, mbs)]
        cache = b.setdefault("_plans", {})
        if (rows.start, rows.stop) not in cache:
            lens = b["seq_lens"][rows]
            budget = max(self.cfg.train.micro_batch_tokens, int(lens.max()))
            if self.cfg.train.share_prefixes:
                plan = plan_shared_micro_batches(b["_prompt"], b["_response"], np.arange(rows.start, rows.stop), budget)
            else:
                plan = [p + rows.start for p in plan_micro_batches(lens, budget)]
            cache[(rows.start, rows.stop)] = plan
        return cache[(rows.start, rows.stop)]

    def _dummy_rows(self):
        return np.zeros(1, dtype=np.int64) if self.packing else slice(0, 1)

    @torch.no_grad()
    def no_grad_logprobs(self, model, b: dict, n_micro: Optional[int] = None) -> torch.Tensor:
        """Logprobs of every row; ``n_micro`` pads the loop with forwards of row 0 so that every
        rank runs as many forwards as the busiest one (ZeRO-3 gathers parameters in each)."""
        n = b["mask"].shape[0]
        out = torch.zeros_like(b["mask"])
        parts = self.micro_batches(b, slice(0, n))
        for rows in parts:
            idx = torch.as_tensor(rows) if not isinstance(rows, slice) else rows
            out[idx] = self._logprobs(model, b, rows)[0].to(out.device)
        for _ in range(len(parts), n_micro or 0):
            self._logprobs(model, b, self._dummy_rows())
        return out

    def learner_step(self, table: pa.Table, step: Optional[int], stats_reduce=None) -> dict:
        """One learner step on a rollout table, the same for both learners: prepare the batch,
        update, step the LR schedule if the update was applied, advance the version, ask the
        reference-reset policy, and report the step's metrics. The learner (``ops``) provides
        ``version``, ``pad_id``, ``ref``, ``length_schedule``, ``ref_policy``, ``lr_sched``
        and ``reset_reference``."""
        o = self.ops
        step = o.version if step is None else step
        t0 = time.perf_counter()
        full = table
        table = learner_columns(table)  # display columns (response_text ...) are dropped here, zero-copy
        b, shape_metrics = prepare_batch(table, o.pad_id, self.cfg, step, o.length_schedule, stats_reduce=stats_reduce)
        metrics = self.train_step(b, o.ref, step, o.version)
        # what the ledger's rows of this step are built from (train.record_rollouts; built on demand, off the step's clock)
        self._ledger_inputs = (full, {k: b[k] for k in LEDGER_INPUTS}, step + 1) if self.cfg.train.record_rollouts else None
        if metrics["actor/updates"]:
            o.lr_sched.step()
        o.version += 1
        # the reset policy counts policy versions: the reference is version 0, this update makes step + 1
        cause = o.ref_policy.update(step + 1, kl=self.batch_kl)
        if cause:
            o.reset_reference(cause)
        metrics.update(shape_metrics)
        metrics["actor/lr"] = o.lr_sched.get_last_lr()[0]
        metrics.update(batch_metrics(b, o.version, time.perf_counter() - t0, self.cfg.train.ppo_epochs, cause))
        metrics.update(host_memory.bound_free_heap(self.cfg.train.reuse_freed_memory_gb))  # a CPU learner's kept heap
        return metrics

    def train_step(self, b: dict, ref_model, step: int, version: int) -> dict:
        """One update on prepared batch ``b`` (:func:`prepare_batch`); returns metrics without
        the step-level ones (version, timing) that the learner adds."""
        a, t, o = self.cfg.algo, self.cfg.train, self.ops
        mask, adv, n = b["mask"], b["advantages"], b["mask"].shape[0]
        slices = mini_batch_slices(n, t.mini_batches)
        plans = [self.micro_batches(b, s) for s in slices]
        # every rank runs as many micro-batches per mini-batch as the busiest rank (collectives pair up)
        counts = o.reduce(torch.tensor([len(p) for p in plans] + [len(self.micro_batches(b, slice(0, n)))],
                                       dtype=torch.float64), "max").long().tolist()
        multi = t.mini_batches * t.ppo_epochs > 1
        old_all = self.no_grad_logprobs(o.policy, b, counts[-1]) if multi else None
        ref_all = self.no_grad_logprobs(ref_model, b) if a.kl_coef > 0 else None
        start_lp = old_all.clone() if multi else torch.zeros_like(mask)  # start-of-step logprobs
        seen = torch.full((n,), multi, dtype=torch.bool)

        agg: dict[str, list[float]] = {}
        grad_norms, updates, skipped = [], 0, 0
        for _ in range(t.ppo_epochs):
            for j, mb in enumerate(slices):
                mb_tokens = float(o.reduce(mask[mb].sum().double().reshape(1), "sum").clamp(min=1.0))
                o.zero_grad()
                finite = True
                for k in range(counts[j]):
                    dummy = k >= len(plans[j])  # this rank has fewer micro-batches: a zero-gradient pass
                    rows = self._dummy_rows() if dummy else plans[j][k]
                    logp, ent = self._logprobs(o.policy, b, rows, with_entropy=True)
                    if not isinstance(rows, slice):
                        rows = torch.as_tensor(rows)
                    mk = mask[rows].to(logp.device) * (0.0 if dummy else 1.0)
                    if not dummy and not multi:
                        start_lp[rows] = logp.detach().to(start_lp.device)
                        seen[rows] = True
                    loss = None
                    if torch.isfinite(torch.where(mk > 0, logp, torch.zeros_like(logp))).all():
                        old = old_all[rows].to(logp.device) if multi else logp.detach()
                        loss, sums = micro_batch_loss(
                            a, logp, ent, old, adv[rows].to(logp.device), b["behavior_logprobs"][rows].to(logp.device),
                            ref_all[rows].to(logp.device) if ref_all is not None else None, mk, mb_tokens)
                    if loss is None or not torch.isfinite(loss):
                        finite = False  # the model or the loss produced NaN/inf: this update is skipped
                        if not o.run_all_micro_batches:
                            break
                        loss = logp.sum() * float("nan")  # keeps collectives in step; NaN grads skip the step
                    o.backward(loss, last=(k == counts[j] - 1))
                    if finite and not dummy:
                        for key, v in sums.items():
                            _acc(agg, key, v)
                applied, grad_norm = o.finish_update(finite)
                if not applied:
                    skipped += 1
                    o.skipped_total += 1
                    o.skipped_in_row += 1
                    if o.skipped_in_row >= t.max_skipped_steps:
                        raise NonFiniteStepError(
                            f"{o.skipped_in_row} consecutive updates had a non-finite loss or gradient norm, or "
                            f"would have moved the weights by more than train.max_update_ratio={t.max_update_ratio} "
                            f"of their norm (train.max_skipped_steps={t.max_skipped_steps}); stopping with the last "
                            f"good weights (no such update was applied)")
                    continue
                o.skipped_in_row = 0
                updates += 1
                grad_norms.append(float(grad_norm))

        seen_tokens = sum(agg.pop("_tokens", [0.0]))  # valid tokens seen, over epochs
        tokens = max(seen_tokens, 1.0)
        metrics = {k: sum(v) / tokens for k, v in agg.items()}  # token means (this rank's)
        # what the reference-reset policy judges: the whole batch's KL token mean, alike on every rank
        # (a rank's own mean differs with its shard; a KL-spike reset decided on it would reset that
        # rank's reference and optimizer state and not the others', and the ranks' weights would part)
        self.batch_kl = None
        if a.kl_coef > 0:
            kl_sum, kl_tokens = o.reduce(torch.tensor([sum(agg.get("kl/loss_term", [0.0])), seen_tokens],
                                                      dtype=torch.float64), "sum").tolist()
            self.batch_kl = kl_sum / kl_tokens if kl_tokens > 0 else None
        metrics.update({
            "actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "actor/skipped_updates": float(o.skipped_total),
            "actor/refused_updates": float(o.refused_updates),  # too large
            "actor/updates": float(updates),
            "is/nonfinite_behavior_samples": float(o.reduce(b["beh_bad"].sum().double().reshape(1), "sum")),
        })
        metrics.update(self.mismatch(b, start_lp, seen, version))
        b["start_logprobs"], b["ref_logprobs"] = start_lp, ref_all  # what the ledger records
        return metrics

    def mismatch(self, b: dict, learner_lp: torch.Tensor, seen: torch.Tensor, version: int) -> dict[str, float]:
        """``mismatch/*`` on tokens generated with the current weights, ``mismatch/all_*`` on all."""
        a, o = self.cfg.algo, self.ops
        beh = b["behavior_logprobs"]
        resp = b["response_mask"] * seen[:, None].float()
        lp = torch.where(resp > 0, learner_lp.float().to(beh.device), torch.zeros_like(beh))
        resp = resp * lp.isfinite().all(dim=1)[:, None].float()  # a NaN forward skips the step; not measured
        lp = torch.nan_to_num(lp, nan=0.0, posinf=0.0, neginf=0.0)
        current = (b["policy_version"] == version)[:, None].float()
        out = {}
        for prefix, m in (("mismatch/", resp * current), ("mismatch/all_", resp)):
            s = mismatch_stats(lp, beh, m, a.is_low, a.is_high)
            s = torch.cat([o.reduce(s[:4].clone(), "sum"), o.reduce(s[4:].clone(), "max")])
            out.update(mismatch_metrics(s, prefix))
        return out
