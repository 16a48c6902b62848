"""Replay buffer: dynamic sampling, invalid masking, staleness bound at hand-out, FIFO by version."""

import pyarrow as pa
import pytest

from prorl_async.buffer import ReplayBuffer, rollout_stats
from prorl_async.data.schema import rollout_batch


def request(req: str, version: int, groups: dict, tokens: int = 3) -> pa.RecordBatch:
    """groups: prompt_id -> list of (reward, valid)."""
    cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids", "behavior_logprobs",
                            "policy_version", "finish_reason", "raw_reward", "reward_valid",
                            "response_text", "request_id", "grade_reason", "gen_time_s", "grade_time_s")}
    for pid, samples in groups.items():
        for j, (r, ok) in enumerate(samples):
            for k, v in dict(sample_id=f"{req}-{pid}-{j}", prompt_id=pid, domain="arithmetic", prompt_ids=[1, 2],
                             response_ids=[5] * tokens, behavior_logprobs=[-0.1] * tokens, policy_version=version,
                             finish_reason="stop", raw_reward=r, reward_valid=ok, response_text="x",
                             request_id=req, grade_reason="ok" if ok else "timeout", gen_time_s=0.5,
                             grade_time_s=0.25).items():
                cols[k].append(v)
    return rollout_batch(cols)


def test_put_keeps_informative_groups_and_drops_the_rest():
    buf = ReplayBuffer(max_staleness=1)
    info = buf.put(request("r1", 0, {
        "mixed": [(1, True), (0, True), (1, True)],
        "all_right": [(1, True), (1, True), (1, True)],
        "all_wrong": [(0, True), (0, True), (0, True)],
        "one_valid": [(1, True), (0, False), (0, False)],      # fewer than two gradable samples
        "mixed_with_invalid": [(1, True), (0, True), (0, False)],
    }))
    assert info.kept == 2 and info.dropped == 3 and info.invalid_samples == 3
    assert info.invalid_reasons == {"timeout": 3}
    assert info.dropped_by == {"all_correct": 1, "all_wrong": 1, "invalid": 1}  # what the refill watch counts
    m = buf.metrics()
    assert m["sampling/groups_dropped_all_correct"] == 1 and m["sampling/groups_dropped_all_wrong"] == 1
    assert m["sampling/groups_dropped_invalid"] == 1
    taken = buf.take(learner_version=0, num_groups=2)
    table = taken.table
    assert taken.groups == ["r1/mixed", "r1/mixed_with_invalid"]
    # the invalid sample is not handed to the learner
    assert table.num_rows == 5 and all(table.column("reward_valid").to_pylist())


def test_without_dynamic_sampling_uniform_groups_are_kept():
    buf = ReplayBuffer(max_staleness=0, dynamic_sampling=False)
    assert buf.put(request("r", 0, {"a": [(1, True), (1, True)]})).kept == 1


def test_take_is_oldest_first_and_enforces_the_staleness_bound():
    buf = ReplayBuffer(max_staleness=1)
    buf.put(request("new", 3, {"p": [(1, True), (0, True)]}))
    buf.put(request("old", 1, {"q": [(1, True), (0, True)]}))
    buf.put(request("mid", 2, {"s": [(1, True), (0, True)]}))
    # learner at version 3: version 1 is 2 behind (> max_staleness=1) and is dropped, counted
    info = buf.take(learner_version=3, num_groups=2)
    table = info.table
    assert info.stale_dropped == 1 and info.groups == ["mid/s", "new/p"]
    assert set(table.column("policy_version").to_pylist()) == {2, 3}
    assert buf.metrics()["async/stale_dropped"] == 1
    assert buf.take(3, 1).table is None  # empty: nothing handed out


def test_interleaved_group_rows_are_gathered():
    rows = request("r", 0, {"a": [(1, True)], "b": [(0, True)]})
    # interleave a/b rows: a group is no longer contiguous and must still come out whole
    inter = pa.Table.from_batches([rows.slice(0, 1), rows.slice(1, 1), rows.slice(0, 1), rows.slice(1, 1)])
    inter = inter.combine_chunks().to_batches()[0]
    import pyarrow.compute as pc
    inter = inter.set_column(0, "sample_id", pa.array([f"s{i}" for i in range(4)]))
    inter = inter.set_column(inter.schema.get_field_index("raw_reward"), "raw_reward",
                             pa.array([1.0, 0.0, 0.0, 1.0], pa.float32()))
    buf = ReplayBuffer(max_staleness=0)
    assert buf.put(inter).kept == 2
    table = buf.take(0, 2).table
    assert table.column("sample_id").to_pylist() == ["s0", "s2", "s1", "s3"]
    assert pc.sum(table.column("raw_reward")).as_py() == 2.0


def test_rollout_stats_sums():
    s = rollout_stats(request("r", 0, {"a": [(1, True), (0, True), (1, False)]}, tokens=4))
    assert s["samples"] == 3 and s["valid"] == 2 and s["correct"] == 1 and s["response_tokens"] == 12
    assert s["domain_valid/arithmetic"] == 2 and s["gen_time_s"] == pytest.approx(1.5)


def test_bad_schema_is_refused():
    with pytest.raises(ValueError, match="rollout schema"):
        ReplayBuffer(0).put(pa.RecordBatch.from_pydict({"x": [1]}))


def test_unconsumed_rows_survive_a_restore():
    a = ReplayBuffer(max_staleness=1)
    a.put(request("r", 0, {"p": [(1, True), (0, True)], "q": [(0, True), (1, True)]}))
    b = ReplayBuffer(max_staleness=1)
    b.restore(a.unconsumed())
    assert len(b) == 2 and b.take(0, 2).groups == a.take(0, 2).groups


def _spanning(req: str, oldest: list[int], newest: list[int]) -> pa.RecordBatch:
    """One group whose samples received in-flight weight updates: versions oldest[j]..newest[j]."""
    b = request(req, 0, {"p": [(1, True), (0, True), (1, True)][:len(oldest)]})
    cols = b.to_pydict()
    cols.update(policy_version=oldest, policy_version_end=newest)
    return rollout_batch(cols)


def test_staleness_is_accounted_by_the_oldest_version_in_a_response():
    """A group that spans versions 1..3 (in-flight updates) is as stale as its oldest token:
    with max_staleness=1 it is dropped at learner version 3, though its newest tokens are fresh."""
    for learner_version, taken in ((2, 1), (3, 0)):
        buf = ReplayBuffer(max_staleness=1)
        buf.put(_spanning("r", oldest=[1, 2, 2], newest=[3, 3, 2]))
        info = buf.take(learner_version, 1)
        table = info.table
        assert info.taken == taken and info.stale_dropped == 1 - taken, (learner_version, info)
        if taken:
            assert table.column("policy_version").to_pylist() == [1, 2, 2]
            assert table.column("policy_version_end").to_pylist() == [3, 3, 2]


def test_a_checkpoint_without_policy_version_end_restores():
    """Checkpoints written before the column existed: one version per response."""
    old = pa.Table.from_batches([request("r", 4, {"p": [(1, True), (0, True)]})]).drop_columns(["policy_version_end"])
    buf = ReplayBuffer(max_staleness=1)
    buf.load_state_dict({"table": old, "counters": {}})
    info = buf.take(4, 1)
    table = info.table
    assert info.taken == 1 and table.column("policy_version_end").to_pylist() == [4, 4]
