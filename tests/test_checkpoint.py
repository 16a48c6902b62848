"""Checkpoints and exact resume (prorl_async/checkpoint.py, the learner's state, the driver's barrier).

* pure parts: atomic save / prune / ``latest`` / stale temp dirs / clear errors, the resume
  config check, the replay buffer and TorchLearner state round trips;
* a process SIGKILLed at random points of a large save never leaves a partial checkpoint;
* stop-and-resume through the real CLI (subprocesses, their own local Ray):
  - synchronous (``max_staleness=0``): 6 steps straight vs 3 steps + ``--resume`` to 6 on a
    12-prompt train set with 8 prompts per step, so the checkpoint lies exactly on an epoch
    boundary (24 prompts = 2 epochs). Same prompts per step, same prompts drawn, every prompt
    once per epoch, no sample twice, per-step metrics and final weights *exactly* equal;
  - asynchronous (``max_staleness=1``): 2 steps + resume to 4 completes, trains the groups
    the checkpoint's buffer held, no sample twice (weights are not compared with a straight
    run: which generator request lands at which policy version depends on timing, so two
    straight async runs already differ);
  - bad ``--resume`` inputs: one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from prorl_async import checkpoint
from prorl_async.checkpoint import CheckpointError
from prorl_async.learners.files import read_learner
from tests.conftest import ROOT, cli, stopped_by


# ---------------------------------------------------------------------------- pure parts
def _run_dir(tmp_path: Path) -> Path:
    from prorl_async.config import load_config, save_config

    d = tmp_path / "run"
    d.mkdir()
    save_config(load_config(None, []), d / "config.yaml")
    return d


def _save(run_dir: Path, step: int, keep_last: int = 2, reason: str = "interval", interval: int = 0) -> Path:
    def write(tmp: Path) -> dict:
        (tmp / "config.yaml").write_text((run_dir / "config.yaml").read_text())
        (tmp / "payload.txt").write_text(f"step {step}\n")
        return {"version": step, "reason": reason}

    return checkpoint.save(run_dir, step, write, keep_last=keep_last, interval=interval)


def test_save_prune_latest(tmp_path):
    run_dir = _run_dir(tmp_path)
    for step in (2, 4, 6, 8):
        _save(run_dir, step, keep_last=2)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000006", "step-000008"]
    assert (root / "latest").read_text().strip() == "step-000008"
    ck = checkpoint.load_latest(run_dir)
    assert ck.step == 8 and ck.version == 8 and (ck.path / "payload.txt").read_text() == "step 8\n"
    assert set(ck.manifest["files"]) == {"config.yaml", "payload.txt"}


def test_timed_checkpoints_go_once_a_newer_one_exists(tmp_path):
    """A timed checkpoint is a safety net between interval ones: the next checkpoint of either kind
    supersedes it, so keep_last still keeps that many interval checkpoints for evaluation."""
    run_dir = _run_dir(tmp_path)
    root = run_dir / "checkpoints"
    names = lambda: sorted(p.name for p in root.iterdir() if p.name != "latest")  # noqa: E731
    _save(run_dir, 25, keep_last=3)
    _save(run_dir, 40, keep_last=3, reason="timed")
    assert names() == ["step-000025", "step-000040"]  # the newest, timed, stays
    _save(run_dir, 50, keep_last=3)
    assert names() == ["step-000025", "step-000050"]
    _save(run_dir, 60, keep_last=3, reason="timed")
    _save(run_dir, 70, keep_last=3, reason="timed")
    assert names() == ["step-000025", "step-000050", "step-000070"]
    _save(run_dir, 75, keep_last=3)
    _save(run_dir, 100, keep_last=3)
    assert names() == ["step-000050", "step-000075", "step-000100"]  # keep_last counts interval ones
    assert checkpoint.load_latest(run_dir).step == 100


def test_a_timed_checkpoint_at_an_interval_step_stays(tmp_path):
    """The timer fires while step 50 trains; the barrier lands step 50 and it is saved as "timed".
    With ``interval`` (train.checkpoint_interval) it stays like an interval checkpoint; a timed one
    between interval steps still goes."""
    run_dir = _run_dir(tmp_path)
    root = run_dir / "checkpoints"
    names = lambda: sorted(p.name for p in root.iterdir() if p.name != "latest")  # noqa: E731
    _save(run_dir, 25, keep_last=3, interval=25)
    _save(run_dir, 50, keep_last=3, reason="timed", interval=25)
    _save(run_dir, 63, keep_last=3, reason="timed", interval=25)
    _save(run_dir, 75, keep_last=3, interval=25)
    assert names() == ["step-000025", "step-000050", "step-000075"]
    assert json.loads((root / "step-000050" / "manifest.json").read_text())["reason"] == "timed"
    _save(run_dir, 100, keep_last=3, interval=25)
    assert names() == ["step-000050", "step-000075", "step-000100"]  # and keep_last counts it


def test_load_latest_ignores_temp_dirs_and_partial_dirs(tmp_path):
    run_dir = _run_dir(tmp_path)
    _save(run_dir, 2)
    root = run_dir / "checkpoints"
    dead = root / ".tmp-999999999-4-abcd"  # a save whose process is gone
    dead.mkdir()
    (dead / "payload.txt").write_text("half")
    (root / "step-000009").mkdir()  # a directory without a manifest is not a checkpoint
    assert checkpoint.load_latest(run_dir).step == 2
    (root / "latest").unlink()  # a missing pointer: the newest complete step directory
    assert checkpoint.load_latest(run_dir).step == 2
    (root / "step-000002" / "payload.txt").write_text("truncated")  # size differs from the manifest
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        checkpoint.load_latest(run_dir)
    _save(run_dir, 3)
    assert not dead.exists()  # the next save removes stale temp directories
    assert checkpoint.load_latest(run_dir).step == 3


def test_load_latest_errors(tmp_path):
    with pytest.raises(CheckpointError, match="is not a prorl-async run: no such directory"):
        checkpoint.load_latest(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="is not a prorl-async run: no config.yaml"):
        checkpoint.load_latest(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        checkpoint.load_latest(_run_dir(tmp_path))


def test_resume_config_allows_only_fields_that_keep_the_math(tmp_path):
    run_dir = _run_dir(tmp_path)
    _save(run_dir, 2)
    ck = checkpoint.load_latest(run_dir)
    cfg = checkpoint.resume_config(ck, run_dir, ["train.total_steps=500", "tracking.enabled=false",
                                                  "ray.num_cpus=3", "train.checkpoint_interval=7"])
    assert cfg.train.total_steps == 500 and cfg.run_dir == str(run_dir)
    with pytest.raises(CheckpointError) as e:
        checkpoint.resume_config(ck, run_dir, ["train.lr=1e-3", "rollout.n=2", "train.total_steps=500"])
    msg = str(e.value)
    assert "rollout.n" in msg and "train.lr" in msg and "train.total_steps," not in msg.split("may change")[0]


def _groups_table(groups: int, seed: int, request: str):
    from tests.learners._batches import graded_table

    t = graded_table(groups=groups, n=4, seed=seed)
    import pyarrow as pa

    ids = pa.array([request] * t.num_rows)
    return t.set_column(t.schema.get_field_index("request_id"), "request_id", ids)


def test_replay_buffer_state_round_trip_through_parquet(tmp_path):
    import pyarrow.parquet as pq

    from prorl_async.buffer import ReplayBuffer

    a = ReplayBuffer(max_staleness=1)
    for i, seed in enumerate((1, 2, 3)):
        for batch in _groups_table(4, seed, f"r{i}").to_batches():
            a.put(batch)
    a.take(0, 2)
    state = a.state_dict()
    pq.write_table(state["table"], tmp_path / "buffer.parquet")
    b = ReplayBuffer(max_staleness=1)
    b.load_state_dict({"table": pq.read_table(tmp_path / "buffer.parquet"), "counters": state["counters"]})
    assert len(b) == len(a) and b.metrics() == a.metrics()
    while len(a):
        ta, tb = a.take(0, 1).table, b.take(0, 1).table
        assert ta.column("sample_id").to_pylist() == tb.column("sample_id").to_pylist()


def test_torch_learner_state_dict_resumes_exactly(tmp_path, tiny_model):
    """Two steps on one learner == one step, save, load into a fresh learner, one more step."""
    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.torch_learner import TorchLearner
    from tests.learners._batches import graded_table

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4",
                             "train.micro_batch_size=8", "train.mini_batches=2", "train.lr=1e-3",
                             "algo.kl_coef=0.01", "algo.ref_reset_interval=1", "algo.ref_reset_optimizer=false",
                             "algo.length_penalty=true", "algo.length_on_steps=1", "algo.length_off_steps=1"])
    t1, t2 = graded_table(groups=4, n=4, seed=1), graded_table(groups=4, n=4, seed=2)
    straight = TorchLearner(cfg, tiny_model)
    straight.train_step(t1)
    straight.save_checkpoint(tmp_path, tokenizer_path=tiny_model)
    resumed = TorchLearner(cfg, tiny_model)
    resumed.load_state_dict(read_learner(tmp_path))
    m_straight, m_resumed = straight.train_step(t2), resumed.train_step(t2)
    for k, v in m_straight.items():
        if not k.startswith("perf/"):
            assert m_resumed[k] == v, k
    for (n, p), (_, q) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip(straight.ref.state_dict().items(), resumed.ref.state_dict().items()):
        assert torch.equal(p, q), n
    assert resumed.version == 2 and resumed.ref_policy.state_dict() == straight.ref_policy.state_dict()
    assert (tmp_path / "policy" / "tokenizer.json").is_file()  # generators can start from it


# ---------------------------------------------------------------------------- killed mid-save
_WRITER = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path
    from prorl_async import checkpoint

    run_dir, step, mb, pause_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    chunk = bytes([step % 251]) * (1 << 20)
    written = 0

    def write(tmp):
        global written
        (tmp / "config.yaml").write_text("x: 1\\n")
        for i in range(8):  # mb MiB in 8 files, written in 1 MiB chunks
            with open(tmp / f"shard-{i}.bin", "wb") as f:
                for _ in range(mb // 8):
                    if written == pause_at:  # a kill point the test chose: say so, and wait for the kill
                        f.flush()
                        print("paused", flush=True)
                        time.sleep(600)
                    f.write(chunk)
                    written += 1
        return {"version": step}

    checkpoint.save(run_dir, step, write, keep_last=2)
    print("saved", step, flush=True)
""")


