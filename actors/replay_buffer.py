"""Replay-buffer actor: holds graded groups (Arrow, in the object store) for the learner.

By reference both ways: ``put`` receives a graded request resolved by Ray (a zero-copy view of
its object) together with that object's reference, and ``take`` hands out :class:`BatchRefs`
— the references of the objects the groups' rows already live in, with row ranges — instead of
the rows themselves. The learner maps those objects and slices them (:meth:`BatchRefs.resolve`):
a batch reaches it with no copy and no second serialization, and never passes through the
driver. Only groups without an object of their own (restored from a checkpoint, or gathered
from non-contiguous rows) are put into the object store, once, at ``take``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pyarrow as pa
import ray

from prorl_async.buffer import PutResult, ReplayBuffer, Source
from prorl_async.data.schema import ROLLOUT_SCHEMA
from prorl_async.metrics import rss_mb

from actors.placement import ActorPlace, here


@dataclass
class BatchRefs:
    """A training batch by reference: ``(ObjectRef, first row, rows)`` per part, in batch order.
    Nested in an argument, the references are not resolved by Ray on the way."""
    parts: list[Source]
    num_rows: int

    def resolve(self) -> pa.Table:
        unique = list(dict.fromkeys(r for r, _, _ in self.parts))  # a request's groups share its object
        got = dict(zip(unique, ray.get(unique)))  # zero-copy: views of the object store
        pieces = [got[r].slice(offset, length) for r, offset, length in self.parts]
        return pa.Table.from_batches([b for p in pieces for b in (p.to_batches() if isinstance(p, pa.Table) else [p])],
                                     schema=ROLLOUT_SCHEMA)


@dataclass(frozen=True)
class TakeRefs:
    """:meth:`ReplayBufferActor.take`'s answer: the counts of
    :class:`~prorl_async.buffer.TakeResult`, and the batch by reference."""
    batch: Optional[BatchRefs]   # the groups' rows where they live; None: too few groups
    taken: int                   # groups in ``batch`` (0 without one)
    stale_dropped: int           # groups dropped as too old for the learner's version by this take
    size: int                    # groups still waiting
    groups: list[str] = field(default_factory=list)  # ``request_id/prompt_id`` of each group taken


@ray.remote
class ReplayBufferActor:
    def __init__(self, max_staleness: int, dynamic_sampling: bool):
        self.buffer = ReplayBuffer(max_staleness, dynamic_sampling)

    def put(self, batch: pa.RecordBatch, origin: Sequence[Any] = ()) -> PutResult:
        """``batch`` (resolved by Ray before the call, so the actor never waits for grading) and
        ``origin``: ``[its ObjectRef]`` (a list, so Ray leaves it a reference) to hand out at take."""
        return self.buffer.put(batch, origin=origin[0] if origin else None)

    def take(self, learner_version: int, num_groups: int) -> TakeRefs:
        """A few counts, and the batch as :class:`BatchRefs` (None when too few groups wait)."""
        took = self.buffer.take(learner_version, num_groups)
        return TakeRefs(batch=None if took.table is None else self._refs(took.table, took.sources), taken=took.taken,
                        stale_dropped=took.stale_dropped, size=took.size, groups=took.groups)

    @staticmethod
    def _refs(table: pa.Table, sources: list[Optional[Source]]) -> BatchRefs:
        """One part per run of consecutive rows of one object (a request's kept groups are usually
        one run), so a batch carries a few references, not one per group (Ray serializes and
        tracks every reference at each hop) and the learner makes a few slices, not one per group."""
        parts: list[Source] = []
        loose: list[pa.RecordBatch] = []
        row = 0  # loose: consecutive groups with no object, put once together
        batches = iter(table.to_batches())  # one per group, in order (Table.from_batches of the groups)

        def flush() -> None:
            if loose:
                rows = pa.Table.from_batches(loose, schema=ROLLOUT_SCHEMA)
                parts.append((ray.put(rows), 0, rows.num_rows))
                loose.clear()

        for where in sources:
            group = next(batches)
            row += group.num_rows
            if where is None:
                loose.append(group)
                continue
            flush()
            ref, offset, length = where
            if parts and parts[-1][0] == ref and parts[-1][1] + parts[-1][2] == offset:
                parts[-1] = (ref, parts[-1][1], parts[-1][2] + length)  # the next rows of the same object
            else:
                parts.append(where)
        flush()
        return BatchRefs(parts, row)

    def where(self) -> ActorPlace:
        return here("buffer")

    def metrics(self) -> dict[str, float]:
        return {**self.buffer.metrics(), "sys/rss_mb/buffer": rss_mb()}

    def unconsumed(self) -> pa.Table:
        return self.buffer.unconsumed()

    def restore(self, table: pa.Table) -> None:
        self.buffer.restore(table)

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> int:
        self.buffer.load_state_dict(state)
        return len(self.buffer)
