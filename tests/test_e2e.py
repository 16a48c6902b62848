"""End-to-end runs through the real CLI (subprocess, its own local Ray) and the real actors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli

SMALL = ["train.total_steps=4", "train.prompts_per_step=8", "rollout.n=4", "rollout.prompts_per_request=4",
         "train.eval_interval=2", "train.eval_samples=2", "model.warmup_steps=200",
         "data.eval=builtin:arithmetic?n=16&seed=2&split=eval", "train.micro_batch_size=32",
         "ray.num_cpus=2",
         # a 200-step warm-up is right on a few groups in a hundred of the mixed tasks: no refill bound here
         # (tests/test_e2e_recipe.py tests the bound itself)
         "algo.max_refill_rounds=0"]


MIX = ('data.mix=[{source: "builtin:arithmetic?n=200&seed=1&split=train", weight: 0.5}, '
       '{source: "builtin:multidomain?n=100&seed=1&split=train", weight: 0.5}]')


def _aim_metrics(repo: Path, run_hash: str) -> dict:
    """{(name, context as sorted items): values} of a closed Aim run, read back through the SDK."""
    from aim import Repo

    from prorl_async.compare import refresh_index

    refresh_index(Repo(str(repo)), [run_hash])  # closed runs are seen only once indexed
    run = Repo(str(repo)).get_run(run_hash)
    return {(m.name, tuple(sorted(m.context.to_dict().items()))): list(m.values.values_list()) for m in run.metrics()}


@pytest.mark.parametrize("staleness", [0, 1])
def test_cli_run_both_modes(tmp_path, model_cache, staleness):
    """Both modes through the real CLI; the async one also trains on a five-domain mix."""
    run_dir = tmp_path / "run"
    extra = [MIX, "rollout.max_new_tokens=12"] if staleness else []
    res = cli("train", *SMALL, *extra, f"train.max_staleness={staleness}", f"run_dir={run_dir}",
              f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        assert math.isfinite(h["actor/pg_loss"]) and math.isfinite(h["actor/grad_norm"])
        # no sample trained on is staler than the bound
        assert h["async/trained_staleness_max"] <= staleness
    assert summary["max_trained_staleness"] <= staleness
    assert "step    4/4" in res.stdout and "held-out metric" in res.stdout
    # the mid-run evaluation (eval_interval=2) on the console, with the value the history holds
    line = next(x for x in res.stdout.splitlines() if x.startswith("held-out at step 2: "))
    assert f"pass@1 {history[1]['val/pass@1']:.3f}" in line and "pass@2 " in line
    assert (run_dir / "config.yaml").is_file() and (run_dir / "final" / "config.json").is_file()
    # the Aim run can be read back
    metrics = _aim_metrics(tmp_path / "aim", summary["aim_run_hash"])
    # rollout means of the samples graded during each step: every step of the synchronous run; in the
    # asynchronous run a batch is graded during an earlier step than the one that trains it, and nothing
    # is generated that no step trains, so a step (the last, at least) may grade nothing: no reward mean
    graded = [h["step"] for h in history if h["grader/responses"] > 0]
    assert graded == [1, 2, 3, 4] if not staleness else (graded[0] == 1 and len(graded) >= 2)
    values = metrics[("reward/mean", ())]
    assert len(values) == len(graded) and all(math.isfinite(v) for v in values)
    assert ("val/pass@1", (("split", "eval"),)) in metrics
    # grader health at every step: responses graded since the last step, and the failure counters
    assert all(h["grader/timeouts"] == 0 for h in history)
    # every actor's resident memory at every step (a generator's once it has answered a weight update)
    roles = ["sys/rss_mb/driver", "sys/rss_mb/learner", "sys/rss_mb/buffer", "grader/rss_mb"]
    assert all(50 < h[k] < 20_000 for h in history for k in roles)
    gen_rss = [h["sys/rss_mb/generator0"] for h in history if "sys/rss_mb/generator0" in h]
    assert gen_rss and all(50 < v < 20_000 for v in gen_rss)
    for name in ("grader/responses", "grader/timeouts", "grader/errors", "grader/restarts", "grader/queue_wait_s"):
        assert len(metrics[(name, ())]) == 4, name
    domains = {dict(ctx).get("domain") for name, ctx in metrics if name == "reward/accuracy"} - {None}
    if staleness:  # per-domain reward and accuracy of the mix, under Aim's `domain` context
        assert {"arithmetic", "code", "math"} <= domains or len(domains) >= 4, domains
    else:
        assert domains == {"arithmetic"}


def test_grader_failures_mark_samples_invalid_and_run_continues(tmp_path, model_cache):
    """A crash, a NaN reward and a hang (tests/fault_verifiers.py) on one prompt each: every
    failure is counted under its reason, the run goes on, and the valid samples are graded and
    trained (a hang costs about one time limit per batch, not one per sample: GraderPool)."""
    from prorl_async.data import arithmetic
    from tests.fault_verifiers import fault_of

    pool = arithmetic.generate(400, seed=5, split="train")
    rows = []
    for fault in ("error", "non_finite", "timeout"):  # one prompt each; eleven that grade normally
        rows += [r for r in pool if fault_of(r) == fault][:1]
    rows += [r for r in pool if fault_of(r) == "ok"][:11]
    with open(tmp_path / "flaky.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "domain": "flaky"}) + "\n")
    run_dir = tmp_path / "run"
    res = cli("train", *SMALL, "train.eval_interval=0", f"data.train={tmp_path / 'flaky.jsonl'}",
              "reward.extra_modules=[tests.fault_verifiers]", "reward.timeout_s=0.5", "reward.max_invalid_frac=0.9",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}",
              cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert len(history) == 4
    last = history[-1]
    assert last["reward/invalid_samples"] > 0  # counted, not scored 0
    # each failure kind is counted under its reason: a crash, a NaN reward, a hang killed at the limit
    assert last["reward/invalid_error"] > 0 and last["reward/invalid_non_finite"] > 0 and last["reward/invalid_timeout"] > 0
    # the good thing: every step trained on graded, valid samples only, and some were right
    for h in history:
        assert h["actor/updates"] >= 1 and h["perf/train_valid_tokens"] > 0
        assert h["sampling/groups_kept"] > 0 and h["reward/invalid_frac"] == 0.0
        assert math.isfinite(h["actor/pg_loss"]) and math.isfinite(h["reward/raw_mean"])
    assert any(h["reward/raw_mean"] > 0 for h in history)  # graded correct answers reached the learner


def test_weights_identical_after_sync(ray_cluster, tiny_model):
    import ray

    from actors.cluster import Actors
    from prorl_async.config import load_config
    from prorl_async.data import arithmetic

    cfg = load_config(None, ["rollout.num_generators=2", "train.prompts_per_step=4", "rollout.n=4",
                             "train.micro_batch_size=16", "rollout.generator_num_cpus=0.5",
                             "train.learner_num_cpus=0.5"])
    actors = Actors.start(cfg, tiny_model)
    try:
        v0 = ray.get(actors.learner.weights_checksum.remote())
        assert all(ray.get(g.weights_checksum.remote()) == v0 for g in actors.generators)
        rows = arithmetic.generate(4, seed=3, split="train")
        batch = ray.get(actors.grader.grade.remote(rows, actors.generators[0].generate.remote(rows, 4, 0)))
        import pyarrow as pa
        metrics = ray.get(actors.learner.train_step.remote(pa.Table.from_batches([batch]), 0))
        assert math.isfinite(metrics["actor/pg_loss"])
        v1 = ray.get(actors.learner.weights_checksum.remote())
        assert v1[0] == 1 and v1[1] != v0[1]  # the update changed the weights
        ray.get([actors.learner.broadcast_weights.remote()] + [g.receive_weights.remote() for g in actors.generators])
        for g in actors.generators:
            assert ray.get(g.weights_checksum.remote()) == v1
    finally:
        for a in actors.all():
            ray.kill(a)


@pytest.mark.slow  # a CLI run of its own; kept out of the default suite for CI time (README: the slow tests)
def test_prompts_past_the_context_are_dropped_at_load_and_counted(tmp_path, model_cache):
    """Rows whose prompt + rollout.max_new_tokens exceed the model's context (tiny-arith: 2048) are
    dropped with one warning naming them, counted in the summary; the run trains on the rest."""
    from prorl_async.data.arithmetic import generate

    rows = [{"id": f"a{k}", "domain": "arithmetic", "prompt": r["prompt"], "answer": r["answer"]}
            for k, r in enumerate(generate(32, 1, "train"))]
    long = [{"id": f"long{k}", "domain": "arithmetic", "prompt": "1+" * 1100 + "1=", "answer": "1101"} for k in range(2)]
    for name, part in (("train", rows[:10] + long[:1] + rows[10:] + long[1:]), ("eval", rows[:4] + long[:1])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    run_dir = tmp_path / "run"
    res = cli("train", "train.total_steps=1", "train.prompts_per_step=8", "rollout.n=2", "rollout.prompts_per_request=4",
              "train.eval_interval=0", "train.eval_samples=1", "model.warmup_steps=200", "train.micro_batch_size=16",
              "ray.num_cpus=2", "rollout.max_new_tokens=8", "algo.max_refill_rounds=0", "algo.dynamic_sampling=false",
              f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}",
              cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["prompts_dropped"] == {"data.train": 2, "data.eval": 1}
    assert "data.train: dropped 2 of 34 row(s) whose prompt does not fit the model: long0: prompt of" in res.stderr
    assert "data.eval: dropped 1 of 5 row(s)" in res.stderr