def _intact(ck: checkpoint.Checkpoint, mb: int) -> bool:
    want = bytes([ck.step % 251]) * (1 << 20)
    for i in range(8):
        data = (ck.path / f"shard-{i}.bin").read_bytes()
        if len(data) != (mb // 8) * (1 << 20) or data != want * (mb // 8):
            return False
    return True


def test_checkpoint_due_by_steps_and_by_seconds(tmp_path):
    """``train.checkpoint_interval`` counts steps; ``train.checkpoint_every_s`` the seconds since the
    newest checkpoint (a machine killed without a SIGTERM, as a session's end here, loses at most that:
    an eighth run lost its first 11 minutes, preflight and 6 steps, before its step-25 checkpoint). Neither writes
    a step twice, nor the last step (the end's checkpoint), nor anything without a run dir."""
    from types import SimpleNamespace

    from actors.driver import TrainingLoop
    from actors.loop_state import LoopState
    from prorl_async.config import load_config

    def due(version, overrides, checkpointed=-1, since_s=0.0, run_dir=tmp_path):
        cfg = load_config(None, ["train.total_steps=100", *overrides])
        s = LoopState(version=version, checkpointed=checkpointed, checkpoint_t=time.time() - since_s)
        return TrainingLoop.checkpoint_due(SimpleNamespace(s=s, cfg=cfg, run_dir=run_dir))

    assert due(25, ["train.checkpoint_interval=25"]) == "interval" and not due(26, ["train.checkpoint_interval=25"])
    assert not due(25, ["train.checkpoint_interval=25"], checkpointed=25)
    assert not due(7, []) and not due(7, [], since_s=1e6)  # both off: only the end's checkpoint
    by_time = ["train.checkpoint_every_s=600"]
    assert due(7, by_time, since_s=601) == "timed" and not due(7, by_time, since_s=599)
    assert not due(7, by_time, checkpointed=7, since_s=601)  # this step is written already
    assert not due(100, by_time, since_s=601) and not due(0, by_time, since_s=601)  # the end's, or nothing trained
    assert not due(7, by_time, since_s=601, run_dir=None)
    both = ["train.checkpoint_interval=25", "train.checkpoint_every_s=600"]
    assert due(25, both) == "interval" and due(13, both, since_s=700) == "timed" and not due(13, both, since_s=10)


def test_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    run_dir, mb = tmp_path / "run", 64
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("x: 1\n")
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def writer(step: int, pause_at: int = -1) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(run_dir), str(step), str(mb), str(pause_at)],
                                env=env, stdout=subprocess.PIPE, text=True)

    t0 = time.time()
    assert writer(1).wait(timeout=120) == 0
    full = time.time() - t0  # one complete save, process start included
    rng = random.Random(6)
    committed = 1
    # Steps 2-7 are killed at a chunk the test picks (the writer stops there and says so): always
    # mid-write, whatever the machine's speed. Steps 8-10 are killed after a random time, which may
    # land in process start, the write, the commit (rename, `latest`) or after it finished.
    for step in range(2, 11):
        if step <= 7:
            p = writer(step, pause_at=rng.randrange(mb))
            assert p.stdout.readline().strip() == "paused"
        else:
            p = writer(step)
            time.sleep(rng.uniform(0.05, 1.1) * full)
        p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=60)
        assert rc in (0, -signal.SIGKILL) and (step > 7 or rc == -signal.SIGKILL), (step, rc)
        ck = checkpoint.load_latest(run_dir)
        if rc == 0:
            committed = step
        # the newest complete checkpoint: the previous one, or this one if `latest` was already written
        assert ck.step in (committed, step), (ck.step, committed, step)
        if step <= 7:  # killed mid-write: the previous checkpoint stays the latest
            assert ck.step == committed, (ck.step, committed, step)
        assert _intact(ck, mb), f"checkpoint {ck.path} is partial"
        committed = ck.step
    assert writer(20).wait(timeout=120) == 0
    ck = checkpoint.load_latest(run_dir)
    assert ck.step == 20 and _intact(ck, mb)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [n for n in names if n.startswith(".tmp-")], names  # the killed writers' temp dirs are gone
    assert names[-1] == "step-000020" and "latest" in names and len([n for n in names if n.startswith("step-")]) <= 2


