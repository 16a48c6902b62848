"""Replay-buffer logic (pure; the Ray actor in ``actors/replay_buffer.py`` is a shell over it).

Graded rollout batches arrive as Arrow RecordBatches. The buffer splits them into groups
(the n samples of one prompt in one request), drops invalid samples (grader failures are
masked, never scored 0), drops groups left with fewer than two valid samples, and with
dynamic sampling (DAPO) drops groups whose valid rewards are all equal -- both judged by
:func:`prorl_async.algo.sampling.uninformative_reason` on the verifier reward (``raw_reward``),
i.e. DAPO's all-correct / all-wrong test; length shaping, which the learner applies later,
does not make an all-correct group informative. Kept groups wait in
FIFO order of policy version. ``take(learner_version, k)`` hands out the ``k`` oldest groups
whose version satisfies ``learner_version - policy_version <= max_staleness`` — the hard
guarantee behind the driver's admission control; a group that is already too old is dropped
and counted (``async/stale_dropped``; admission control keeps this at zero in normal runs).

What the two calls answer: :class:`PutResult` (``put``) and :class:`TakeResult` (``take``),
frozen dataclasses; the actor's ``take`` answers :class:`actors.replay_buffer.TakeRefs`, the
same counts with the batch by reference.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prorl_async.algo.sampling import DEFAULT_TOL, group_counts, uninformative_reason
from prorl_async.data.schema import ROLLOUT_SCHEMA
from prorl_async.metrics import is_correct


def rollout_stats(batch: pa.RecordBatch) -> dict[str, float]:
    """Sums over one graded request (the driver adds them up between learner steps)."""
    d = batch.select(["domain", "raw_reward", "reward_valid"]).to_pydict()  # token lists stay in Arrow
    out: defaultdict[str, float] = defaultdict(float)
    out["gen_time_s"] = float(pc.sum(batch.column("gen_time_s")).as_py() or 0.0)
    out["grade_time_s"] = float(pc.sum(batch.column("grade_time_s")).as_py() or 0.0)
    out["response_tokens"] = float(pc.sum(pc.list_value_length(batch.column("response_ids"))).as_py() or 0)
    for dom, r, ok in zip(d["domain"], d["raw_reward"], d["reward_valid"]):
        out["samples"] += 1
        if ok:
            correct = float(is_correct(r))
            out["valid"] += 1
            out["reward_sum"] += r
            out["correct"] += correct
            out[f"domain_valid/{dom}"] += 1
            out[f"domain_correct/{dom}"] += correct
            out[f"domain_reward/{dom}"] += r
    return {k: float(v) for k, v in out.items()}


#: where a group's rows live: ``(origin, first row, rows)``, ``origin`` as handed to ``put``
Source = tuple[Any, int, int]


@dataclass(frozen=True)
class PutResult:
    """What one graded request did to the buffer (:meth:`ReplayBuffer.put`)."""
    kept: int                        # groups kept: they wait for the learner
    dropped: int                     # groups dropped (the sum of ``dropped_by``)
    dropped_by: dict[str, int]       # dropped groups by reason: invalid (< 2 valid samples), all_correct, all_wrong
    invalid_samples: int             # samples the grader could not grade (masked, never scored 0)
    invalid_reasons: dict[str, int]  # those samples by ``grade_reason``
    size: int                        # groups waiting after this put
    stats: dict[str, float]          # :func:`rollout_stats` of the request (the driver sums them per step)
    pools: dict[str, list[float]]    # domain -> GROUP_COUNTS (algo/sampling.py) summed over its groups: the curriculum's input


@dataclass(frozen=True)
class TakeResult:
    """A batch for the learner, or why there is none (:meth:`ReplayBuffer.take`)."""
    table: Optional[pa.Table]        # the groups' rows, one record batch per group, in order; None: too few groups
    taken: int                       # groups in ``table`` (0 without one)
    stale_dropped: int               # groups dropped as too old for the learner's version by this take
    size: int                        # groups still waiting
    groups: list[str] = field(default_factory=list)  # ``request_id/prompt_id`` of each group taken
    sources: list[Optional[Source]] = field(default_factory=list)  # per group: where its rows live, or None


class ReplayBuffer:
    def __init__(self, max_staleness: int, dynamic_sampling: bool = True):
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self._heap: list[tuple[int, int, pa.RecordBatch, Optional[Source]]] = []  # (version, seq, group rows, where)
        self._seq = itertools.count()
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, batch: pa.RecordBatch, origin: Any = None) -> PutResult:
        """Add one graded request; returns what was kept and dropped. ``origin``: an opaque
        handle of where ``batch`` lives (the actor passes its object reference); a group that is
        a contiguous run of its rows is remembered as ``(origin, offset, length)`` and
        :meth:`take` hands that back, so the rows can reach the learner without a copy."""
        if batch.schema != ROLLOUT_SCHEMA:
            raise ValueError("replay buffer: batch does not have the rollout schema "
                             f"(got columns {batch.schema.names})")
        kept = dropped = invalid = 0
        why: Counter[str] = Counter()  # dropped groups by reason: invalid, all_correct, all_wrong
        keys = pc.binary_join_element_wise(batch.column("request_id"), batch.column("prompt_id"), "/")
        keys_np = np.asarray(keys.to_pylist(), dtype=object)
        valid = np.asarray(batch.column("reward_valid").to_pylist(), dtype=bool)
        raw = np.asarray(batch.column("raw_reward").to_numpy(zero_copy_only=False), dtype=np.float64)
        versions = batch.column("policy_version").to_numpy()
        self.counters["samples_in"] += batch.num_rows
        invalid = int((~valid).sum())
        self.counters["samples_invalid"] += invalid
        domains = np.asarray(batch.column("domain").to_pylist(), dtype=object)
        pools: dict[str, list[float]] = {}  # domain -> GROUP_COUNTS summed over its groups (the curriculum's input)
        _, first, inverse = np.unique(keys_np, return_index=True, return_inverse=True)
        members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(np.bincount(inverse))[:-1])
        for g in np.argsort(first):  # groups in arrival order
            idx = members[g]
            good = idx[valid[idx]]
            self.counters["groups_in"] += 1
            reason = uninformative_reason(raw[idx], valid[idx], DEFAULT_TOL)
            pool = pools.setdefault(domains[idx[0]], [0, 0, 0.0, 0, 0])
            for k, v in enumerate(group_counts(raw[idx], valid[idx], DEFAULT_TOL, reason)):
                pool[k] += v
            if reason == "too_few_valid":
                self.counters["groups_dropped_invalid"] += 1
                why["invalid"] += 1
                dropped += 1
                continue
            if self.dynamic_sampling and reason == "all_equal":
                kind = "all_correct" if raw[good].max() > 0 else "all_wrong"
                self.counters[f"groups_dropped_{kind}"] += 1
                why[kind] += 1
                dropped += 1
                continue
            contiguous = good[-1] - good[0] + 1 == len(good)  # the usual case: a zero-copy slice
            rows = batch.slice(int(good[0]), len(good)) if contiguous else batch.take(pa.array(good))
            where = (origin, int(good[0]), len(good)) if contiguous and origin is not None else None
            heapq.heappush(self._heap, (int(versions[good].min()), next(self._seq), rows, where))
            self.counters["groups_kept"] += 1
            kept += 1
        return PutResult(
            kept=kept, dropped=dropped, dropped_by=dict(why), invalid_samples=invalid,
            invalid_reasons=dict(Counter(np.asarray(batch.column("grade_reason").to_pylist())[~valid].tolist())),
            size=len(self._heap), stats=rollout_stats(batch), pools=pools)

    def take(self, learner_version: int, num_groups: int) -> TakeResult:
        """The ``num_groups`` oldest admissible groups as one Table, or no table if too few.
        ``sources``: per group, ``(origin, offset, length)`` as given to :meth:`put`, or None."""
        stale = 0
        while self._heap and learner_version - self._heap[0][0] > self.max_staleness:
            heapq.heappop(self._heap)
            stale += 1
        self.counters["groups_stale_dropped"] += stale
        if len(self._heap) < num_groups:
            return TakeResult(table=None, taken=0, stale_dropped=stale, size=len(self._heap))
        groups = [heapq.heappop(self._heap) for _ in range(num_groups)]
        table = pa.Table.from_batches([g[2] for g in groups], schema=ROLLOUT_SCHEMA)
        self.counters["groups_taken"] += num_groups
        keys = [f"{g[2].column('request_id')[0].as_py()}/{g[2].column('prompt_id')[0].as_py()}" for g in groups]
        return TakeResult(table=table, taken=num_groups, stale_dropped=stale, size=len(self._heap), groups=keys,
                          sources=[g[3] for g in groups])

    def unconsumed(self) -> pa.Table:
        """Everything still waiting (for checkpoints and Parquet spills), oldest first."""
        return pa.Table.from_batches([g[2] for g in sorted(self._heap)], schema=ROLLOUT_SCHEMA)

    def restore(self, table: pa.Table) -> None:
        for batch in table.to_batches():
            self.put(batch)

    def state_dict(self) -> dict[str, Any]:
        """Unconsumed rows (oldest first) and the counters, for a checkpoint."""
        return {"table": self.unconsumed(), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's contents: the same groups in the same order, the same counters."""
        self._heap.clear()
        table = state["table"]
        if table is not None and table.num_rows:
            if "policy_version_end" not in table.column_names:  # a checkpoint from before the column
                table = table.append_column("policy_version_end", table.column("policy_version"))
            self.restore(table.select(ROLLOUT_SCHEMA.names).cast(ROLLOUT_SCHEMA).combine_chunks())
        self.counters = Counter(state["counters"])

    def metrics(self) -> dict[str, float]:
        c = self.counters
        seen = max(c["groups_in"], 1)
        return {
            "async/buffer_groups": float(len(self._heap)),
            "sampling/groups_kept": float(c["groups_kept"]),
            "sampling/groups_dropped_all_correct": float(c["groups_dropped_all_correct"]),
            "sampling/groups_dropped_all_wrong": float(c["groups_dropped_all_wrong"]),
            "sampling/groups_dropped_invalid": float(c["groups_dropped_invalid"]),
            "sampling/kept_frac": c["groups_kept"] / seen,
            "async/stale_dropped": float(c["groups_stale_dropped"]),
            "reward/invalid_samples": float(c["samples_invalid"]),
        }
