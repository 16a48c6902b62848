"""``ray job submit`` against a ``ray start --head`` cluster, token authentication on: the
walkthrough of docs/cluster.md ("On one machine").

The head runs with its own ports, temp dir and HOME (so no ``~/.ray/auth_token`` of the real
user is read or written); a second node joins it with ``ray start --address`` at 127.0.0.20
with a custom resource (``gen_node``), its own ports and temp dir. The cluster token reaches
them, and the ``ray job`` client, through ``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN``. The job
is the real console script, shipped with ``--working-dir``, its generator pinned to
``gen_node``. Teardown stops only what this test started: SIGTERM to each ``ray start --block``
process (which shuts down the gcs, raylet, dashboard and agents it spawned), then any process
still carrying a node's marker in its environment.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _free_block(n: int) -> int:
    """Start of ``n`` consecutive ports that are free right now, below the kernel's ephemeral range
    (32768+), so no port it hands out to another socket meanwhile (Ray's own ``0`` ports included)
    can land inside. Every port of the head comes from this one block: none can collide with another
    (CI saw a randomly picked agent port fall inside the worker-port range, and ``ray start`` refuse)."""
    for _ in range(200):
        lo = 20000 + secrets.randbelow(12000 - n)
        socks = []
        try:
            for p in range(lo, lo + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return lo
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries this test's marker (only ours can)."""
    needle = f"PRORL_RAY_JOB_TEST={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


WORKER_IP = "127.0.0.20"  # a second node of the test cluster, as `ray start --address` starts one on another machine


class Head:
    def __init__(self, join: "Head | None" = None):
        """The head node, or with ``join`` a worker node of that head's cluster (its own address
        ``WORKER_IP``, ports, marker and a custom resource ``gen_node``; the head's token and HOME)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="prj", dir="/tmp"))  # short: unix socket paths
        self.home = join.home if join else self.tmp / "home"
        self.home.mkdir(exist_ok=True)
        self.tag = secrets.token_hex(8)
        self.token = join.token if join else secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({
            "HOME": str(self.home),
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
            # multi-node (Linux's default, said for clarity): with 0 the head would bind loopback only and
            # `ray start --address` refuse to join ("multi-node ... not supported")
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the job finds `prorl-async`
            "PRORL_RAY_JOB_TEST": self.tag,
        })
        env.pop("PYTHONPATH", None)
        self.env = env
        lo = _free_block(64 + 10)  # 64 worker ports, then one port per component
        port = iter(range(lo + 64, lo + 74))
        self.dashboard_port, self.gcs_port = next(port), next(port)
        own = [f"--node-manager-port={next(port)}", f"--object-manager-port={next(port)}",
               f"--min-worker-port={lo}", f"--max-worker-port={lo + 63}",
               f"--dashboard-agent-listen-port={next(port)}", f"--dashboard-agent-grpc-port={next(port)}",
               f"--metrics-export-port={next(port)}", f"--runtime-env-agent-port={next(port)}",
               "--num-gpus=0", "--disable-usage-stats"]
        if join is None:
            self.cmd = [
                str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={next(port)}", *own,
                f"--temp-dir={self.tmp / 'r'}", "--num-cpus=4", "--include-dashboard=true"]
            self.address = f"http://127.0.0.1:{self.dashboard_port}"
        else:  # the walkthrough's second command (docs/cluster.md, "On one machine")
            self.cmd = [str(BIN / "ray"), "start", f"--address=127.0.0.1:{join.gcs_port}", "--block",
                        f"--node-ip-address={WORKER_IP}", *own, "--num-cpus=1", '--resources={"gen_node": 1}',
                        f"--temp-dir={self.tmp / 'r'}"]  # its own: two nodes of one host must not share one
            self.address = join.address
        self.joins = join
        self.proc = None

    def start(self, timeout: float = 180) -> None:
        self.log = open(self.tmp / "head.log", "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{(self.tmp / 'head.log').read_text()}")
            try:
                if self.joins is None:
                    self.api("/api/jobs/")
                    return
                if any(n.get("node_ip") == WORKER_IP and n.get("state") == "ALIVE" for n in self.nodes()):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"head did not come up in {timeout}s:\n{(self.tmp / 'head.log').read_text()}")

    def nodes(self) -> list[dict]:
        """The cluster's nodes as Ray's state API lists them."""
        return self.api("/api/v0/nodes?limit=100")["data"]["result"]["result"]

    def api(self, path: str, token: bool = True):
        req = urllib.request.Request(self.address + path)
        if token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def ray(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        """The ``ray`` CLI as a user on this cluster runs it (token in the environment). A job
        submitted before the head's job agent is up is refused with "No available agent to submit
        job, please try again later" (seen on a loaded machine): tried again for up to a minute."""
        deadline = time.time() + 60
        while True:
            res = subprocess.run([str(BIN / "ray"), *args], cwd=ROOT, env=self.env, capture_output=True,
                                 text=True, timeout=timeout)
            if "No available agent to submit job" not in res.stdout + res.stderr or time.time() > deadline:
                return res
            time.sleep(3)

    def stop(self) -> list[int]:
        """Stop what ``start`` started; returns pids that needed a SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` shuts its node down on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.time() + 30
        while _tagged_pids(self.tag) and time.time() < deadline:
            time.sleep(0.5)
        killed = _tagged_pids(self.tag)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if getattr(self, "log", None):
            self.log.close()
        return killed


@pytest.fixture(scope="module")
def head():
    """A head, and a second node joined to it with a custom resource (docs/cluster.md, "On one machine")."""
    h = Head()
    w = None
    try:
        h.start()
        w = Head(join=h)
        w.start()
        yield h
    finally:
        killed = (w.stop() if w is not None else []) + h.stop()
        for node in (w, h):
            if node is not None:
                shutil.rmtree(node.tmp, ignore_errors=True)
        assert not any(_tagged_pids(n.tag) for n in (w, h) if n is not None), "processes of the test cluster survived SIGKILL"
        assert not killed, f"processes still running 30 s after the head stopped: {killed}"


def _wait_job(h: Head, job_id: str, timeout: float) -> str:
    deadline = time.time() + timeout
    status = "?"
    while time.time() < deadline:
        status = h.api(f"/api/jobs/{job_id}")["status"]
        if status in TERMINAL:
            return status
        time.sleep(2)
    return f"TIMEOUT (last status {status})"


def test_token_auth_is_on(head):
    with pytest.raises(urllib.error.HTTPError) as e:
        head.api("/api/jobs/", token=False)
    assert e.value.code == 401
    env_no_token = {k: v for k, v in head.env.items() if not k.startswith("RAY_AUTH")}
    res = subprocess.run([str(BIN / "ray"), "job", "list", "--address", head.address], env=env_no_token,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "authentication" in (res.stdout + res.stderr).lower()
    # `ray start --head` uses the token it is given and writes none to ~/.ray
    assert not (head.home / ".ray" / "auth_token").exists()


def test_submit_short_training_job(head):
    out = head.tmp / "out"
    run_dir, aim_repo = out / "run", out / "aim"
    job_id = f"prorl-test-{head.tag}"
    res = head.ray(
        "job", "submit", "--address", head.address, "--submission-id", job_id, "--no-wait",
        "--working-dir", ".", "--",
        "prorl-async", "train", f"run_dir={run_dir}", f"tracking.aim_repo={aim_repo}",
        f"model.cache_dir={out / 'cache'}", "tracking.run_name=ray-job-test",
        "train.total_steps=3", "train.prompts_per_step=8", "rollout.n=4", "train.eval_interval=0",
        "model.warmup_steps=100", "algo.max_refill_rounds=0",  # a weakly warmed model: no refill bound
        "ray.omp_wait_policy=passive",  # the actors' own runtime env merges with the job's working dir
        "data.eval=builtin:arithmetic?n=16&seed=2&split=eval",  # shlex-quoted by ray
        "rollout.generator_resources={gen_node: 1}",  # on the second node, as the walkthrough says
    )
    assert res.returncode == 0, res.stdout + res.stderr
    status = _wait_job(head, job_id, timeout=420)
    logs = head.ray("job", "logs", job_id, "--address", head.address)
    assert logs.returncode == 0, logs.stderr
    assert status == "SUCCEEDED", f"job {status}; logs:\n{logs.stdout[-6000:]}"

    for step in (1, 2, 3):
        assert f"step    {step}/3" in logs.stdout, logs.stdout[-4000:]
    assert "done: 3 steps" in logs.stdout
    assert f"run directory: {run_dir}" in logs.stdout
    # the generator on the node that holds gen_node, its gloo bound there; the buffer on the driver's node, the head
    (line,) = [x for x in logs.stdout.splitlines() if x.startswith("actors: ")]
    (head_ip,) = [n["node_ip"] for n in head.nodes() if n["is_head_node"]]
    assert head_ip != WORKER_IP and line.startswith(f"actors: generator-0 on {WORKER_IP} (gloo {WORKER_IP}); "), line
    assert f"; buffer on {head_ip};" in line, (head_ip, line)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert len((run_dir / "history.jsonl").read_text().splitlines()) == 3
    assert (run_dir / "config.yaml").is_file() and (aim_repo / ".aim").is_dir()

    from prorl_async.compare import open_runs  # the Aim run is there, with its hyperparameters

    (run,) = open_runs([str(run_dir)])
    assert run.hash == summary["aim_run_hash"] and run.label == "ray-job-test"
    assert run.hparams["train"]["total_steps"] == 3
    assert run.series("actor/pg_loss").steps == [1, 2, 3]
    steps = run.series("reward/mean").steps  # an asynchronous step that graded nothing has no reward mean
    assert steps[0] == 1 and set(steps) <= {1, 2, 3}


PLACEMENT_SCRIPT = r"""
import os
import ray
from prorl_async.config import load_config
from prorl_async.learners.host_memory import kernel_cache_env
from actors.cluster import RunError, generator_placement, learner_placement

ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR",
         _temp_dir=os.environ["PRORL_TEST_RAY_TMP"])
