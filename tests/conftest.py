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


@pytest.fixture(scope="session")
def _torch_ext_dir(tmp_path_factory):
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch-ext"))


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
    """A cache dir shared by the session so the built-in model is warmed up once."""
    d = os.environ.get("PRORL_ASYNC_TEST_CACHE") or str(tmp_path_factory.mktemp("model-cache"))
    return d


@pytest.fixture(scope="session")
def tiny_model(model_cache):
    """The built-in model with a short warm-up (partial accuracy), built once per session."""
    from prorl_async.config import ModelConfig
    from prorl_async.models import build_tiny_arith

    return str(build_tiny_arith(ModelConfig(cache_dir=model_cache, warmup_steps=200), log=lambda *_: None))


@pytest.fixture(scope="session")
def smollm2_model(model_cache):
    """builtin:smollm2-135m-instruct converted once per session (needs `bash setup.sh smollm2`)."""
    import importlib.util

    from prorl_async.config import ModelConfig
    from prorl_async.models import SMOLLM2_WHEEL, build_smollm2

    if importlib.util.find_spec(SMOLLM2_WHEEL) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 is not installed; run `bash setup.sh smollm2`")
    return str(build_smollm2(ModelConfig(cache_dir=model_cache), log=lambda *_: None))


def cli(*args, cwd=None, env=None, timeout=600, raw=False):
    """Run the real console entry point in a subprocess, stdout and stderr to pipes. ``raw``: its
    output as bytes, as written (text mode turns a carriage return into a newline)."""
    import subprocess

    exe = Path(sys.executable).with_name("prorl-async")
    full_env = {**os.environ, **(env or {})}
    for k in ("RAY_ADDRESS",):
        full_env.pop(k, None)
    return subprocess.run([str(exe), *args], cwd=cwd, env=full_env, capture_output=True, text=not raw,
                          timeout=timeout)
