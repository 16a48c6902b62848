"""The run directory and the model, checked from the learner's nodes before step 1 (issue 26,
shared storage; actors/storage.py).

Every node of a local cluster is this host, so a folder one node cannot see is simulated by two
directories standing for the same path on two nodes' disks: the driver's probe in one, the
learner rank's look (the same function the actor runs) at the other. Through real Ray, a
learner actor checks the real run directory, and a model path that is not there is the error.
"""

from __future__ import annotations

import shutil

import pytest

from prorl_async.outputs import PROBE, look_at_run_dir, probe_rank_file

from actors.storage import problems


def _driver_probe(run_dir, token="t0ken"):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PROBE).write_text(token)
    return token


def test_every_rank_that_sees_the_folder_and_the_model_passes(tmp_path):
    run_dir, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    token = _driver_probe(run_dir)
    reports = [look_at_run_dir(str(run_dir), r, "10.0.0.2", str(model)) for r in range(2)]
    assert problems(run_dir, token, reports, str(model), str(run_dir)) == []
    assert [probe_rank_file(run_dir, r).read_text() for r in range(2)] == [token, token]  # written by each rank


def test_a_node_local_run_dir_is_one_error_naming_the_path_the_rank_its_node_and_the_fix(tmp_path):
    driver_view, learner_view, model = tmp_path / "head" / "run", tmp_path / "worker" / "run", tmp_path / "model"
    model.mkdir()
    token = _driver_probe(driver_view)
    learner_view.mkdir(parents=True)  # the same path on the worker's own disk: empty
    reports = [look_at_run_dir(str(driver_view), 0, "10.0.0.2", str(model)),
               look_at_run_dir(str(learner_view), 1, "10.0.0.3", str(model))]
    found = problems(driver_view, token, reports, str(model), "runs/exp1")
    assert len(found) == 1, found
    assert f"run_dir {driver_view} is not the driver's folder on learner rank 1 on node 10.0.0.3" in found[0]
    assert "run_dir=runs/exp1 is relative" in found[0] and "run_dir=/shared/runs/NAME" in found[0]


def test_a_copy_the_rank_cannot_write_back_through_is_an_error(tmp_path):
    # the worker sees a copy of the folder (a synced mirror): the token is there, its writes stay local
    driver_view, learner_view, model = tmp_path / "head" / "run", tmp_path / "worker" / "run", tmp_path / "model"
    model.mkdir()
    token = _driver_probe(driver_view)
    shutil.copytree(driver_view, learner_view)
    found = problems(driver_view, token, [look_at_run_dir(str(learner_view), 0, "10.0.0.3", str(model))],
                     str(model), str(driver_view))
    assert len(found) == 1 and "its file did not reach the driver" in found[0], found


def test_a_model_missing_on_a_rank_names_model_cache_dir(tmp_path):
    run_dir = tmp_path / "run"
    token = _driver_probe(run_dir)
    gone = tmp_path / "cache" / "tiny-arith"
    found = problems(run_dir, token, [look_at_run_dir(str(run_dir), 0, "10.0.0.3", str(gone))], str(gone), str(run_dir))
    assert len(found) == 1 and f"the model {gone} does not exist on learner rank 0 on node 10.0.0.3" in found[0]
    assert "model.cache_dir" in found[0]


@pytest.mark.timeout(300)
def test_a_learner_actor_checks_the_run_dir_and_the_model_through_ray(ray_cluster, tiny_model, tmp_path):
    from prorl_async.config import load_config

    from actors.cluster import RunError
    from actors.learner import start_learner
    from actors.storage import open_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, [f"model.path={tiny_model}", f"run_dir={run_dir}", "train.record_rollouts=false"])
    learner = start_learner(cfg, tiny_model)
    try:
        assert open_run_dir(cfg, learner, run_dir, tiny_model) == 1
        assert not list(run_dir.glob(f"{PROBE}*"))  # the probe files are gone again
        with pytest.raises(RunError, match=r"the model \S+/gone does not exist on learner rank 0 on node "):
            open_run_dir(cfg, learner, run_dir, str(tmp_path / "gone"))
        assert not list(run_dir.glob(f"{PROBE}*"))
    finally:
        ray_cluster.kill(learner)
