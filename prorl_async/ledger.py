"""The ledger of every trained token: per learner step, one Parquet file of the rows the learner
trained on, in the order it trained on them (``train.record_rollouts``).

    <run_dir>/ledger/step-000042.parquet    the batch of history step 42 (the update that made version 42)

One row per response (:data:`LEDGER_SCHEMA`): what the learner read (the columns that rebuild
its batch exactly, :func:`batch_table`), and what it computed at the start of the step, per
token: its own logprobs (``learner_logprobs``, the weights before the update), the reference's
(``ref_logprobs``, with a KL term), the importance weight it applied to each token
(``is_weights``: ``exp(learner - behaviour)`` truncated or masked by ``algo.is_mode``), the
whitened advantages, and per sample the shaped reward, the verdict and the grader's reason,
whether the sample was in the loss, and its KL to the reference summed over its tokens
(``kl_sum``, the estimator of ``algo.kl_kind``: the sample's share of the step's ``kl/loss_term``
numerator). The policy version of every token is the row's ``policy_version`` (the oldest
weights that sampled it) up to ``policy_version_end`` (the newest; equal unless vLLM applied a
weight update mid-request). Held-out scores the learner received before the step (they can
reset the reference: ``val_stall``) are in the file's metadata (``observations``), so that
``prorl-async replay`` (:mod:`prorl_async.replay`) re-applies them in the order they happened.

This follows the peers' training-data dumps (slime's ``--save-debug-rollout-data``, prime-rl's
saved rollouts) and answers verl #7495 (nobody could tell which policy produced what was trained).
Deviation: a data-parallel DeepSpeed run writes one file per rank (``step-N.rank-R.parquet``:
that rank's groups); replay reads single-learner ledgers only.

Pure: no Ray.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from prorl_async.algo.losses import importance_weight
from prorl_async.learners.batch import LEARNER_COLUMNS
from prorl_async.metrics import is_correct

LEDGER_DIR = "ledger"
_FILE_RE = re.compile(r"^step-(\d{6,})(?:\.rank-(\d+))?\.parquet$")
OBSERVATIONS = b"observations"  # Parquet metadata key: held-out scores the learner got before the step

_F32 = pa.list_(pa.float32())
LEDGER_SCHEMA = pa.schema([
    pa.field("step", pa.int64()),                 # history step (the update that made this version)
    pa.field("row", pa.int32()),                  # position in the trained batch (mini-batches are slices of it)
    pa.field("sample_id", pa.string()),
    pa.field("request_id", pa.string()),
    pa.field("prompt_id", pa.string()),
    pa.field("domain", pa.string()),
    pa.field("prompt_ids", pa.list_(pa.int32())),
    pa.field("response_ids", pa.list_(pa.int32())),
    pa.field("response_text", pa.string()),
    pa.field("policy_version", pa.int64()),       # oldest weights among the response's tokens
    pa.field("policy_version_end", pa.int64()),   # newest (differs only with in-flight weight updates)
    pa.field("finish_reason", pa.string()),
    pa.field("behavior_logprobs", _F32),          # per response token, from the engine, as the learner read them
    pa.field("learner_logprobs", _F32),           # per response token, the learner's weights at the start of the step
    pa.field("ref_logprobs", _F32),               # the reference policy's (null without a KL term)
    pa.field("is_weights", _F32),                 # the importance weight applied per token (algo.is_mode)
    pa.field("advantages", _F32),                 # per response token, after whitening
    pa.field("raw_reward", pa.float32()),         # the verifier's
    pa.field("reward", pa.float32()),             # shaped (length penalty, overlong)
    pa.field("reward_valid", pa.bool_()),
    pa.field("verdict", pa.string()),             # correct / wrong / invalid
    pa.field("grade_reason", pa.string()),
    pa.field("in_loss", pa.bool_()),              # false: masked (invalid grade, overlong filter, bad logprob)
    pa.field("response_len", pa.int32()),
    pa.field("kl_sum", pa.float64()),             # sum over the sample's loss tokens of the KL estimator (0 without)
])


#: the prepared-batch tensors :func:`step_rows` reads (the learner keeps these until it is asked)
LEDGER_INPUTS = ("lengths", "start_logprobs", "behavior_logprobs", "mask", "ref_logprobs", "raw_reward", "valid",
                 "reward", "advantages")


class LedgerError(ValueError):
    """A missing or unusable ledger / step; the message names it and the fix."""


def ledger_dir(run_dir) -> Path:
    return Path(run_dir) / LEDGER_DIR


def step_file(run_dir, step: int, rank: Optional[int] = None) -> Path:
    suffix = "" if rank is None else f".rank-{rank}"
    return ledger_dir(run_dir) / f"step-{step:06d}{suffix}.parquet"


# ---------------------------------------------------------------------- building a step's rows
def _ragged(x: torch.Tensor, lengths: np.ndarray) -> pa.Array:
    """Rows of ``x`` ``[N, T]`` cut to ``lengths`` as a list<float32> column (one flat copy)."""
    T = x.shape[1] if x.dim() == 2 else 0
    keep = torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]
    values = x.detach().float().cpu()[keep].numpy() if T else np.zeros(0, np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32()))


def is_weights(learner_lp: torch.Tensor, behavior: torch.Tensor, is_mode: str, lo: float, hi: float) -> torch.Tensor:
    """The per-token importance weight :func:`prorl_async.algo.losses.policy_loss` applies
    (``exp(old - behaviour)``, truncated (tis) or masked (icepop) to [lo, hi]; 1 for none)."""
    return importance_weight(torch.exp(learner_lp.double() - behavior.double()), is_mode, lo, hi)


def _column(table: pa.Table, name: str, n: int, default) -> pa.Array:
    if name in table.column_names:
        return table.column(name).combine_chunks()
    return pa.array([default] * n)


def step_rows(table: pa.Table, b: dict, step: int, cfg) -> pa.Table:
    """The ledger rows of one learner step: ``table`` (the batch as the learner got it, every
    column), ``b`` (its prepared batch after the update loop: ``reward``, ``mask``, ``advantages``,
    ``start_logprobs``, ``ref_logprobs``), ``step`` (the history step, learner version after it)."""
    a = cfg.algo
    n = table.num_rows
    lengths = b["lengths"].numpy().astype(np.int64)
    start, beh, mask = b["start_logprobs"].float().cpu(), b["behavior_logprobs"].cpu(), b["mask"].cpu()
    ref = b.get("ref_logprobs")
    kl_sum = np.zeros(n)
    if ref is not None:
        from prorl_async.algo.losses import kl_penalty

        ref = ref.float().cpu()
        kl = kl_penalty(torch.where(mask > 0, start, 0.0), torch.where(mask > 0, ref, 0.0), a.kl_kind, mask=mask)
        kl_sum = (kl * mask).double().sum(dim=1).numpy()
    raw = b["raw_reward"]
    verdict = np.where(~b["valid"].numpy(), "invalid", np.where(is_correct(raw).numpy(), "correct", "wrong"))
    version = _column(table, "policy_version", n, 0)
    cols = {
        "step": pa.array(np.full(n, step, np.int64)),
        "row": pa.array(np.arange(n, dtype=np.int32)),
        "sample_id": _column(table, "sample_id", n, ""),
        "request_id": _column(table, "request_id", n, ""),
        "prompt_id": _column(table, "prompt_id", n, ""),
        "domain": _column(table, "domain", n, ""),
        "prompt_ids": _column(table, "prompt_ids", n, []),
        "response_ids": _column(table, "response_ids", n, []),
        "response_text": _column(table, "response_text", n, ""),
        "policy_version": version,
        "policy_version_end": _column(table, "policy_version_end", n, None) if "policy_version_end" in table.column_names
        else version,
        "finish_reason": _column(table, "finish_reason", n, ""),
        "behavior_logprobs": _column(table, "behavior_logprobs", n, []),  # raw: a NaN stays a NaN
        "learner_logprobs": _ragged(start, lengths),
        "ref_logprobs": _ragged(ref, lengths) if ref is not None else pa.nulls(n, _F32),
        "is_weights": _ragged(is_weights(start, beh, a.is_mode, a.is_low, a.is_high), lengths),
        "advantages": _ragged(b["advantages"].cpu(), lengths),
        "raw_reward": pa.array(raw.numpy().astype(np.float32)),
        "reward": pa.array(b["reward"].numpy().astype(np.float32)),
        "reward_valid": pa.array(b["valid"].numpy()),
        "verdict": pa.array(verdict.astype(object)),
        "grade_reason": _column(table, "grade_reason", n, ""),
        "in_loss": pa.array((mask.sum(dim=1) > 0).numpy()),
        "response_len": pa.array(lengths.astype(np.int32)),
        "kl_sum": pa.array(kl_sum.astype(np.float64)),
    }
    return pa.Table.from_arrays([cols[f.name].cast(f.type) for f in LEDGER_SCHEMA], schema=LEDGER_SCHEMA)


def write_step(run_dir, rows: pa.Table, observations: list[dict], rank: Optional[int] = None) -> Path:
    """``rows`` as the step's file (temp file + rename: a reader sees a whole file or none)."""
    step = int(rows.column("step")[0].as_py()) if rows.num_rows else 0
    path = step_file(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {OBSERVATIONS: json.dumps(observations).encode()}
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    pq.write_table(rows.replace_schema_metadata(meta), tmp)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------- reading
def recorded_steps(run_dir) -> list[int]:
    """The steps whose single-learner file exists, ascending."""
    d = ledger_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _FILE_RE.match(p.name)) and m.group(2) is None)


