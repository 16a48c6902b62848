"""The curriculum (``curriculum.enabled``, :mod:`prorl_async.curriculum`) through the real CLI, the
built-in model and a real local Ray: a mix without signal stops at the preflight, pools without
signal are held back (probed, never trained) while the rest trains, and a held pool whose pass
rate rises mid-run is re-admitted.

The built-in model here is warmed up further than elsewhere (``WARMUP``: it stops at greedy
accuracy 0.5, a few hundred steps) so that arithmetic has signal in every preflight; it cannot
answer a Reasoning Gym task at all (no ``<answer>`` tags), which is the "too hard" pool.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli

WARMUP = 1500  # most warm-up steps; the warm-up stops at greedy accuracy 0.5 (about 750 steps)
RG = "reasoning-gym:spell_backward?n=40&seed=1&min_word_len=9&max_word_len=10"
RG_POOL = "rg:spell_backward"
EVAL = "data.eval=builtin:arithmetic?n=8&seed=2&split=eval"


def tiny(model_cache, run_dir) -> list[str]:
    return ["curriculum.enabled=true", f"model.warmup_steps={WARMUP}", f"model.cache_dir={model_cache}",
            "ray.num_cpus=2", "tracking.enabled=false", f"run_dir={run_dir}", "train.eval_interval=0",
            "train.eval_samples=2", EVAL]


@pytest.fixture(scope="module")
def warm_model(model_cache):
    """The CLI runs' model, built once into the shared cache (so the CLI timings leave its build out)."""
    from prorl_async.config import ModelConfig
    from prorl_async.models import build_tiny_arith

    return build_tiny_arith(ModelConfig(cache_dir=model_cache, warmup_steps=WARMUP), seed=0, log=lambda *_: None)


