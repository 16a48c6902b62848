"""A short chaos soak (benchmarks/chaos.py): a random generator killed every few steps; the run
completes with no prompt lost or trained twice, each kill seen and followed by a re-sync."""

from __future__ import annotations

from tests.test_faults import _cfg


def test_short_chaos_soak_loses_and_repeats_nothing(ray_cluster, tmp_path, model_cache):
    from benchmarks.chaos import CONFIG, chaos_run

    cfg = _cfg(tmp_path, model_cache, *CONFIG, "train.total_steps=9", "rollout.max_generator_failures=5",
               "train.checkpoint_interval=4", "train.keep_last=10")
    r = chaos_run(cfg, kill_every=3, seed=1)
    assert r["steps"] == 9 and r["kills"] == 2, r
    assert r["generator_failures"] <= r["kills"] and r["weight_resyncs"] >= 1, r
    assert r["prompts_lost"] == 0 and r["prompts_trained_twice"] == 0 and r["groups_trained_twice"] == 0, r
    assert r["groups_trained"] == 9 * 8 and r["prompts_drawn"] >= 9 * 8, r
