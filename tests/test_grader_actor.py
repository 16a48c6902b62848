"""GraderActor in a real Ray cluster: grader health reaches the caller per step, and the health
call answers while a batch with a hanging sample is still being graded."""

from __future__ import annotations

import pytest

from prorl_async.config import load_config
from prorl_async.data import arithmetic
from prorl_async.data.schema import rollout_batch
from tests.fault_verifiers import fault_of


def _batch(rows: list[dict]):
    n = len(rows)
    return rollout_batch({
        "sample_id": [f"s{i}" for i in range(n)], "prompt_id": [r["id"] for r in rows],
        "domain": [r["domain"] for r in rows], "prompt_ids": [[1]] * n, "response_ids": [[2]] * n,
        "behavior_logprobs": [[-0.5]] * n, "policy_version": [0] * n, "finish_reason": ["stop"] * n,
        "response_text": [r["answer"] for r in rows], "request_id": ["r0"] * n,
    })


@pytest.mark.usefixtures("ray_cluster")
def test_grader_health_per_step_and_while_grading():
    import ray

    from actors.grader import GraderActor

    picked: dict[str, list] = {}
    for r in arithmetic.generate(400, seed=5, split="train"):
        picked.setdefault(fault_of(r), []).append({**r, "domain": "flaky"})
    rows = picked["ok"][:6] + [picked["timeout"][0], picked["error"][0], picked["non_finite"][0]]
    cfg = load_config(None, ["reward.extra_modules=[tests.fault_verifiers]", "reward.timeout_s=2"])
    grader = GraderActor.options(num_cpus=0).remote(cfg)
    try:
        ray.get(grader.ready.remote())
        graded = grader.grade.remote(rows, _batch(rows))
        health = grader.metrics_since_last.remote()
        first, _ = ray.wait([graded, health], num_returns=1, timeout=60)
        assert first == [health]  # answered while the hanging sample was still running
        assert ray.get(health)["grader/responses"] == 0

        batch = ray.get(graded)
        assert batch.column("grade_reason").to_pylist()[6:] == ["timeout", "error:RuntimeError", "non_finite"]
        assert batch.column("reward_valid").to_pylist() == [True] * 6 + [False] * 3
        assert batch.column("raw_reward").to_pylist()[:6] == [1.0] * 6  # the good samples were graded
        step = ray.get(grader.metrics_since_last.remote())
        for key in ("grader/timeouts", "grader/timeouts/flaky", "grader/errors", "grader/errors/flaky",
                    "grader/nonfinite", "grader/nonfinite/flaky", "grader/restarts"):
            assert step[key] == 1.0, (key, step)
        assert step["grader/responses"] == 9 and step["grader/timeouts_total"] == 1
        assert ray.get(grader.metrics_since_last.remote())["grader/timeouts"] == 0  # per step
        assert ray.get(grader.metrics.remote())["grader/timeouts"] == 1  # in total
    finally:
        ray.get(grader.close.remote())
        ray.kill(grader)
