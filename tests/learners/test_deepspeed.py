"""DeepSpeed learner: first step equals TorchLearner, a few finite steps, reference reset with
optimizer reset, and the 2-rank split of the advantages equals one rank on the whole batch."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from prorl_async.config import load_config

from tests.learners._batches import graded_table

pytest.importorskip("deepspeed")


def _cfg(tiny_model, **over):
    items = [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4", "train.micro_batch_size=8",
             "train.lr=1e-3", "algo.kl_coef=0.001", "model.autocast_bf16=false", "train.learner=deepspeed",
             "train.zero_stage=2", "train.mini_batches=1"] + [f"{k}={v}" for k, v in over.items()]
    return load_config(None, items)


def test_several_optimizer_steps_per_learner_step_match_torch_learner(tiny_model, ds_ext):
    """Two mini-batches and an LR warm-up: DeepSpeed steps its schedule per optimizer step,
    the learner counts learner steps as TorchLearner does, so both give the same weights."""
    from prorl_async.learners.deepspeed import DeepSpeedLearner
    from prorl_async.learners.torch_learner import TorchLearner

    cfg = _cfg(tiny_model, **{"train.mini_batches": 2, "train.warmup_lr_steps": 5})
    table = graded_table(groups=4, n=4, seed=2)
    tl, dl = TorchLearner(cfg, tiny_model), DeepSpeedLearner(cfg, tiny_model)
    for step in range(2):
        mt, md = tl.train_step(table, step), dl.train_step(table, step)
        assert md["actor/lr"] == pytest.approx(mt["actor/lr"])
        assert md["actor/pg_loss"] == pytest.approx(mt["actor/pg_loss"], rel=1e-4, abs=1e-6)
    for (_, p1), (_, p2) in zip(tl.named_tensors(), dl.named_tensors()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5)


def test_first_step_matches_torch_learner_then_trains_and_resets(tiny_model, ds_ext):
    from prorl_async.learners.deepspeed import DeepSpeedLearner
    from prorl_async.learners.torch_learner import TorchLearner

    cfg = _cfg(tiny_model)
    table = graded_table(groups=4, n=4, seed=1)
    tl = TorchLearner(cfg, tiny_model)
    dl = DeepSpeedLearner(cfg, tiny_model)
    mt, md = tl.train_step(table, 0), dl.train_step(table, 0)
    assert math.isfinite(md["actor/pg_loss"])
    assert md["actor/pg_loss"] == pytest.approx(mt["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert md["actor/grad_norm"] == pytest.approx(mt["actor/grad_norm"], rel=1e-3)
    for (n1, p1), (n2, p2) in zip(tl.named_tensors(), dl.named_tensors()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5)
    for s in range(1, 3):
        m = dl.train_step(graded_table(groups=4, n=4, seed=10 + s), s)
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
    from prorl_async.learners.deepspeed import _base_optimizer
    assert len(_base_optimizer(dl.opt).state) > 0
    dl.reset_reference("test")
    assert len(_base_optimizer(dl.opt).state) == 0
    for (n, p), (_, r) in zip(dl.named_tensors(), dl.ref.named_parameters()):
        torch.testing.assert_close(p, r)
    m = dl.train_step(graded_table(groups=4, n=4, seed=99), 3)  # trains on after the reset
    assert math.isfinite(m["actor/pg_loss"]) and m["kl/loss_term"] == pytest.approx(0.0, abs=1e-6)


def test_in_process_learner_leaves_the_environment_as_it_found_it(tiny_model, ds_ext):
    """torch.distributed's and DeepSpeed's variables (MASTER_ADDR, RANK, LOCAL_RANK, ...) are set
    only while the learner builds its world and its engine: a process its caller starts later (a
    CLI run, a worker rank) inherits no world that is not its own. The learner trains without them."""
    from prorl_async.learners.deepspeed import DeepSpeedLearner

    before = dict(os.environ)
    learner = DeepSpeedLearner(_cfg(tiny_model), tiny_model)
    assert dict(os.environ) == before
    assert math.isfinite(learner.train_step(graded_table(groups=4, n=4, seed=1), 0)["actor/pg_loss"])
    assert dict(os.environ) == before


def test_a_learner_trains_after_someone_else_destroyed_the_world(tiny_model, ds_ext):
    """An in-process vLLM engine destroys the torch.distributed world at its shutdown; DeepSpeed's
    cached groups of that world (its clone of it among them) must not outlive it: the next learner
    builds a new world and trains (before: "Group ... is not registered" at deepspeed.initialize)."""
    import torch.distributed as dist

    from prorl_async.learners.deepspeed import DeepSpeedLearner

    cfg = _cfg(tiny_model)
    table = graded_table(groups=4, n=4, seed=1)
    first = DeepSpeedLearner(cfg, tiny_model).train_step(table, 0)
    dist.destroy_process_group()  # as vLLM's shutdown does, behind DeepSpeed's back
    assert not dist.is_initialized()
    again = DeepSpeedLearner(cfg, tiny_model)
    assert dist.is_initialized()
    second = again.train_step(table, 0)  # the same first step, in a new world
    assert math.isfinite(second["actor/pg_loss"])
    assert second["actor/pg_loss"] == pytest.approx(first["actor/pg_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.distributed
def test_two_rank_advantages_equal_one_rank(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "_dp_worker.py")
    out = subprocess.run([sys.executable, worker, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(worker)))})
    assert out.returncode == 0, out.stderr[-3000:]
    full = torch.load(tmp_path / "full.pt")
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    T = full.shape[1]
    got = torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])
    torch.testing.assert_close(got, full, rtol=0, atol=1e-6)
