"""Rollout rows (Arrow) -> the learner's tensors: what one update reads from a batch.

:func:`batch_to_tensors` reads the learner's columns only (:data:`LEARNER_COLUMNS`; display
columns such as ``response_text`` never reach the learner) from Arrow list offsets
(:func:`~prorl_async.learners.packing.list_column`), without a Python list per token.
:func:`prepare_batch` adds the shaped rewards (:mod:`prorl_async.algo.shaping`), the loss mask
(samples with an invalid grade or a non-finite behaviour logprob leave it) and the advantages
(:mod:`prorl_async.algo.advantages`). :func:`shard_groups` deals a batch's whole groups out to
data-parallel ranks.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from prorl_async.algo.advantages import compute_advantages
from prorl_async.algo.shaping import shape_rewards
from prorl_async.learners.packing import list_column
from prorl_async.metrics import is_correct

# the only columns the learner reads; display columns (response_text, grade_reason ...) never reach it
LEARNER_COLUMNS = ("prompt_id", "prompt_ids", "response_ids", "behavior_logprobs", "raw_reward", "reward_valid",
                   "finish_reason", "policy_version")


def learner_columns(table: pa.Table) -> pa.Table:
    """The learner's columns of a rollout table (zero-copy), one clear error if one is missing."""
    missing = [c for c in LEARNER_COLUMNS if c not in table.column_names]
    if missing:
        raise KeyError(f"rollout table lacks learner column(s) {missing} (has {table.column_names}); batches must "
                       "follow prorl_async.data.schema.ROLLOUT_SCHEMA")
    return table.select(list(LEARNER_COLUMNS))