# ---------------------------------------------------------------------------- bad resume inputs (real CLI)
def test_bad_resume_inputs_give_one_error_line_and_exit_2(tmp_path):
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    no_ckpt = _run_dir(tmp_path)
    with_ckpt = tmp_path / "ok"
    with_ckpt.mkdir()
    (with_ckpt / "config.yaml").write_text((no_ckpt / "config.yaml").read_text())
    _save(with_ckpt, 2)
    cases = [
        ([str(not_a_run)], "is not a prorl-async run: no config.yaml"),
        ([str(tmp_path / "missing")], "is not a prorl-async run: no such directory"),
        ([str(no_ckpt)], "no checkpoint in"),
        ([str(with_ckpt), "algo.clip_eps_high=0.3", "train.total_steps=999"], "cannot resume"),
        ([str(with_ckpt), "train.total_steps=2"], "is at step 2 already"),
    ]
    for args, expected in cases:
        res = cli("train", "--resume", *args, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (args, res.stderr)
    res = cli("train", "--resume", str(with_ckpt), "algo.clip_eps_high=0.3", cwd=tmp_path)
    assert "algo.clip_eps_high" in res.stderr


# ---------------------------------------------------------------------------- stop and resume (real CLI)
BASE = ["train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4", "train.eval_interval=0",
        "train.eval_samples=1", "model.warmup_steps=200", "data.eval=builtin:arithmetic?n=4&seed=2&split=eval",
        "train.micro_batch_size=32", "ray.num_cpus=2", "train.keep_last=3"]
# 12 prompts, 8 per step, every group trained (no dynamic sampling): 3 steps = 24 prompts = 2 epochs;
# an evaluation at step 3, the step of the checkpoint the killed run resumes from
SYNC = BASE + ["train.max_staleness=0", "algo.dynamic_sampling=false", "train.checkpoint_interval=3",
               "train.eval_interval=3", "data.train=builtin:arithmetic?n=12&seed=1&split=train"]
ASYNC = BASE + ["train.max_staleness=1", "train.checkpoint_interval=2", "rollout.num_generators=2",
                "rollout.generator_num_cpus=0.5", "train.learner_num_cpus=0.5"]


def _launch(args: list[str], run_dir: Path, tmp: Path, model_cache: str):
    """The real CLI in a process of its own (forked with its modules imported, tests/_cli_fork.py);
    returns (process, log path)."""
    from tests import _cli_fork

    extra = [] if "--resume" in args else [f"run_dir={run_dir}", f"model.cache_dir={model_cache}",
                                           f"tracking.aim_repo={tmp / ('aim-' + run_dir.name)}"]  # not shared: concurrent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp / f"{run_dir.name}-{'resume' if '--resume' in args else 'first'}.log"
    # its own process group: the run and the Ray cluster it starts (killpg)
    return _cli_fork.start(["train", *args, *extra], str(tmp), env, str(log), new_session=True), log


def _wait(procs: dict, expect: dict | None = None) -> None:
    for name, (p, log) in procs.items():
        rc = p.wait(timeout=600)
        assert rc == (expect or {}).get(name, 0), f"{name} failed ({rc}): {log.read_text()[-4000:]}"


def _started(proc, log: Path, run_dir: Path, deadline_s: float = 300) -> None:
    """Wait until the run's Ray cluster is up and its actors started (their log files exist): the
    runs start their clusters one after another, as a machine starting three at once can miss Ray's
    start-up window (actors.cluster.start_local_ray)."""
    end = time.time() + deadline_s
    while not (run_dir / "logs" / "learner.log").exists():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) at its start: {log.read_text()[-3000:]}"
        assert time.time() < end, f"its actors did not start in {deadline_s:.0f}s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def _signal_on(proc, log: Path, pattern: str, sig: signal.Signals, errors: list, deadline_s: float = 600) -> None:
    """``sig`` as soon as the run's console has a line matching ``pattern`` (a watcher thread per run,
    so a run is signalled while the others still start), to its whole process group: SIGKILL there is
    a crash (the CLI dies, and the Ray cluster it started dies with it: actors.cluster.
    ray_processes_in_own_sessions); SIGTERM there is a stop as ``timeout``, ``kill -TERM -PGID`` or
    a shell's ``kill %1`` sends it, which must reach the CLI alone: the actors, outside the group,
    land the step in flight and the checkpoint (before, the learner died of it)."""
    line = re.compile(pattern, re.M)
    end = time.time() + deadline_s
    while not line.search(log.read_text(errors="replace")):
        if proc.poll() is not None or time.time() > end:
            errors.append(f"{log.name}: no line {pattern!r} before the run ended ({proc.returncode}) or "
                          f"{deadline_s:.0f}s passed: {log.read_text()[-3000:]}")
            return
        time.sleep(0.05)
    os.killpg(proc.pid, sig)


