"""A verl parquet trains and builtin:humaneval evaluates through the real CLI, with no conversion step."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from prorl_async.data.arithmetic import generate
from tests.conftest import cli


def test_train_on_a_verl_parquet_and_evaluate_on_humaneval(tmp_path, model_cache):
    records = [{"data_source": "tiny/arith", "prompt": [{"role": "user", "content": r["prompt"]}],
                "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                "extra_info": {"index": k, "split": "train"}}
               for k, r in enumerate(generate(64, 1, "train"))]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    run_dir = tmp_path / "run"
    res = cli("train", "train.total_steps=2", "train.prompts_per_step=8", "rollout.n=4",
              "rollout.prompts_per_request=4", "train.eval_interval=0", "train.eval_samples=2",
              "model.warmup_steps=200", "train.micro_batch_size=32", "ray.num_cpus=2",
              f"data.train={tmp_path / 'train.parquet'}", "data.eval=builtin:humaneval?n=4", "data.strict=true",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}",
              cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    # the held-out set was the HumanEval problems, graded by the code verifier
    assert {"val/pass@1/code", "val/pass@2/code"} <= set(summary["before"]) and summary["after"]["val/pass@1/code"] >= 0
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    # every verl row reached the grader as a valid arithmetic row (none invalid, none skipped)
    assert [h["step"] for h in history] == [1, 2] and all(h["reward/invalid"] == 0.0 for h in history)
    assert "skipped" not in res.stderr


def test_key_mapped_jsonl_trains_through_the_cli(tmp_path, model_cache):
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in generate(64, 1, "train"):
            f.write(json.dumps({"question": r["prompt"], "label": r["answer"]}) + "\n")
    run_dir = tmp_path / "run"
    res = cli("train", "train.total_steps=1", "train.prompts_per_step=8", "rollout.n=4",
              "rollout.prompts_per_request=4", "train.eval_interval=0", "train.eval_samples=1",
              "model.warmup_steps=200", "train.micro_batch_size=32", "ray.num_cpus=2",
              f"data.train={tmp_path / 'train.jsonl'}", "data.input_key=question", "data.label_key=label",
              "data.domain=arithmetic", "data.eval=builtin:arithmetic?n=8&seed=2&split=eval",
              f"run_dir={run_dir}", f"tracking.aim_repo={tmp_path / 'aim'}", f"model.cache_dir={model_cache}",
              cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
