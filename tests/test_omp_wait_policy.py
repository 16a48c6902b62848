"""``ray.omp_wait_policy``: the CPU learner and generators wait at OpenMP barriers passively
when their threads together outnumber the machine's CPUs, and the setting reaches the actor
processes (set in their environment before torch loads, merged with the job's runtime env)."""

from __future__ import annotations

import os

import pytest

from prorl_async.config import ConfigError, load_config
from prorl_async.machine import actor_runtime_env

CPUS = len(os.sched_getaffinity(0))


def test_auto_is_passive_only_when_the_cpu_actors_threads_outnumber_the_cpus(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    over = load_config(None, [f"train.num_threads={CPUS}", "rollout.num_threads=1"])  # CPUS + 1 threads
    assert over.ray.omp_wait_policy == "passive"  # resolved when loaded, like model.dtype
    assert actor_runtime_env(over) == {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
    fits = load_config(None, ["train.num_threads=1", "rollout.num_threads=1"])  # 2 threads
    assert fits.ray.omp_wait_policy == ("keep" if CPUS >= 2 else "passive")
    two_gens = load_config(None, ["train.num_threads=1", f"rollout.num_threads={CPUS}", "rollout.num_generators=2"])
    assert two_gens.ray.omp_wait_policy == "passive"
    # a GPU learner's threads do not count; the generators' alone still can
    gpu = load_config(None, [f"train.num_threads={CPUS}", "train.learner_num_gpus=1", "rollout.num_threads=1"])
    assert gpu.ray.omp_wait_policy == "keep"
    assert actor_runtime_env(gpu) == {}


def test_an_explicit_choice_or_the_environment_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert load_config(None, [f"train.num_threads={CPUS + 2}"]).ray.omp_wait_policy == "keep"  # the user's
    assert actor_runtime_env(load_config(None, ["ray.omp_wait_policy=active"])) == \
        {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}}
    with pytest.raises(ConfigError, match="ray.omp_wait_policy"):
        load_config(None, ["ray.omp_wait_policy=sleepy"])


def test_the_learner_and_generator_processes_get_the_policy(ray_cluster, tiny_model):
    """Real actors from the run's own start-up functions, in a cluster whose job runtime env sets
    PYTHONPATH (the actors import this checkout through it: a runtime env that replaced the job's
    instead of merging with it would fail to start them)."""
    ray = ray_cluster
    from actors.cluster import generator_placement
    from actors.generator import GeneratorActor
    from actors.learner import start_learner

    cfg = load_config(None, [f"model.path={tiny_model}", "ray.omp_wait_policy=passive", "train.learner_num_cpus=0.5"])
    learner = start_learner(cfg, tiny_model)
    opts, _ = generator_placement(cfg, 0)
    gen = GeneratorActor.options(**{**opts, "num_cpus": 0.5}, max_restarts=0).remote(cfg, tiny_model, 0)
    env = lambda self: (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("PYTHONPATH"))  # noqa: E731
    try:
        for actor in (learner, gen):
            policy, path = ray.get(actor.__ray_call__.remote(env), timeout=300)
            assert policy == "PASSIVE" and path  # ours, and the job's kept
    finally:
        ray.kill(learner)
        ray.kill(gen)
    keep = load_config(None, [f"model.path={tiny_model}", "ray.omp_wait_policy=keep", "train.learner_num_cpus=0.5"])
    plain = start_learner(keep, tiny_model)
    try:
        assert ray.get(plain.__ray_call__.remote(env), timeout=300)[0] == os.environ.get("OMP_WAIT_POLICY")
    finally:
        ray.kill(plain)
