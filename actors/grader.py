"""Grader actor: scores a generated RecordBatch with the domain verifiers.

A shell over :class:`prorl_async.rewards.pool.GraderPool` (worker processes, per-sample
time limits enforced by killing, hanging samples moved aside onto spare workers). A grading
failure marks the sample invalid with its reason; it is never scored as a wrong answer.

Grader health (issue 13): :meth:`GraderActor.metrics_since_last` returns a flat dict of
``grader/*`` keys counted since its previous call (timeouts, errors, non-finite rewards, worker
restarts, queue wait; per domain as ``grader/<name>/<domain>``) plus ``grader/<name>_total``
totals; the driver merges it into each step's metrics. It runs in its own concurrency group, so
it answers while a batch is being graded instead of queueing behind it.
"""

from __future__ import annotations

import math
import time

import ray

from prorl_async.data.schema import with_columns
from prorl_async.metrics import rss_mb
from prorl_async.rewards.pool import GraderPool

from actors.placement import ActorPlace, here


@ray.remote(concurrency_groups={"health": 1})
class GraderActor:
    def __init__(self, cfg):
        rc = cfg.reward
        self.pool = GraderPool(num_workers=rc.num_workers, timeout_s=rc.timeout_s,
                               extra_modules=tuple(rc.extra_modules),
                               options={"code_mode": rc.code_mode, "instruction_mode": rc.instruction_mode})

    def ready(self) -> bool:
        return True

    def where(self) -> ActorPlace:
        return here("grader")

    def grade(self, rows: list[dict], batch):
        by_id = {str(r["id"]): r for r in rows}
        texts = batch.column("response_text").to_pylist()
        ids = batch.column("prompt_id").to_pylist()
        t0 = time.perf_counter()
        grades = self.pool.grade_many([by_id[i] for i in ids], texts)
        dt = (time.perf_counter() - t0) / max(1, len(grades))
        raw = [g.reward if g.valid and math.isfinite(g.reward) else 0.0 for g in grades]
        return with_columns(batch, raw_reward=raw, reward_valid=[g.valid for g in grades],
                            grade_time_s=[dt] * len(grades), grade_reason=[g.reason for g in grades])

    @ray.method(concurrency_group="health")
    def metrics(self) -> dict:
        """Totals since the actor started."""
        return self.pool.metrics()

    @ray.method(concurrency_group="health")
    def metrics_since_last(self) -> dict:
        """``grader/*`` counts since the previous call (one step), with ``_total`` totals."""
        return {**self.pool.metrics_since_last(), "grader/rss_mb": rss_mb()}

    def close(self) -> None:
        self.pool.close()