try:
    opts, pg = generator_placement(load_config(None, ["rollout.generator_num_gpus=0"]), 0)
    # the role its worker's log file is named by, and (a CPU generator) its kernel caches' bound
    kernels = kernel_cache_env(64, on_gpu=False)
    assert kernels and pg is None and opts == {"num_cpus": 1.0, "num_gpus": 0.0, "runtime_env": {
        "env_vars": {"PRORL_ASYNC_ROLE": "generator-0", **kernels}}}, opts

    opts, pg = generator_placement(load_config(None, ["rollout.generator_num_gpus=2"]), 0, timeout_s=60)
    table = ray.util.placement_group_table(pg)
    assert table["strategy"] == "STRICT_PACK" and table["bundles"] == {0: {"GPU": 2.0, "CPU": 1.0}}, table

    @ray.remote
    class Probe:
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_placement_group_id(), sorted(ray.get_gpu_ids())

    pg_id, gpus = ray.get(Probe.options(**opts).remote().where.remote())
    assert pg_id == pg.id.hex() and gpus == [0, 1], (pg_id, gpus)
    ray.util.remove_placement_group(pg)

    try:  # more GPUs than any node has: a clear error, not a pending actor
        generator_placement(load_config(None, ["rollout.generator_num_gpus=4"]), 1, timeout_s=3)
        raise AssertionError("expected RunError")
    except RunError as e:
        assert "rollout.generator_num_gpus=4" in str(e), e

    opts, pg = generator_placement(load_config(None, ["rollout.generator_resources={gen_node: 1}"]), 0)
    assert pg is None and opts["resources"] == {"gen_node": 1}, opts  # pinned to the nodes holding gen_node
    ds = ["train.learner=deepspeed", "train.num_learners=2"]
    assert learner_placement(load_config(None, [])) is None  # one learner: nothing to pack
    try:  # a resource no node has: the learner ranks' bundles are one clear error, not pending actors
        learner_placement(load_config(None, ds + ["train.learner_resources={learn_node: 1}"]), timeout_s=3)
        raise AssertionError("expected RunError")
    except RunError as e:
        assert "train.learner_resources={'learn_node': 1}" in str(e) and "'learn_node': 1" in str(e), e
        assert "within 3s; cluster resources: " in str(e), e
    print("placement ok")
finally:
    ray.shutdown()
"""


def test_generator_placement_group_strict_pack(tmp_path):
    """A >1-GPU generator gets one STRICT_PACK bundle (Ray's logical GPUs stand in for real ones)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # read when ray is imported
    ray_tmp = tempfile.mkdtemp(prefix="prp", dir="/tmp")  # short: unix socket paths
    env["PRORL_TEST_RAY_TMP"] = ray_tmp
    try:
        res = subprocess.run([sys.executable, "-c", PLACEMENT_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert res.returncode == 0 and "placement ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
