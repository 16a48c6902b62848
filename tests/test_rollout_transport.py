"""Rollouts reach the learner by reference (issue 14): the buffer actor hands out the object
references the graded requests already live in, with row ranges (BatchRefs), the driver passes
them on unresolved, and the learner side maps and slices them — no copy, no second
serialization. Groups without an object of their own (a restored checkpoint) are put once."""

from __future__ import annotations

import pyarrow as pa
import pytest

from prorl_async.buffer import ReplayBuffer
from tests.test_buffer import request

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _requests():
    return [request(f"r{k}", 0, {f"p{k}{g}": [(1, True), (0, True), (1, True)] for g in range(3)}, tokens=64)
            for k in range(2)]


def test_buffer_hands_out_the_objects_the_rows_already_live_in():
    import ray

    from actors.learner import resolve_batch
    from actors.replay_buffer import BatchRefs, ReplayBufferActor

    buf = ReplayBufferActor.remote(1, True)
    reqs = _requests()
    refs = [ray.put(b) for b in reqs]
    ray.get([buf.put.remote(r, [r]) for r in refs])  # as the driver puts a graded request
    info = ray.get(buf.take.remote(0, 4))
    batch = info.batch
    assert isinstance(batch, BatchRefs) and batch.num_rows == 12 and info.taken == 4
    # every part points into an object the driver put: nothing was copied into a new object; the
    # three groups of the first request are one run of its rows, so one part, then the second's first
    assert [r.hex() for r, _, _ in batch.parts] == [refs[0].hex(), refs[1].hex()]
    assert [(o, n) for _, o, n in batch.parts] == [(0, 9), (0, 3)]

    @ray.remote
    def learner_side(b):  # the learner's resolution, in another process
        t = resolve_batch(b)
        return t.column("sample_id").to_pylist(), t.column("response_ids").to_pylist()

    ids, responses = ray.get(learner_side.remote(batch))
    pure = ReplayBuffer(1)
    for b in reqs:
        pure.put(b)
    expected = pure.take(0, 4).table
    assert ids == expected.column("sample_id").to_pylist()
    assert responses == expected.column("response_ids").to_pylist()


def test_groups_separated_by_a_dropped_group_are_two_parts_of_one_object():
    import ray

    from actors.learner import resolve_batch
    from actors.replay_buffer import ReplayBufferActor

    mixed = [(1, True), (0, True), (1, True)]
    req = request("r", 0, {"a": mixed, "all_right": [(1, True)] * 3, "b": mixed, "c": mixed}, tokens=8)
    ref = ray.put(req)
    buf = ReplayBufferActor.remote(1, True)
    assert ray.get(buf.put.remote(ref, [ref])).kept == 3  # dynamic sampling drops rows 3-5
    batch = ray.get(buf.take.remote(0, 3)).batch
    assert [(r.hex(), o, n) for r, o, n in batch.parts] == [(ref.hex(), 0, 3), (ref.hex(), 6, 6)]
    ids = ray.get(ray.remote(lambda b: resolve_batch(b).column("sample_id").to_pylist()).remote(batch))
    assert ids == [f"r-{p}-{j}" for p in "abc" for j in range(3)]


def test_groups_restored_from_a_checkpoint_are_put_once():
    import ray

    from actors.replay_buffer import ReplayBufferActor

    buf = ReplayBufferActor.remote(1, True)
    state = pa.Table.from_batches(_requests())
    assert ray.get(buf.load_state_dict.remote({"table": state, "counters": {}})) == 6
    batch = ray.get(buf.take.remote(0, 4)).batch
    assert len(batch.parts) == 1 and batch.parts[0][1:] == (0, 12)  # one new object for the four groups
    table = ray.get(ray.remote(lambda b: b.resolve()).remote(batch))
    assert table.num_rows == 12 and table.column("sample_id").to_pylist() == state.column("sample_id").to_pylist()[:12]