def _signal_on_file(proc, path: Path, errors: list, deadline_s: float = 300) -> None:
    """SIGTERM to the CLI as soon as ``path`` (an actor's log, which its process writes first) exists."""
    end = time.time() + deadline_s
    while not path.exists():
        if proc.poll() is not None or time.time() > end:
            errors.append(f"no {path} before the run ended ({proc.returncode}) or {deadline_s:.0f}s passed")
            return
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_cache):
    """Phase 1, concurrently: sync 6 steps straight; sync 6 steps killed with SIGKILL (its process
    group) right after its checkpoint at step 3; async 4 steps stopped with SIGTERM once step 1 is
    done (the steps in flight land, a checkpoint at the step reached, exit 143). Phase 2: both
    resume from their newest checkpoint, as `--resume` finds it."""
    import pyarrow.parquet as pq

    from prorl_async.config import ModelConfig
    from prorl_async.models import build_tiny_arith

    tmp = tmp_path_factory.mktemp("resume")
    build_tiny_arith(ModelConfig(cache_dir=model_cache, warmup_steps=200), log=lambda *_: None)  # once, not 3x
    d = {k: tmp / k for k in ("sync_straight", "sync_resumed", "async_resumed")}
    procs, watchers, errors = {}, [], []
    # the crash lands after the step-3 checkpoint, 3 steps before the run's end; the stop after step
    # 1 of 4 (each window is seconds: the watchers poll every 50 ms)
    signals = {"sync_resumed": (r"^checkpoint \S+step-000003 ", signal.SIGKILL),
               "async_resumed": (r"^step\s+1/4 ", signal.SIGTERM)}
    try:
        for name, args in (("sync_straight", SYNC + ["train.total_steps=6"]),
                           ("sync_resumed", SYNC + ["train.total_steps=6"]),
                           ("async_resumed", ASYNC + ["train.total_steps=4"])):
            procs[name] = _launch(args, d[name], tmp, model_cache)
            if name in signals:
                watchers.append(threading.Thread(target=_signal_on, args=(*procs[name], *signals[name], errors),
                                                 daemon=True))
                watchers[-1].start()
            _started(*procs[name], d[name])
        for w in watchers:
            w.join(timeout=600)
        assert not errors, errors
        _wait(procs, expect={"sync_resumed": -signal.SIGKILL, "async_resumed": 128 + signal.SIGTERM})
    finally:  # a failed wait leaves no run behind (each run is its own process group)
        for p, _ in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    stopped_log = procs["async_resumed"][1].read_text()
    # the checkpoints the resumes start from, as they were
    first = {k: json.loads((checkpoint.load_latest(d[k]).path / "driver.json").read_text())
             for k in ("sync_resumed", "async_resumed")}
    manifests = {k: checkpoint.load_latest(d[k]).manifest for k in first}
    first_history = {k: _history(checkpoint.load_latest(d[k]).path) for k in first}
    buffered = pq.read_table(checkpoint.load_latest(d["async_resumed"]).path / "buffer.parquet")
    buffered = {f"{r['request_id']}/{r['prompt_id']}" for r in buffered.select(["request_id", "prompt_id"]).to_pylist()}
    killed_outputs = [f for f in ("summary.json", "trained_groups.jsonl", "final") if (d["sync_resumed"] / f).exists()]
    _wait({name: _launch(["--resume", str(d[name])], d[name], tmp, model_cache) for name in ("sync_resumed", "async_resumed")})
    return {"dirs": d, "first": first, "manifests": manifests, "first_history": first_history, "async_buffered": buffered,
            "stopped_log": stopped_log, "killed_outputs": killed_outputs}


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line]


