"""Replay-buffer actor: holds graded groups (Arrow, in the object store) for the learner."""

from __future__ import annotations

import ray

from prorl_async.buffer import ReplayBuffer


@ray.remote
class ReplayBufferActor:
    def __init__(self, max_staleness: int, dynamic_sampling: bool):
        self.buffer = ReplayBuffer(max_staleness, dynamic_sampling)

    def put(self, batch) -> dict:
        return self.buffer.put(batch)

    def take(self, learner_version: int, num_groups: int) -> dict:
        """A small dict of counts, with ``table``: an ObjectRef of the batch (put into the object
        store here, the one serialization on its way to the learner) or None. The driver hands
        the reference on unresolved; the learner reads it (:func:`actors.learner.resolve_batch`)."""
        table, info = self.buffer.take(learner_version, num_groups)
        info["table"] = ray.put(table) if table is not None else None
        return info

    def metrics(self) -> dict:
        return self.buffer.metrics()

    def unconsumed(self):
        return self.buffer.unconsumed()

    def restore(self, table) -> None:
        self.buffer.restore(table)

    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> int:
        self.buffer.load_state_dict(state)
        return len(self.buffer)
