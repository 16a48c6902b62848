"""A node dies under a generator, mid-run, on a simulated cluster (issue 26).

``ray.cluster_utils.Cluster``: a head (the grader), a learner node (127.0.0.13) and two nodes that
can hold the generator (``gen_node``: 127.0.0.12 and 127.0.0.14; Ray picks where it starts).
``prorl-async train`` (the real CLI, a subprocess) runs against it; after a few steps the test
removes the generator's node (``Cluster.remove_node``: its raylet and every worker on it die).
Ray restarts the generator on the spare node, the driver re-forms the weight-sync group and the
run finishes: the generator is back on the other node with gloo bound there, the death is counted
once, no prompt is lost or trained twice, and the learner's process holds no more open files or
listening sockets after the re-formed group than before it.

Only what the fixture started is stopped (``Cluster.shutdown``), never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest

from tests.conftest import environ_restored

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

# addresses of their own: test_cluster_sim (127.0.0.2-3) may run beside this one, and its learner must not
# be taken for this run's
GEN_IP, SPARE_IP, LEARN_IP = "127.0.0.12", "127.0.0.14", "127.0.0.13"
STEPS, PROMPTS = 40, 4
RUN = [f"train.total_steps={STEPS}", f"train.prompts_per_step={PROMPTS}", "rollout.n=4", "rollout.prompts_per_request=4",
       "train.eval_interval=0", "train.eval_samples=1", "data.eval=builtin:arithmetic?n=8&seed=2&split=eval",
       "model.warmup_steps=100", "algo.max_refill_rounds=0", "algo.dynamic_sampling=false", "tracking.enabled=false",
       "train.mini_batches=1", "train.micro_batch_size=8", "train.checkpoint_interval=10",
       "train.learner_resources={learn_node: 1}", "rollout.generator_resources={gen_node: 1}",
       'reward.grader_resources={"node:__internal_head__": 0.01}']


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    from actors.cluster import local_cluster_auth

    tmp = tempfile.mkdtemp(prefix="prnd", dir="/tmp")  # short: unix socket paths
    with environ_restored():
        local_cluster_auth()
        os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # another job's memory must not kill this run's workers
        c = None
        try:
            with mock.patch("ray._private.utils.write_ray_address"):  # keep address="auto" away from this cluster
                c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                  "temp_dir": tmp})
            gens = {GEN_IP: c.add_node(num_cpus=1, resources={"gen_node": 1}, node_ip_address=GEN_IP)}
            c.add_node(num_cpus=1, resources={"learn_node": 1}, node_ip_address=LEARN_IP)
            gens[SPARE_IP] = c.add_node(num_cpus=1, resources={"gen_node": 1}, node_ip_address=SPARE_IP)
            yield c, gens
        finally:
            if c is not None:
                c.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def _learner_process() -> psutil.Process:
    """This run's learner: the Ray worker listening on the learner node's address."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "LearnerActor" in " ".join(p.info["cmdline"] or []) and any(
                    c.status == "LISTEN" and c.laddr.ip == LEARN_IP for c in p.net_connections("tcp")):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError("no learner process listening on " + LEARN_IP)


def _held(p: psutil.Process) -> tuple[int, int]:
    return p.num_fds(), sum(c.status == "LISTEN" for c in p.net_connections("tcp"))


def _steps(run_dir) -> int:
    path = run_dir / "history.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_node_dies_under_the_generator_and_the_run_goes_on(cluster, tmp_path, model_cache):
    from prorl_async.checkpoint import load_latest
    from prorl_async.config import load_config
    from tests.accounting import assert_nothing_lost_or_repeated

    c, gen_nodes = cluster
    run_dir = tmp_path / "run"
    over = [*RUN, f"run_dir={run_dir}", f"model.cache_dir={model_cache}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = open(tmp_path / "console.txt", "w")
    exe = str(Path(sys.executable).with_name("prorl-async"))  # the real console entry point, as conftest.cli
    proc = subprocess.Popen([exe, "train", *over, f"ray.address={c.address}"],
                            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while _steps(run_dir) < 3:
            assert proc.poll() is None, (tmp_path / "console.txt").read_text()[-4000:]
            assert time.time() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        learner = _learner_process()
        before = _held(learner)
        (start,) = [x for x in (tmp_path / "console.txt").read_text().splitlines() if x.startswith("actors: ")]
        first = re.match(r"actors: generator-0 on (\S+) ", start).group(1)  # either node that can hold it
        assert first in gen_nodes and f"generator-0 on {first} (gloo {first})" in start, start
        # the buffer (its death would end the run) is on the driver's node, the head, beside the grader
        head = re.search(r"; grader on (\S+);", start).group(1)
        assert f"; buffer on {head};" in start and head not in gen_nodes, start
        c.remove_node(gen_nodes[first])  # the generator's node dies, with the generator on it
        killed_at = _steps(run_dir)
        while _steps(run_dir) < min(STEPS, killed_at + 8):  # steps after the re-formed group
            assert proc.poll() is None, (tmp_path / "console.txt").read_text()[-4000:]
            assert time.time() < deadline, "no steps after the node died"
            time.sleep(0.2)
        after = _held(learner)
        assert proc.wait(timeout=max(10, deadline - time.time())) == 0, (tmp_path / "console.txt").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    console = (tmp_path / "console.txt").read_text()

    assert killed_at < STEPS, "the run ended before the node was removed"
    other = re.escape(SPARE_IP if first == GEN_IP else GEN_IP)  # where it must come back
    reformed = [x for x in console.splitlines() if x.startswith("weight sync re-formed ")]
    assert reformed and re.fullmatch(rf"weight sync re-formed \(group \d+, store {re.escape(LEARN_IP)}:\d+\): "
                                     rf"generator-0 on {other} \(gloo {other}\)", reformed[-1]), reformed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["generator_failures"] == 1, summary  # one death, counted once
    # no more open files or listening sockets on the learner after the re-formed group than before it.
    # Not evidence of the close on re-form by itself: gloo drops a dead peer's sockets on its own, and
    # with both closes (re-form, failed broadcast) removed this still held (60 fds, 3 listeners before
    # and after, 2026-11-27). test_weight_sync's re-formed-group test is the one that fails without them
    print(f"learner fds, listening sockets: {before} before the node died, {after} after the re-formed group")
    assert after[1] <= before[1] and after[0] <= before[0] + 4, (before, after)

    steps = [json.loads(x) for x in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(s) for s in steps] == [PROMPTS] * STEPS
    groups = [g for s in steps for g in s]
    assert len(groups) == len(set(groups))
    assert_nothing_lost_or_repeated(load_config(None, over), load_latest(str(run_dir)).path)