def _groups(run_dir: Path) -> list[list[str]]:
    return [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines() if line]


TIMING = ("perf/", "time/", "val/time", "sys/rss_mb/", "grader/rss_mb", "async/learner_idle_frac", "async/generator_idle_frac", "async/grader_idle_frac",
          "async/gen_overlap", "grader/queue_wait", "grader/grade_", "grader/responses_per_s")


def test_sync_resume_is_exact_across_an_epoch_boundary(runs):
    import torch
    from safetensors.torch import load_file

    straight, resumed = runs["dirs"]["sync_straight"], runs["dirs"]["sync_resumed"]
    first = runs["first"]["sync_resumed"]
    # killed after its step-3 checkpoint: that is the newest, exactly at the end of epoch 1 (24 of 12
    # prompts drawn), and the run wrote none of its end-of-run outputs
    assert first["version"] == 3 and first["source"] == {"epoch": 1, "pos": 12, "consumed": 24, "seed": 0,
                                                       "order": "seed-epoch"}
    assert runs["killed_outputs"] == []
    # the step-3 evaluation ran before its checkpoint, which holds it: a resume does not lose it
    assert first["last_eval"] == 3
    assert [("val/pass@1" in h) for h in runs["first_history"]["sync_resumed"]] == [False, False, True]
    # same steps, same prompts per step, same per-step metrics (timings aside), bit for bit
    hs, hr = _history(straight), _history(resumed)
    assert [h["step"] for h in hr] == [h["step"] for h in hs] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(hs, hr):
        keys = [k for k in a if k != "time" and not (k.startswith(TIMING) or k.removeprefix("val/").startswith(TIMING))]
        assert {k: b.get(k) for k in keys} == {k: a[k] for k in keys}, a["step"]
    gs, gr = _groups(straight), _groups(resumed)
    prompts = lambda groups: [[g.split("/", 1)[1] for g in step] for step in groups]  # noqa: E731
    assert prompts(gr) == prompts(gs) and [len(s) for s in gr] == [8] * 6
    # no sample twice: every (request, prompt) group once; every prompt exactly once per epoch
    flat = [g for step in gr for g in step]
    assert len(set(flat)) == len(flat) == 48
    ids = [g.split("/", 1)[1] for g in flat]
    assert all(len(set(ids[e * 12:(e + 1) * 12])) == 12 for e in range(4))
    ss, sr = (json.loads((d / "summary.json").read_text()) for d in (straight, resumed))
    assert sr["steps"] == ss["steps"] == 6 and sr["prompts_consumed"] == ss["prompts_consumed"] == 48
    assert sr["aim_run_hash"] == first["aim_run_hash"]  # the same Aim run continued
    wa, wb = load_file(str(straight / "final" / "model.safetensors")), load_file(str(resumed / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # tolerance: 0 (exact)
    assert checkpoint.load_latest(resumed).step == 6


def test_async_resume_completes_and_trains_no_sample_twice(runs):
    resumed = runs["dirs"]["async_resumed"]
    first, manifest = runs["first"]["async_resumed"], runs["manifests"]["async_resumed"]
    # SIGTERM after step 1: what was in flight landed (a train step in flight finished), the
    # checkpoint holds the step reached, and the CLI said how to continue
    v = first["version"]
    assert 1 <= v < 4 and manifest["reason"] in ("signal", "interval"), manifest  # interval: step 2 had one
    log = runs["stopped_log"]
    assert "SIGTERM: nothing new starts" in log and f"stopped by SIGTERM at step {v}, with a checkpoint" in log
    assert f"prorl-async train --resume {resumed}" in log
    h = _history(resumed)
    assert [x["step"] for x in h] == [1, 2, 3, 4]
    assert all(x["async/trained_staleness_max"] <= 1 for x in h)
    groups = _groups(resumed)
    flat = [g for step in groups for g in step]
    assert [len(s) for s in groups] == [8] * 4 and len(set(flat)) == len(flat)
    # what the checkpoint's buffer held was trained after the resume, not lost
    assert runs["async_buffered"] <= set(g for step in groups[v:] for g in step)
    assert first["consumed"] == 8 * v and first["live"] == first["buffered"] == len(runs["async_buffered"])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["prompts_consumed"] >= first["source"]["consumed"]


def test_deepspeed_learner_state_resumes_exactly(tmp_path, tiny_model, ds_ext):
    """DeepSpeed keeps its own (ZeRO-partitioned) checkpoint; one rank: save, load, step == step."""
    pytest.importorskip("deepspeed")
    import torch

    from prorl_async.config import load_config
    from prorl_async.learners.deepspeed import DeepSpeedLearner
    from tests.learners._batches import graded_table

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4",
                             "train.micro_batch_size=8", "train.lr=1e-3", "algo.kl_coef=0.01",
                             "model.autocast_bf16=false", "train.learner=deepspeed", "train.zero_stage=2"])
    t1, t2 = graded_table(groups=4, n=4, seed=1), graded_table(groups=4, n=4, seed=2)
    straight = DeepSpeedLearner(cfg, tiny_model)
    straight.train_step(t1)
    straight.save_checkpoint(tmp_path, tokenizer_path=tiny_model)
    resumed = DeepSpeedLearner(cfg, tiny_model)
    resumed.load_state(tmp_path)
    assert resumed.version == 1
    m_straight, m_resumed = straight.train_step(t2), resumed.train_step(t2)
    for k, v in m_straight.items():
        if not k.startswith("perf/"):
            assert m_resumed[k] == v, k
    for (n, p), (_, q) in zip(straight.named_tensors(), resumed.named_tensors()):
        assert torch.equal(p, q), n
    assert (tmp_path / "policy" / "model.safetensors").is_file()