def pool_table(text: str, title: str) -> dict[str, tuple[int, float, float, str, float]]:
    """``{pool: (groups, mean reward, signal, status, share of the active prompts)}`` of the table printed under ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{title}: "))
    header = lines[start + 1].split()  # reward: the mean reward (pass@1 for 0/1 rewards)
    assert header[:2] == ["pool", "groups"] and header[2] == "reward" and header[3:] == ["signal", "share", "status"], \
        lines[start:start + 2]
    out = {}
    for line in lines[start + 2:]:
        m = re.match(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(active|held \((?:too hard|settled|solved)\))$",
                     line)
        if not m:
            break
        out[m[1]] = (int(m[2]), float(m[3]), float(m[4]), m[6], float(m[5]))
    return out


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_mix_without_signal_stops_at_the_preflight(tmp_path, warm_model, model_cache):
    run_dir = tmp_path / "run"
    t0 = time.time()
    res = cli("train", f"data.train={RG}", *tiny(model_cache, run_dir), "train.total_steps=2",
              "train.prompts_per_step=4", "rollout.n=4", "rollout.prompts_per_request=4",
              "curriculum.preflight_prompts=4", cwd=tmp_path, timeout=300)
    took = time.time() - t0
    print(f"\nCLI time, a mix without signal stopped at the preflight: {took:.1f}s")
    out = res.stdout.replace("\r", "\n")
    assert res.returncode == 1, out[-3000:] + res.stderr[-3000:]
    # Ray's forwarded worker warnings may come first on stderr; the error is the CLI's one "error: " message
    errors = [i for i, line in enumerate(res.stderr.splitlines()) if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    err = "\n".join(res.stderr.splitlines()[errors[0]:])
    assert err.startswith("error: no task of the training mix has signal"), err
    table = pool_table(err, "preflight")
    assert table[RG_POOL][0] == 4 and table[RG_POOL][3] == "held (too hard)", err  # every pool was sampled
    assert "preflight: 0 of 1 pools active" in err
    assert "Traceback" not in res.stderr + res.stdout
    assert not re.search(r"^step +1/", out, re.M), out[-3000:]  # no training step ran
    assert not (run_dir / "history.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_a_mix_holds_back_pools_without_signal_and_trains_the_rest(tmp_path, warm_model, model_cache):
    run_dir = tmp_path / "run"
    mix = ('data.mix=[{source: "builtin:arithmetic?n=200&seed=1&split=train", weight: 1}, '
           f'{{source: "{RG}", weight: 1}}]')
    t0 = time.time()
    res = cli("train", mix, "data.mix_size=240", *tiny(model_cache, run_dir), "train.total_steps=3",
              "train.prompts_per_step=8", "rollout.n=8", "rollout.prompts_per_request=8",
              "algo.max_refill_rounds=0", cwd=tmp_path, timeout=400)
    print(f"\nCLI time, arithmetic + a held Reasoning Gym pool, 3 steps: {time.time() - t0:.1f}s")
    out = res.stdout.replace("\r", "\n")
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    pre = pool_table(out, "preflight")
    assert set(pre) == {"arithmetic", RG_POOL}, out[-3000:]
    assert pre["arithmetic"][3] == "active" and pre[RG_POOL][3] == "held (too hard)", pre
    assert pre["arithmetic"][4] == 1.0 and pre[RG_POOL][4] == 0.0  # the active pool's share of the prompts
    assert "preflight: 1 of 2 pools active" in out
    assert pre[RG_POOL][0] == 8 and pre[RG_POOL][1] == 0.0  # curriculum.preflight_prompts groups, none right
    end = pool_table(out, "curriculum at the end")
    assert end["arithmetic"][3] == "active" and end[RG_POOL][3] == "held (too hard)", end

    history = read_jsonl(run_dir / "history.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        assert h["curriculum/active/arithmetic"] == 1 and h[f"curriculum/active/{RG_POOL}"] == 0, h
        assert h["curriculum/active_pools"] == 1 and h["curriculum/held_pools"] == 1
        assert f"curriculum/signal/{RG_POOL}" in h and f"curriculum/pass_rate/{RG_POOL}" in h

    # every group trained on is arithmetic (the probes of the held pool are all wrong: dropped)
    trained = read_jsonl(run_dir / "trained_groups.jsonl")
    assert len(trained) == 3 and all(len(step) == 8 for step in trained)
    ids = [key.split("/", 1)[1] for step in trained for key in step]
    assert all(i.startswith("arith-train-1-") for i in ids), ids

    # the held pool was probed, at about curriculum.probe_frac of the prompts, not its mix share (half)
    summary = json.loads((run_dir / "summary.json").read_text())
    pools = summary["curriculum"]
    assert pools[RG_POOL]["status"] == "held" and pools["arithmetic"]["status"] == "active"
    assert pools[RG_POOL]["groups"] > pre[RG_POOL][0], pools  # groups observed after the preflight: probes
    assert pools[RG_POOL]["groups"] == end[RG_POOL][0]
    probed, fed = pools[RG_POOL]["source"]["consumed"], pools["arithmetic"]["source"]["consumed"]
    assert probed + fed == summary["prompts_consumed"]
    assert 1 <= probed <= 0.35 * (probed + fed), (probed, fed)


class Run:
    """The CLI in a subprocess, its stdout read line by line (a thread feeds a queue), every wait
    with a deadline; on a missed deadline the run is stopped and the test fails with its output."""

    def __init__(self, args: list[str], cwd, env: dict, deadline_s: float):
        full_env = {**os.environ, **env}
        full_env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([str(Path(sys.executable).with_name("prorl-async")), *args], cwd=cwd,
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1, start_new_session=True)
        self.deadline = time.time() + deadline_s
        self.lines: list[str] = []
        self.err: list[str] = []
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.q), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, None), daemon=True).start()

    def _pump(self, stream, q) -> None:
        for line in stream:  # text mode: "\r" (progress bars) ends a line too
            (q.put(line.rstrip("\n")) if q is not None else self.err.append(line))
        if q is not None:
            q.put(None)

    def output(self) -> str:
        return "\n".join(self.lines)[-4000:] + "\n--- stderr ---\n" + "".join(self.err)[-4000:]

    def fail(self, why: str):
        self.stop()
        pytest.fail(f"{why}\n{self.output()}")

    def wait_for(self, pattern: str) -> re.Match:
        """The first stdout line (from now on) matching ``pattern``."""
        while True:
            left = self.deadline - time.time()
            if left <= 0:
                self.fail(f"no line matching {pattern!r} before the deadline")
            try:
                line = self.q.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                self.fail(f"the run ended (exit code {self.proc.wait()}) before a line matching {pattern!r}")
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m

    def finish(self) -> int:
        """Reads stdout to its end; the exit code."""
        while True:
            left = self.deadline - time.time()
            if left <= 0:
                self.fail("the run did not end before the deadline")
            try:
                line = self.q.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
        try:
            return self.proc.wait(timeout=max(self.deadline - time.time(), 1.0))
        except subprocess.TimeoutExpired:
            self.fail("the run closed its output but did not exit before the deadline")

    def stop(self) -> None:
        """SIGTERM to the CLI (it shuts its Ray cluster down), then SIGKILL to its process group."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def test_a_held_pool_is_readmitted_once_its_pass_rate_rises(tmp_path, warm_model, model_cache):
    """tests/gated_verifier.py: the ``gated:arith`` pool (the arithmetic problems again) is all wrong
    until a file exists; the file is created after step 2, while the pool is held."""
    from prorl_async.data.arithmetic import generate

    gate = tmp_path / "gate"
    rows = generate(40, 7, "train")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            f.write(json.dumps({**r, "id": f"gated-{r['id']}", "domain": "gated:arith",
                                "meta": {"gate": str(gate)}}) + "\n")
    run_dir = tmp_path / "run"
    total = 12
    run = Run(["train", f"data.train={tmp_path / 'train.jsonl'}", *tiny(model_cache, run_dir),
               "reward.extra_modules=[tests.gated_verifier]", f"train.total_steps={total}",
               "train.prompts_per_step=4", "rollout.n=4", "rollout.prompts_per_request=4",
               "curriculum.preflight_prompts=4", "curriculum.window=4", "algo.max_refill_rounds=0"],
              cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, deadline_s=300)
    t0 = time.time()
    try:
        run.wait_for(r"^preflight: 1 of 2 pools active")
        run.wait_for(r"^step +2/")  # two steps with the pool held, then its problems become solvable
        gate.write_text("open")
        m = run.wait_for(r"^curriculum: gated:arith re-admitted at step (\d+): signal")
        readmitted = int(m[1])
        code = run.finish()
    finally:
        run.stop()
    print(f"\nCLI time, re-admission run of {total} steps: {time.time() - t0:.1f}s; re-admitted at step {readmitted}")
    assert code == 0, run.output()
    out = "\n".join(run.lines)
    assert "Traceback" not in out + "".join(run.err)
    pre = pool_table(out, "preflight")
    assert pre["arithmetic"][3] == "active" and pre["gated:arith"][3] == "held (too hard)", pre
    assert pre["gated:arith"][1] == 0.0
    assert 2 <= readmitted < total, readmitted
    end = pool_table(out, "curriculum at the end")
    assert end["gated:arith"][3] == "active" and end["gated:arith"][1] > 0, end

    history = read_jsonl(run_dir / "history.jsonl")
    assert [h["step"] for h in history] == list(range(1, total + 1))
    for h in history:
        held = h["step"] <= readmitted  # the metrics of step s are taken when its train step ends
        assert h["curriculum/active/gated:arith"] == (0 if held else 1), h
        assert h["curriculum/active_pools"] == (1 if held else 2)
    assert history[-1]["curriculum/pass_rate/gated:arith"] > 0

    summary = json.loads((run_dir / "summary.json").read_text())
    changes = summary["curriculum"]["gated:arith"]["changes"]
    assert [c[:2] for c in changes[:2]] == [[0, "held"], [readmitted, "active"]], changes
    # a later hold (hysteresis at half of min_signal, on a small window) may come and go between two
    # observations of one step, never for a step: seen once in CI, [5, held] then [5, active]
    assert changes[-1][1] == "active" and all(changes[i][0] == changes[i + 1][0] for i in range(2, len(changes), 2)), changes
    # trained on only once the gate was open: nothing of it in the first two steps, some of it after
    trained = read_jsonl(run_dir / "trained_groups.jsonl")
    gated = [k for k, step in enumerate(trained, 1) for key in step if key.split("/", 1)[1].startswith("gated-")]
    assert gated and min(gated) > 2, gated


