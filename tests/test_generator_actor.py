"""actors/generator.py: an evaluation's own temperature (train.eval_temperature) reaches the engine."""

from __future__ import annotations

from prorl_async.config import load_config
from prorl_async.data import arithmetic


def test_a_requests_temperature_samples_as_that_rollout_temperature_would(ray_cluster, tiny_model):
    """A generator at rollout.temperature=1 asked for temperature 0.25 samples exactly what one at
    rollout.temperature=0.25 samples by default (same seed); at its own temperature it samples otherwise."""
    ray = ray_cluster
    from actors.generator import GeneratorActor

    rows = arithmetic.generate(8, seed=3, split="eval")
    gens = [GeneratorActor.options(num_cpus=0.5, max_restarts=0).remote(
        load_config(None, [f"model.path={tiny_model}", f"rollout.temperature={t}"]), tiny_model, 0) for t in (1.0, 0.25)]
    try:
        asked, cool, own = ray.get([gens[0].generate.remote(rows, 4, 11, False, 0.25), gens[1].generate.remote(rows, 4, 11),
                                    gens[0].generate.remote(rows, 4, 11)], timeout=300)
    finally:
        for g in gens:
            ray.kill(g)
    a, c, o = (b.to_pydict() for b in (asked, cool, own))
    assert a["response_ids"] == c["response_ids"] and a["behavior_logprobs"] == c["behavior_logprobs"]
    mean = lambda d: sum(map(sum, d["behavior_logprobs"])) / sum(map(len, d["behavior_logprobs"]))  # noqa: E731
    assert mean(a) > mean(o)  # logprobs of the sharper distribution: closer to 0
