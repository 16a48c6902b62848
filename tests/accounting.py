"""Where every drawn prompt went, read back from a checkpoint: trained (``trained_groups`` in
``driver.json``), waiting in the buffer (``buffer.parquet``) or waiting to be re-issued
(``retry``). With dynamic sampling off and a verifier that grades every sample, a run that
loses nothing and repeats nothing has ``trained + waiting == drawn`` as multisets.
Used by the fault tests and benchmarks/chaos.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def drawn_prompts(cfg, source_state: dict) -> Counter:
    """The prompt ids a run's PromptSource handed out up to ``source_state`` (same seed, same order)."""
    from prorl_async.data.datasets import load_train_rows
    from prorl_async.data.source import PromptSource

    src = PromptSource(load_train_rows(cfg.data), seed=source_state["seed"])
    src.load_state_dict({**source_state, "epoch": 0, "pos": 0, "consumed": 0})  # its shuffle ("order") too
    return Counter(str(r["id"]) for r in src.next(source_state["consumed"]))


def checkpoint_accounting(cfg, ckpt_dir) -> dict:
    """{drawn, trained, buffered, retry} prompt-id Counters of one checkpoint directory."""
    import pyarrow.parquet as pq

    ckpt_dir = Path(ckpt_dir)
    d = json.loads((ckpt_dir / "driver.json").read_text())
    trained = Counter(g.split("/", 1)[1] for step in d["trained_groups"] for g in step)
    t = pq.read_table(ckpt_dir / "buffer.parquet", columns=["request_id", "prompt_id"]).to_pydict()
    buffered = Counter(pid for _, pid in set(zip(t["request_id"], t["prompt_id"])))
    retry = Counter(str(r["id"]) for rows, _seed in d["retry"] for r in rows)
    return {"drawn": drawn_prompts(cfg, d["source"]), "trained": trained, "buffered": buffered, "retry": retry,
            "groups": [g for step in d["trained_groups"] for g in step]}


def assert_nothing_lost_or_repeated(cfg, ckpt_dir) -> dict:
    """Every drawn prompt is trained or waiting exactly once; no group is trained twice."""
    a = checkpoint_accounting(cfg, ckpt_dir)
    assert len(a["groups"]) == len(set(a["groups"])), "a group was trained twice"
    assert max(a["drawn"].values(), default=1) == 1, "the test must draw less than an epoch"
    placed = a["trained"] + a["buffered"] + a["retry"]
    lost, twice = a["drawn"] - placed, placed - a["drawn"]
    assert not lost, f"prompts drawn but neither trained nor waiting: {sorted(lost)[:10]}"
    assert not twice, f"prompts trained or waiting more often than drawn: {sorted(twice)[:10]}"
    return a