# Out of the default lane: under the 2-worker CI of 2026-11-26 its step-3 pool averages differed between
# the straight and the resumed run (signal 0.734 vs 0.645). Step 3 is the resumed run's first grading of
# rg:* samples in fresh grader workers, which then paid Reasoning Gym's 2-3 s import inside the 10 s
# limit (a timeout under load scores the sample invalid); workers now warm it up untimed (test in
# tests/data/test_reasoning_gym.py), and this test asserts no grader timeout. Passed beside a training
# run after that change (405 s); back in the default lane once a 2-worker CI has passed it.
@pytest.mark.slow
def test_a_resumed_curriculum_run_continues_exactly(tmp_path, warm_model, model_cache):
    """Synchronous, so that a run is deterministic: 4 steps straight against 3 steps whose last one is
    lost (its checkpoint removed, as in a crash one step after the checkpoint of step 2) and a resume
    to 4. The same prompts per step from the same pools, the same pool averages and statuses."""
    from prorl_async import checkpoint

    mix = ('data.mix=[{source: "builtin:arithmetic?n=200&seed=1&split=train", weight: 1}, '
           f'{{source: "{RG}", weight: 1}}]')
    common = [mix, "data.mix_size=240", "train.prompts_per_step=4", "rollout.n=4", "rollout.prompts_per_request=4",
              "train.max_staleness=0", "algo.dynamic_sampling=false", "train.checkpoint_interval=2",
              "train.keep_last=3", "curriculum.window=4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, steps in ((straight, 4), (resumed, 3)):
        res = cli("train", *common, *tiny(model_cache, run_dir), f"train.total_steps={steps}", cwd=tmp_path,
                  timeout=400)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    root = resumed / "checkpoints"
    shutil.rmtree(root / checkpoint.step_name(3))
    checkpoint.atomic_write_text(root / "latest", checkpoint.step_name(2) + "\n")
    for f in ("summary.json", "trained_groups.jsonl"):
        (resumed / f).unlink()
    shutil.rmtree(resumed / "final")
    saved = json.loads((checkpoint.load_latest(resumed).path / "driver.json").read_text())["source"]
    assert saved["kind"] == "curriculum" and set(saved["pools"]) == {"arithmetic", RG_POOL}
    res = cli("train", "--resume", str(resumed), "train.total_steps=4", cwd=tmp_path, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "preflight:" not in res.stdout  # the pools come from the checkpoint, not a second preflight

    hs, hr = read_jsonl(straight / "history.jsonl"), read_jsonl(resumed / "history.jsonl")
    assert [h["step"] for h in hr] == [h["step"] for h in hs] == [1, 2, 3, 4]
    assert [h["grader/timeouts"] for h in hs + hr] == [0] * 8  # a timeout is load, not the resume
    for a, b in zip(hs, hr):
        cur = sorted(k for k in a if k.startswith("curriculum/"))
        assert cur and {k: b[k] for k in cur} == {k: a[k] for k in cur}, a["step"]
        assert b["actor/pg_loss"] == a["actor/pg_loss"] and b["reward/mean"] == a["reward/mean"], a["step"]
    prompts = lambda d: [[g.split("/", 1)[1] for g in step] for step in read_jsonl(d / "trained_groups.jsonl")]  # noqa: E731
    assert prompts(resumed) == prompts(straight)
    assert any(i.startswith("rg:") for step in prompts(straight) for i in step)  # probes of the held pool trained too
    ends = [json.loads((d / "summary.json").read_text())["curriculum"] for d in (straight, resumed)]
    assert ends[0] == ends[1]
