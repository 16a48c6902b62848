"""The rollout schema: one Arrow row per sampled response, from generator to learner.

One schema everywhere (DESIGN.md, "Rollout schema"): the generator fills the generation
columns, the grader the reward columns, the buffer and learner only read. RecordBatches
move through Ray's object store zero-copy, and the buffer spills them to Parquet unchanged.
"""

from __future__ import annotations

import pyarrow as pa

ROLLOUT_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string()),
    pa.field("prompt_id", pa.string()),
    pa.field("domain", pa.string()),
    pa.field("prompt_ids", pa.list_(pa.int32())),
    pa.field("response_ids", pa.list_(pa.int32())),
    pa.field("behavior_logprobs", pa.list_(pa.float32())),
    pa.field("policy_version", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("raw_reward", pa.float32()),
    pa.field("reward_valid", pa.bool_()),
    pa.field("gen_time_s", pa.float32()),
    pa.field("grade_time_s", pa.float32()),
    # beyond the core schema: for inspection, grading and accounting
    pa.field("response_text", pa.string()),
    pa.field("grade_reason", pa.string()),
    pa.field("request_id", pa.string()),
    # newest weights version among the response's tokens (in-flight weight updates); staleness
    # is accounted by the oldest, ``policy_version``
    pa.field("policy_version_end", pa.int64()),
])


def rollout_batch(columns: dict) -> pa.RecordBatch:
    """Build a RecordBatch in schema order; missing reward columns get their 'ungraded' values."""
    n = len(columns["sample_id"])
    defaults = {"raw_reward": [0.0] * n, "reward_valid": [False] * n,
                "grade_time_s": [0.0] * n, "gen_time_s": [0.0] * n, "grade_reason": ["ungraded"] * n}
    defaults["policy_version_end"] = columns.get("policy_version")  # one version per response
    arrays = [pa.array(columns.get(f.name, defaults.get(f.name)), type=f.type) for f in ROLLOUT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=ROLLOUT_SCHEMA)


def with_columns(batch: pa.RecordBatch, **cols) -> pa.RecordBatch:
    """Replace whole columns of a batch (by name), keeping the schema."""
    arrays = [pa.array(cols[f.name], type=f.type) if f.name in cols else batch.column(i)
              for i, f in enumerate(ROLLOUT_SCHEMA)]
    return pa.RecordBatch.from_arrays(arrays, schema=ROLLOUT_SCHEMA)
