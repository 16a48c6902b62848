"""A real training run on a simulated three-node cluster (issue 26).

``ray.cluster_utils.Cluster`` starts a head (one CPU, no custom resource) and two worker nodes,
each at its own loopback IP with its own custom resource: ``gen_node`` on 127.0.0.2 and
``learn_node`` on 127.0.0.3. ``prorl-async train`` (the real CLI, a subprocess) joins it with the
generator pinned to the first, a 2-rank DeepSpeed learner to the second, and the grader to the
head, and the test reads back where each actor ran from the run's start-up line. Every simulated
node is this host, so a wrong address could still connect: the addresses themselves are asserted
(this host's name resolves to 127.0.0.1, where gloo would listen without ``bind_gloo``).

Only what the fixture started is stopped (``Cluster.shutdown``), never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from unittest import mock

import pytest

from tests.conftest import cli, environ_restored

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]  # 58-200 s on the 2-core machine (its DeepSpeed op built once a session)

GEN_IP, LEARN_IP = "127.0.0.2", "127.0.0.3"
STEPS, PROMPTS = 3, 4
RUN = [f"train.total_steps={STEPS}", f"train.prompts_per_step={PROMPTS}", "rollout.n=4", "rollout.prompts_per_request=4",
       "train.eval_interval=0", "train.eval_samples=1", "data.eval=builtin:arithmetic?n=8&seed=2&split=eval",
       "model.warmup_steps=100", "algo.max_refill_rounds=0", "algo.dynamic_sampling=false", "tracking.enabled=false",
       "train.mini_batches=1", "train.micro_batch_size=8",
       "train.learner=deepspeed", "train.zero_stage=2", "train.num_learners=2", "train.learner_num_cpus=1",
       "train.learner_resources={learn_node: 1}", "rollout.generator_resources={gen_node: 1}",
       'reward.grader_resources={"node:__internal_head__": 0.01}']


@pytest.fixture(scope="module")
def cluster(_torch_ext_dir):
    """Head + two nodes; the environment (token, DeepSpeed's extensions dir) is what their processes inherit."""
    from ray.cluster_utils import Cluster

    from actors.cluster import local_cluster_auth

    tmp = tempfile.mkdtemp(prefix="prcs", dir="/tmp")  # short: unix socket paths
    with environ_restored():
        local_cluster_auth()  # a token in the environment only (or the session's, when it has one)
        os.environ["TORCH_EXTENSIONS_DIR"] = _torch_ext_dir  # DeepSpeed's CPU comm op, built once per session
        # Ray's memory monitor counts the whole host's memory: on a shared machine another job's use
        # would have the simulated nodes kill this run's workers (seen: the learner group, at 95 %)
        os.environ["RAY_memory_monitor_refresh_ms"] = "0"
        c = None
        try:  # the head would write its address to /tmp/ray/ray_current_cluster, which address="auto" reads
            with mock.patch("ray._private.utils.write_ray_address"):
                c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                  "temp_dir": tmp})
            c.add_node(num_cpus=1, resources={"gen_node": 1}, node_ip_address=GEN_IP)
            c.add_node(num_cpus=2, resources={"learn_node": 2}, node_ip_address=LEARN_IP)
            yield c
        finally:
            if c is not None:
                c.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def _places(stdout: str) -> tuple[dict, str]:
    """{role: (node_ip, {note: value})} and the weight-sync part of the run's ``actors: ...`` line."""
    (line,) = [x for x in stdout.splitlines() if x.startswith("actors: ")]
    *actors, sync = line.removeprefix("actors: ").split("; ")
    places = {}
    for entry in actors:
        m = re.fullmatch(r"(\S+) on (\S+)(?: \((.*)\))?", entry)
        assert m, entry
        notes = dict(n.rsplit(" ", 1) for n in m.group(3).split(", ")) if m.group(3) else {}
        places[m.group(1)] = (m.group(2), notes)
    return places, sync


def test_training_run_on_a_three_node_cluster(cluster, tmp_path, model_cache):
    from prorl_async.checkpoint import load_latest
    from prorl_async.config import load_config
    from tests.accounting import assert_nothing_lost_or_repeated

    run_dir = tmp_path / "run"
    over = [*RUN, f"run_dir={run_dir}", f"model.cache_dir={model_cache}", f"tracking.aim_repo={tmp_path / 'aim'}"]
    res = cli("train", *over, f"ray.address={cluster.address}", cwd=tmp_path, timeout=1000)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]

    places, sync = _places(res.stdout)
    head_ip = cluster.head_node.node_ip_address
    assert places["generator-0"][0] == GEN_IP and places["grader"][0] == head_ip, places
    (ip0, rank0), (ip1, rank1) = places["learner-0"], places["learner-1"]
    assert ip0 == ip1 == LEARN_IP, places
    # every rank's MASTER_ADDR is rank 0's node IP: both joined the world rank 0 serves on its node
    assert rank0["world"] == rank1["world"] and rank0["world"].rsplit(":", 1)[0] == ip0, places
    # the weight-sync store is on the learner's node
    assert re.fullmatch(rf"weight sync: gloo, store {re.escape(ip0)}:\d+", sync), sync
    # gloo listens on each actor's node IP (its groups: the learners' world, the weight-sync group)
    assert rank0["gloo"] == rank1["gloo"] == LEARN_IP and places["generator-0"][1]["gloo"] == GEN_IP, places
    # the ranks are packed by one placement group (on the learner node, as the IPs say)
    assert rank0["placement group"] == rank1["placement group"], places
    assert "placement group" not in places["generator-0"][1], places

    # every prompt accounted for: each step trained its groups, none twice, nothing drawn was lost
    steps = [json.loads(x) for x in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(s) for s in steps] == [PROMPTS] * STEPS
    groups = [g for s in steps for g in s]
    assert len(groups) == len(set(groups)) and max(Counter(g.split("/", 1)[1] for g in groups).values()) == 1
    assert_nothing_lost_or_repeated(load_config(None, over), load_latest(str(run_dir)).path)
