"""A local Ray cluster whose node misses its start-up window is started once more.

Ray 2.60's raylet waits a fixed 15 s for its dashboard agent and exits when the agent is late
(ray-project/ray#65983); on a loaded machine ``ray.init`` then fails with "timed out during
startup". Here the agent is made late for real: a ``sitecustomize`` on the cluster's PYTHONPATH
holds the first dashboard agent back 25 s, and the run's ``start_local_ray`` must stop what the
failed start left and come up on its second try.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

SLOW_AGENT = textwrap.dedent("""
    import os, sys, time
    mark = os.environ["SLOW_AGENT_MARK"]
    if any(a.endswith(os.path.join("dashboard", "agent.py")) for a in sys.argv) and not os.path.exists(mark):
        open(mark, "w").close()
        time.sleep(25)  # the raylet gives up after 15 s
""")

DRIVER = textwrap.dedent("""
    import logging, psutil, ray
    from actors.cluster import local_cluster_auth, start_local_ray
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    local_cluster_auth()
    start_local_ray(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    print("one remote call:", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    ray.shutdown()
    left = [p.name() for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    print("children left:", left, flush=True)
""")


@pytest.mark.slow  # about a minute: Ray waits 30 s for the node that never comes up
def test_a_node_whose_agent_is_late_is_started_once_more(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_AGENT)
    mark = tmp_path / "agent-was-held"
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SLOW_AGENT_MARK": str(mark)}
    res = subprocess.run([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert mark.exists(), "the first dashboard agent was not held back: the test did not test anything"
    assert "did not start in time" in out and "trying once more" in out, out[-4000:]
    assert "one remote call: 42" in out
    assert "children left: []" in out, out[-2000:]