def _missing(run_dir, what: str) -> LedgerError:
    d = ledger_dir(run_dir)
    steps = recorded_steps(run_dir)
    if not Path(run_dir).is_dir():
        return LedgerError(f"{run_dir} is not a prorl-async run: no such directory")
    if not steps:
        ranks = [p.name for p in d.glob("step-*.rank-*.parquet")] if d.is_dir() else []
        if ranks:
            return LedgerError(f"{d} holds per-rank files of a data-parallel run ({ranks[0]} ...); replay reads "
                               "single-learner ledgers (train.num_learners=1)")
        return LedgerError(f"{run_dir} has no ledger ({d} is missing or empty): the run was trained with "
                           "train.record_rollouts=false; train with train.record_rollouts=true to record one")
    return LedgerError(f"{what} is not in the ledger of {run_dir} (recorded steps: {_span(steps)}); pass one of those")


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")


def read_step(run_dir, step: int) -> tuple[pa.Table, list[dict]]:
    """The rows of ``step`` and the observations before it; :class:`LedgerError` if absent."""
    path = step_file(run_dir, step)
    if not path.is_file():
        raise _missing(run_dir, f"step {step}")
    try:
        pf = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise LedgerError(f"{path} is not a readable ledger file ({e}); delete it and replay another step") from None
    missing = [f.name for f in LEDGER_SCHEMA if f.name not in pf.column_names]
    if missing:
        raise LedgerError(f"{path} lacks ledger column(s) {missing}; it was not written by this version of prorl-async")
    meta = pf.schema.metadata or {}
    return pf.replace_schema_metadata(None), json.loads(meta.get(OBSERVATIONS, b"[]"))


