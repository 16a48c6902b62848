"""LearnerGroup through real Ray: two DeepSpeed learner actors in their own gloo world, packed by
a placement group, handed the batch as an ObjectRef (each rank reads it from the object store and
keeps its own groups, so the batch bytes never pass through the group actor); the merged metrics
are those of the whole batch (compared with a TorchLearner on the same batch)."""

from __future__ import annotations

import pytest

from prorl_async.config import load_config

from tests.learners._ds_worker import batch

pytest.importorskip("deepspeed")


@pytest.mark.distributed
def test_learner_group_ranks_read_their_groups_by_reference(ray_cluster, tiny_model, ds_ext):
    ray = ray_cluster
    from actors.cluster import learner_placement
    from actors.learner import start_learner
    from prorl_async.learners.torch_learner import TorchLearner

    over = [f"model.path={tiny_model}", "train.prompts_per_step=6", "rollout.n=4", "train.micro_batch_size=4",
            "train.lr=1e-3", "algo.kl_coef=0.001", "model.autocast_bf16=false", "train.mini_batches=1"]
    cfg = load_config(None, over + ["train.learner=deepspeed", "train.zero_stage=2", "train.num_learners=2",
                                    "train.learner_num_cpus=0.5"])
    table = batch(1)  # 5 groups (odd), 3 invalid samples
    pg = learner_placement(cfg, timeout_s=120)
    pgt = ray.util.placement_group_table(pg)  # one bundle per rank, packed (actors/cluster.py says why PACK)
    assert pgt["strategy"] == "PACK" and pgt["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}}, pgt
    group = start_learner(cfg, tiny_model, placement_group=pg)
    places = ray.get(group.where.remote())
    assert [p.role for p in places] == ["learner-0", "learner-1"]
    assert {p.placement_group for p in places} == {pg.id.hex()}  # each rank in the group's placement group
    assert places[0].world == places[1].world and places[0].world.rsplit(":", 1)[0] == places[0].node_ip
    ref = ray.put(table)
    m = ray.get(group.train_step.remote([ref], 0), timeout=600)
    whole = TorchLearner(load_config(None, over), tiny_model).train_step(table, 0)
    assert m["perf/num_learners"] == 2 and m["actor/updates"] == 1
    assert m["perf/train_valid_tokens"] == whole["perf/train_valid_tokens"]  # both shards, nothing twice
    assert m["actor/pg_loss"] == pytest.approx(whole["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert m["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-3)
    assert m["mismatch/all_tokens"] == whole["mismatch/all_tokens"]
    assert m["mismatch/all_kl_k3"] == pytest.approx(whole["mismatch/all_kl_k3"], rel=1e-4)
    version, _ = ray.get(group.weights_checksum.remote())
    assert version == 1
    ray.kill(group)
    ray.util.remove_placement_group(pg)
