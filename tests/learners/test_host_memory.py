"""``train.reuse_freed_memory`` (:mod:`prorl_async.learners.host_memory`): a CPU learner's
process keeps freed large blocks for the next allocation instead of faulting in fresh pages;
``never`` leaves glibc's default (a fresh ``mmap`` per large block). Measured as minor page
faults of repeated large allocations in a fresh process, through real ``TorchLearner``s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_async.config import ConfigError, load_config
from actors.cluster import generator_placement
from actors.learner import learner_runtime_env
from prorl_async.learners.host_memory import KERNEL_CACHE_ENV, kernel_cache_env, reuse_applies
from prorl_async.machine import cpu_has_bf16

REPO = Path(__file__).resolve().parents[2]

_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from prorl_async.config import load_config
    from prorl_async.learners.torch_learner import TorchLearner

    def faults_per_block(rounds=16, mib=64):
        # a 64 MiB block allocated, written and freed `rounds` times: minor page faults of each round
        out = []
        for _ in range(rounds):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            x = torch.ones(mib << 18)
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            del x
        return out

    seen = {}
    for setting in ("never", "auto"):
        cfg = load_config(None, [f"model.path={sys.argv[1]}", f"train.reuse_freed_memory={setting}"])
        learner = TorchLearner(cfg, sys.argv[1])
        seen[setting] = {"applied": learner.reuses_freed_memory, "faults": faults_per_block()}
    print(json.dumps(seen))
""")


