"""Synthetic graded rollout tables for learner tests (no generation needed)."""

from __future__ import annotations

import random

import pyarrow as pa

from prorl_async.data.schema import rollout_batch


def graded_table(groups: int = 4, n: int = 4, seed: int = 0, vocab: int = 20, prompt_len: int = 5,
                 max_resp: int = 6) -> pa.Table:
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "prompt_id", "domain", "prompt_ids", "response_ids", "behavior_logprobs",
                            "policy_version", "finish_reason", "gen_time_s", "raw_reward",
                            "reward_valid", "grade_time_s", "response_text", "grade_reason", "request_id")}
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)]
        for j in range(n):
            L = rng.randint(1, max_resp)
            resp = [rng.randrange(4, vocab) for _ in range(L - 1)] + [2]
            r = float(rng.random() < 0.5)
            cols["sample_id"].append(f"s{g}-{j}")
            cols["prompt_id"].append(f"p{g}")
            cols["domain"].append("arithmetic")
            cols["prompt_ids"].append(prompt)
            cols["response_ids"].append(resp)
            cols["behavior_logprobs"].append([-1.0 - 0.1 * rng.random() for _ in resp])
            cols["policy_version"].append(0)
            cols["finish_reason"].append("stop")
            cols["gen_time_s"].append(0.0)
            cols["raw_reward"].append(r)
            cols["reward_valid"].append(True)
            cols["grade_time_s"].append(0.0)
            cols["response_text"].append("")
            cols["grade_reason"].append("")
            cols["request_id"].append("r0")
    return pa.Table.from_batches([rollout_batch(cols)])
