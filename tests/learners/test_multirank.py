"""Multi-rank DeepSpeed on a real torch.distributed world (gloo on CPU, NCCL on 2 GPUs under -m gpu):
2 ranks under ZeRO-2 and ZeRO-3, on batches of an odd number of groups with invalid samples,
match 1 rank over 3 steps; a 2-rank stop-and-resume continues exactly. The 2-rank run also
exercises the all-reduced statistics (whitening, token counts, mismatch) on the backend's
device and the zero-gradient passes that keep uneven shards' collectives paired.

Tolerance 2 ranks vs 1 rank (fp32): losses and grad norm rel 1e-5, weights rtol 1e-5 /
atol 1e-6 after 3 AdamW steps at lr 1e-3 (the only differences are summation orders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = os.path.join(ROOT, "tests", "learners", "_ds_worker.py")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL between 2 ranks needs 2 GPUs")])]


@pytest.fixture
def ext_dir(ds_ext):
    return ds_ext  # DeepSpeed's CPU comm op built once per session, not per spawn


def _run(tmp_path, ext_dir: str, name: str, **spec) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    spec = {"out": str(out), **spec}
    path = out / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, WORKER, str(path)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": ext_dir})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"result-rank{r}.pt", weights_only=False) for r in range(spec["world"])]


def _global(results: list[dict], step: int, key: str) -> float:
    """A per-rank token mean -> the token mean of the whole batch."""
    ms = [r["metrics"][step] for r in results]
    w = [m["perf/train_valid_tokens"] for m in ms]
    return sum(m[key] * wi for m, wi in zip(ms, w)) / sum(w)


@pytest.mark.distributed
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zero", [2, 3])
def test_two_ranks_match_one_rank_over_three_steps(tiny_model, tmp_path, zero, device, ext_dir):
    common = {"model": tiny_model, "device": device, "zero": zero, "steps": [1, 2, 3]}
    one = _run(tmp_path, ext_dir, "one", world=1, **common)
    two = _run(tmp_path, ext_dir, "two", world=2, **common)
    assert [m["actor/updates"] for m in two[0]["metrics"]] == [1.0, 1.0, 1.0]
    assert two[0]["ref_device"].startswith(device) and two[1]["ref_device"].startswith(device)
    # uneven shards: rank 0 holds 3 groups (12 rows, 3 micro-batches), rank 1 holds 2 (8 rows, 2 + 1 zero pass)
    from prorl_async.learners.batch import shard_groups
    from tests.learners._ds_worker import batch
    assert [shard_groups(batch(1), r, 2).num_rows for r in range(2)] == [12, 8]
    for s in range(3):
        m1 = one[0]["metrics"][s]
        assert sum(r["metrics"][s]["perf/train_valid_tokens"] for r in two) == m1["perf/train_valid_tokens"]
        for key in ("actor/pg_loss", "kl/loss_term", "actor/entropy"):
            assert _global(two, s, key) == pytest.approx(m1[key], rel=1e-5, abs=1e-7), (s, key)
        for r in two:  # global quantities, identical on every rank
            assert r["metrics"][s]["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
            assert r["metrics"][s]["mismatch/all_kl_k3"] == pytest.approx(m1["mismatch/all_kl_k3"], rel=1e-5)
            assert r["metrics"][s]["mismatch/all_tokens"] == m1["mismatch/all_tokens"]
    w1, w2 = one[0]["weights"], two[0]["weights"]
    assert w1.keys() == w2.keys()
    for n in w1:
        # float noise: with shared prefixes (train.share_prefixes) a rank packs the prefix tree of its own
        # groups, so the two runs add gradients in another order (CI: 1 of 16,384 weights 1.3e-6 apart)
        torch.testing.assert_close(w2[n], w1[n], rtol=1e-5, atol=3e-6)
    from prorl_async.models import load_model

    init = dict(load_model(tiny_model, "float32").named_parameters())
    moved = sum(not torch.equal(init[n].detach(), w1[n]) for n in w1)
    assert moved > len(w1) // 2  # the three steps trained


@pytest.mark.distributed
def test_two_ranks_reset_their_references_together_on_the_whole_batchs_kl(tiny_model, tmp_path, ext_dir):
    """A KL reset is decided on the whole batch's KL, the same on every rank: with a level between
    the two ranks' own KL means, deciding on them would reset one rank's reference and optimizer only."""
    common = {"model": tiny_model, "device": "cpu", "zero": 2, "world": 2, "steps": [1, 2]}
    free = _run(tmp_path, ext_dir, "free", **common)
    own = [r["metrics"][1]["kl/loss_term"] for r in free]  # step 2: the first with KL (step 1 trains from the reference)
    assert own[0] != own[1] and min(own) > 0
    for r in free:  # the judged KL: the token mean of the whole batch, alike on both ranks
        assert r["batch_kl"][1] == pytest.approx(_global(free, 1, "kl/loss_term"), rel=1e-9)
    assert free[0]["batch_kl"] == free[1]["batch_kl"]
    level = sum(own) / 2
    capped = _run(tmp_path, ext_dir, "capped", overrides=[f"algo.ref_kl_max={level}"], **common)
    fired = capped[0]["batch_kl"][1] > level
    assert [r["resets"]["ref/resets_kl_spike"] for r in capped] == [float(fired)] * 2
    assert [r["metrics"][1].get("ref/reset_kl_spike", 0.0) for r in capped] == [float(fired)] * 2


@pytest.mark.distributed
def test_two_rank_stop_and_resume_continues_exactly(tiny_model, tmp_path, ext_dir):
    common = {"model": tiny_model, "device": "cpu", "zero": 2, "world": 2}
    straight = _run(tmp_path, ext_dir, "straight", steps=[1, 2, 3], **common)
    ckpt = str(tmp_path / "ckpt")
    _run(tmp_path, ext_dir, "first", steps=[1, 2], save=ckpt, **common)
    resumed = _run(tmp_path, ext_dir, "resumed", steps=[3], load=ckpt, **common)
    assert resumed[0]["version"] == straight[0]["version"] == 3
    for r in range(2):
        a, b = straight[r]["metrics"][2], resumed[r]["metrics"][0]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "kl/loss_term"):
            assert a[key] == b[key], (r, key)
    for n, t in straight[0]["weights"].items():
        assert torch.equal(t, resumed[0]["weights"][n]), n