def batch_table(rows: pa.Table) -> pa.Table:
    """The learner's batch rebuilt from a step's ledger rows: its columns, in its order."""
    rows = rows.sort_by("row")
    return rows.select(list(LEARNER_COLUMNS))


# ---------------------------------------------------------------------- queries
def reset_steps(history: list[dict]) -> list[tuple[int, str]]:
    """``(step, cause)`` of every reference reset in ``history``, in order (a step with two causes twice)."""
    out = []
    for h in history:
        for k, v in h.items():
            if k.startswith("ref/reset_") and v:
                out.append((int(h["step"]), k.removeprefix("ref/reset_")))
    return out


RANKINGS = {
    "kl": "kl_sum: the sample's KL to the reference summed over its tokens (its share of the step's KL term)",
    "advantage": "|advantage| summed over the sample's tokens (its push on the policy gradient)",
    "is_weight": "|1 - importance weight| summed over the sample's tokens (off-policy correction it needed)",
    "mismatch": "|learner - behaviour logprob| summed over the sample's tokens",
}


def top_samples(rows: pa.Table, by: str = "kl", k: int = 10) -> list[dict]:
    """The ``k`` samples of a step that weigh most by ``by`` (:data:`RANKINGS`), each with its
    share of the step's total and what identifies it."""
    if by not in RANKINGS:
        raise LedgerError(f"--by {by!r}: choose one of {', '.join(RANKINGS)}")
    if by == "kl":
        score = rows.column("kl_sum").to_numpy()
    else:
        col = {"advantage": "advantages", "is_weight": "is_weights", "mismatch": "learner_logprobs"}[by]
        flat = pc.list_flatten(rows.column(col)).to_numpy(zero_copy_only=False).astype(np.float64)
        if by == "is_weight":
            flat = np.abs(1.0 - flat)
        elif by == "mismatch":
            flat = np.abs(flat - pc.list_flatten(rows.column("behavior_logprobs")).to_numpy(zero_copy_only=False))
        else:
            flat = np.abs(flat)
        ends = np.cumsum(rows.column("response_len").to_numpy().astype(np.int64))
        cs = np.concatenate([[0.0], np.cumsum(np.nan_to_num(flat))])
        score = cs[ends] - cs[np.concatenate([[0], ends[:-1]])]
    score = score * rows.column("in_loss").to_numpy(zero_copy_only=False)
    total = float(np.abs(score).sum()) or 1.0
    order = np.argsort(-score, kind="stable")[:k]
    keep = ["sample_id", "prompt_id", "domain", "policy_version", "response_len", "raw_reward", "verdict",
            "grade_reason", "response_text"]
    picked = rows.take(pa.array(order)).select(keep).to_pylist()
    return [{"score": float(score[i]), "share": float(score[i]) / total, **r} for i, r in zip(order, picked)]