def _flat(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every element of a ``(values, offsets)`` list column as ``(flat values, row, column)``."""
    lens = np.diff(offsets)
    row = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    col = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lens)
    return values[offsets[0]:offsets[-1]], torch.from_numpy(row), torch.from_numpy(col)


def batch_to_tensors(table: pa.Table, pad_id: int, padded: bool = True) -> dict:
    """Rollout rows -> response-aligned ``[N, T]`` tensors, straight from Arrow list offsets
    (:func:`prorl_async.learners.packing.list_column`; no Python list per token).

    Always: ``response_ids``, ``mask``, ``behavior_logprobs``, per-row rewards / flags, and
    ``seq_lens`` plus the ``_prompt`` / ``_response`` ``(values, offsets)`` columns that
    sequence packing reads. ``padded``: also the right-padded ``input_ids`` /
    ``attention_mask`` ``[N, S]`` and ``gather_idx`` of the padded forward."""
    table = learner_columns(table)
    prompt, response = list_column(table, "prompt_ids"), list_column(table, "response_ids")
    bv, bo = list_column(table, "behavior_logprobs")
    plen_np, rlen_np = np.diff(prompt[1]), np.diff(response[1])
    if not np.array_equal(np.diff(bo), rlen_np):
        raise ValueError("rollout table: behavior_logprobs must have one entry per response token in every row")
    n = int(plen_np.size)
    plen, rlen = torch.from_numpy(plen_np), torch.from_numpy(rlen_np)
    T = max(1, int(rlen_np.max())) if n else 1
    r_vals, r_row, r_col = _flat(*response)
    response_ids = torch.zeros((n, T), dtype=torch.long)
    response_ids[r_row, r_col] = torch.from_numpy(r_vals.astype(np.int64))
    beh = torch.zeros((n, T), dtype=torch.float32)
    beh[r_row, r_col] = torch.from_numpy(bv[bo[0]:bo[-1]].astype(np.float32))
    mask = (torch.arange(T)[None, :] < rlen[:, None]).float()
    prompt_id = table.column("prompt_id").to_numpy(zero_copy_only=False)  # one object per row, not per token
    _, group_index = np.unique(prompt_id, return_inverse=True)
    out = {
        "response_ids": response_ids, "mask": mask, "behavior_logprobs": beh,
        "raw_reward": torch.from_numpy(table.column("raw_reward").to_numpy().astype(np.float32)),
        "valid": torch.from_numpy(table.column("reward_valid").to_numpy(zero_copy_only=False).astype(bool)),
        "lengths": rlen, "truncated": torch.from_numpy(
            pc.equal(table.column("finish_reason"), "length").to_numpy(zero_copy_only=False).astype(bool)),
        "group_index": torch.as_tensor(group_index.reshape(-1), dtype=torch.long),
        "policy_version": torch.from_numpy(table.column("policy_version").to_numpy().astype(np.int64)),
        "seq_lens": plen_np + rlen_np, "_prompt": prompt, "_response": response,
    }
    if padded:
        S = int((plen + rlen).max()) if n else 1
        input_ids = torch.full((n, S), pad_id, dtype=torch.long)
        p_vals, p_row, p_col = _flat(*prompt)
        input_ids[p_row, p_col] = torch.from_numpy(p_vals.astype(np.int64))
        input_ids[r_row, plen[r_row] + r_col] = response_ids[r_row, r_col]
        out["input_ids"] = input_ids
        out["attention_mask"] = (torch.arange(S)[None, :] < (plen + rlen)[:, None]).long()
        # logits at sequence position P+j-1 predict response token j
        out["gather_idx"] = (plen[:, None] + torch.arange(T)[None, :] - 1).clamp(max=max(S - 2, 0))
    return out


def prepare_batch(table: pa.Table, pad_id: int, cfg, step: int, schedule,
                  stats_reduce=None) -> tuple[dict, dict]:
    """Rollout rows -> tensors with shaped rewards, loss mask and advantages (this rank's share).

    Adds ``response_mask`` (every response token of a sample with finite behaviour logprobs:
    what the mismatch metrics measure), ``beh_bad`` (samples dropped for a non-finite behaviour
    logprob), ``mask`` (the loss mask) and ``advantages``. ``stats_reduce`` sums the whitening
    statistics over data-parallel ranks."""
    a = cfg.algo
    b = batch_to_tensors(table, pad_id, padded=cfg.train.micro_batch_tokens <= 0)
    correct = is_correct(b["raw_reward"])
    rewards, keep, shape_metrics = shape_rewards(
        b["raw_reward"], correct, b["lengths"], b["truncated"],
        max_length=cfg.rollout.max_new_tokens, step=step, schedule=schedule, cosine=a.length_penalty,
        valid=b["valid"], overlong_mode=a.overlong, overlong_buffer=a.overlong_buffer,
        overlong_factor=a.overlong_factor)
    keep = keep & b["valid"]
    b["reward"] = rewards  # shaped (what the advantages are computed from)
    # an engine that returned a non-finite behaviour logprob loses that sample, counted
    beh = b["behavior_logprobs"]
    beh_bad = ~torch.where(b["mask"] > 0, beh, torch.zeros_like(beh)).isfinite().all(dim=1)
    keep = keep & ~beh_bad
    b["behavior_logprobs"] = torch.nan_to_num(beh, nan=0.0, posinf=0.0, neginf=0.0)
    b["beh_bad"] = beh_bad
    b["response_mask"] = b["mask"] * (~beh_bad)[:, None].float()
    b["mask"] = b["mask"] * keep[:, None].float()
    # grading failures are masked out of baselines and whitening, never scored 0
    kw = {"valid": b["valid"]}
    if stats_reduce is not None and a.advantage == "reinforce_pp_baseline":
        kw["stats_reduce"] = stats_reduce
    b["advantages"] = compute_advantages(a.advantage, rewards, b["group_index"], b["mask"], **kw)
    return b, shape_metrics


def shard_groups(table: pa.Table, rank: int, world_size: int) -> pa.Table:
    """This rank's whole groups (prompt ids, sorted, dealt round-robin) of a batch.

    Every rank applies the same rule to the same table, so the shards partition it."""
    pids = np.asarray(table.column("prompt_id").to_pylist())
    groups = sorted(set(pids.tolist()))
    if len(groups) < world_size:
        raise ValueError(f"a batch of {len(groups)} groups cannot feed train.num_learners={world_size} "
                         "ranks: lower train.num_learners or raise train.prompts_per_step")
    mine = {g for i, g in enumerate(groups) if i % world_size == rank}
    return table.filter(pa.array([p in mine for p in pids.tolist()]))