def test_a_cpu_learner_reuses_freed_blocks_and_never_keeps_the_default(tiny_model):
    out = subprocess.run([sys.executable, "-c", _PROBE, tiny_model], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    pages = (64 << 20) // 4096
    never, auto = seen["never"], seen["auto"]
    assert never["applied"] is False and auto["applied"] is True
    # glibc's default: every round maps the block afresh and faults in each of its pages
    assert all(f >= 0.9 * pages for f in never["faults"]), never
    # kept: once the heap has room, a round faults in nothing. Aligned blocks with small allocations
    # between them fragment the heap first: in 8 fresh processes the faults stopped after 1 or after
    # 8 rounds, so 16 rounds are run and the last 3 are checked
    assert all(f <= 0.05 * pages for f in auto["faults"][-3:]), auto


def test_auto_applies_to_a_cpu_learner_only_and_a_bad_value_is_one_config_error(tiny_model):
    assert reuse_applies("auto", "cpu") and reuse_applies("always", "cuda")
    assert not reuse_applies("auto", "cuda") and not reuse_applies("never", "cpu")
    with pytest.raises(ConfigError, match="train.reuse_freed_memory"):
        load_config(None, [f"model.path={tiny_model}", "train.reuse_freed_memory=sometimes"])
    with pytest.raises(ConfigError, match="train.reuse_freed_memory_gb"):
        load_config(None, [f"model.path={tiny_model}", "train.reuse_freed_memory_gb=-1"])


_BOUND_PROBE = textwrap.dedent("""
    import json, sys
    import torch
    from prorl_async.config import load_config
    from prorl_async.learners import host_memory
    from prorl_async.learners.torch_learner import TorchLearner
    from tests.learners._batches import graded_table

    cfg = load_config(None, [f"model.path={sys.argv[1]}", f"train.reuse_freed_memory={sys.argv[2]}",
                             "train.prompts_per_step=4", "rollout.n=4", "train.mini_batches=1",
                             "train.reuse_freed_memory_gb=2"])
    learner = TorchLearner(cfg, sys.argv[1])
    # 2.5 GiB of large blocks freed between small ones that stay: free memory the heap keeps resident
    big, small = [], []
    for _ in range(40):
        big.append(torch.ones(64 << 18))
        small.append(torch.ones(1024))
    del big
    before = host_memory.resident_bytes()
    steps = [learner.train_step(graded_table(groups=4, n=4, seed=s)) for s in (0, 1)]
    print(json.dumps({"before": before, "after": host_memory.resident_bytes(),
                      "steps": [{k: v for k, v in m.items() if k.startswith("perf/heap_")} for m in steps]}))
""")


def _bound_probe(tiny_model, setting):
    out = subprocess.run([sys.executable, "-c", _BOUND_PROBE, tiny_model, setting], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_learner_step_hands_back_kept_memory_above_its_bound_and_reports_it(tiny_model):
    """Kept free memory is bounded: a step's end that finds more than ``train.reuse_freed_memory_gb``
    (here 2) resident beyond what the heap has in use returns the heap's free pages
    (malloc_trim), here 2.5 GiB freed between
    small live blocks, which the heap-top trim threshold never reaches; the next step keeps what
    it frees (no trim). A learner that keeps nothing (``never``) reports nothing."""
    seen = _bound_probe(tiny_model, "auto")
    first, second = seen["steps"]
    assert first["perf/heap_trimmed"] == 1.0 and second["perf/heap_trimmed"] == 0.0, seen
    assert first["perf/heap_rss_gb"] - first["perf/heap_in_use_gb"] > 2, seen
    assert seen["before"] - seen["after"] > 2 * 2**30, seen  # the 2.5 GiB went back to the OS
    assert 0 < second["perf/heap_in_use_gb"] < second["perf/heap_rss_gb"] < first["perf/heap_rss_gb"], seen
    never = _bound_probe(tiny_model, "never")
    assert never["steps"] == [{}, {}], never


_KERNEL_PROBE = textwrap.dedent("""
    import json, random, sys
    import torch
    from prorl_async.config import load_config
    from prorl_async.learners import host_memory
    from prorl_async.learners.torch_learner import TorchLearner

    dtype = getattr(torch, sys.argv[2])
    learner = TorchLearner(load_config(None, [f"model.path={sys.argv[1]}", f"model.dtype={sys.argv[2]}"]), sys.argv[1])
    torch.set_num_threads(1)
    # what a packed learner step does to the caches: matmuls (forward and backward) of
    # SmolLM2's weight shapes at a new token count each round
    ws = [torch.randn(o, i, dtype=dtype, requires_grad=True) for o, i in ((576, 576), (192, 576), (1536, 576))]
    rng, in_use = random.Random(0), []
    for _ in range(60):
        x = torch.randn(rng.randint(200, 1400), 576, dtype=dtype, requires_grad=True)
        for w in ws:
            torch.nn.functional.linear(x, w).float().sum().backward()
        in_use.append(host_memory.heap_bytes()[0])
    print(json.dumps({"in_use": in_use}))
""")


def test_a_cpu_learner_process_bounds_the_kernel_caches_that_grew_a_step_at_a_time(tiny_model):
    """``train.kernel_cache_entries``: in a process started with the environment a CPU learner
    actor gets (:func:`actors.learner.learner_runtime_env`, 64 entries), a bf16 learner's matmul
    kernel caches, keyed by shape, stop growing with new token counts; at the libraries' default
    (1024, ``0``) the same matmuls keep adding to the heap in use. On a CPU without native bf16
    (AVX2 only) the learner runs fp32 (``model.dtype: auto``), whose matmuls do not go through
    oneDNN's cached kernels (measured: no growth at either setting): that is checked there instead."""
    bf16 = cpu_has_bf16()
    base = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_ENV}
    seen = {}
    for entries in (64, 0):
        with pytest.MonkeyPatch.context() as mp:
            for k in KERNEL_CACHE_ENV:
                mp.delenv(k, raising=False)
            cfg = load_config(None, [f"model.path={tiny_model}", f"train.kernel_cache_entries={entries}"])
            env_vars = learner_runtime_env(cfg).get("runtime_env", {}).get("env_vars", {})
        assert {k: env_vars.get(k) for k in KERNEL_CACHE_ENV} == dict.fromkeys(KERNEL_CACHE_ENV, str(entries) if entries else None)
        out = subprocess.run([sys.executable, "-c", _KERNEL_PROBE, tiny_model, "bfloat16" if bf16 else "float32"],
                             cwd=REPO, capture_output=True,
                             text=True, timeout=300, env={**base, **env_vars})
        assert out.returncode == 0, out.stderr[-2000:]
        seen[entries] = json.loads(out.stdout.strip().splitlines()[-1])["in_use"]
    growth = {k: (v[-1] - v[19]) / 2**20 for k, v in seen.items()}  # MiB over the last 40 rounds
    assert growth[64] < 25 and (growth[0] > 100 if bf16 else growth[0] < 25), growth


def test_kernel_cache_env_keeps_an_exported_capacity_and_leaves_a_gpu_learner_alone(monkeypatch, tiny_model):
    for name in KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "300")  # the actor inherits the exported one
    assert kernel_cache_env(0, on_gpu=False) == {} and kernel_cache_env(16, on_gpu=True) == {}
    assert kernel_cache_env(16, on_gpu=False) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
    cfg = load_config(None, [f"model.path={tiny_model}", "ray.omp_wait_policy=passive"])
    assert learner_runtime_env(cfg)["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE",
                                                                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    # a CPU generator's process gets the same bound (its decode batch sizes are new shapes too); a GPU one not
    role = {"PRORL_ASYNC_ROLE": "generator-0"}
    assert generator_placement(cfg, 0)[0]["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE", **role,
                                                                         "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    gpu = load_config(None, [f"model.path={tiny_model}", "ray.omp_wait_policy=passive", "rollout.generator_num_gpus=1"])
    assert generator_placement(gpu, 0)[0]["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE", **role}
    with pytest.raises(ConfigError, match="train.kernel_cache_entries"):
        load_config(None, [f"model.path={tiny_model}", "train.kernel_cache_entries=-1"])