@pytest.mark.parametrize("when", ["logs/learner.log", r"held-out evaluation, step 0"], ids=["actors-starting", "step-0-eval"])
def test_sigterm_before_step_one_stops_at_once_and_shuts_its_ray_down(tmp_path, model_cache, when):
    """SIGTERM outside the training loop (while the actors start, the driver blocked in a ray.get,
    or during the step-0 evaluation) stops the run at once with one line and exit status 143, its
    actors and Ray shut down. Without a handler the signal's default action killed the driver
    (status -15) and left the Ray cluster it started; inside a blocking ray.get the handler's
    exception came back from Ray's C code as a SystemError and the CLI printed a traceback."""
    args = BASE + ["train.total_steps=2", "train.eval_samples=16", "data.eval=builtin:arithmetic?n=200&seed=2&split=eval"]
    p, log = _launch(args, tmp_path / "stopped", tmp_path, model_cache)
    errors: list = []
    try:
        if when.startswith("logs/"):  # the learner's process has started: the driver waits for the actors
            send = lambda: _signal_on_file(p, tmp_path / "stopped" / when, errors)  # noqa: E731
        else:
            send = lambda: _signal_on(p, log, when, signal.SIGTERM, errors)  # noqa: E731
        rc, cluster, left = stopped_by(p, send)
        assert not errors, errors
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM outside the training loop (before step 1" in out, out[-3000:]
    assert "Traceback" not in out and not re.search(r"^step\s+1/", out, re.M), out[-3000:]
    assert any("raylet" in " ".join(cmd) for cmd in cluster.values()), list(cluster.values())  # the check saw Ray
    assert left == [], f"processes of the stopped run still alive: {left}"

