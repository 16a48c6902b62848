"""The learner core through both learners: exactly ``train.mini_batches`` optimizer steps
whatever the row count, the non-finite rule (weights and optimizer state bitwise unchanged,
counted, the run stops after ``train.max_skipped_steps``), and the mismatch/ metrics."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from prorl_async.config import load_config
from prorl_async.learners.batch import shard_groups
from prorl_async.learners.core import NonFiniteStepError, mini_batch_slices

from tests.learners._batches import graded_table

LEARNERS = ["torch", pytest.param("deepspeed", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed"))]


def _cfg(tiny_model, learner: str, *over: str):
    return load_config(None, [f"model.path={tiny_model}", "train.prompts_per_step=4", "rollout.n=4",
                              "train.micro_batch_size=4", "train.lr=1e-3", "model.autocast_bf16=false",
                              f"train.learner={learner}", "train.zero_stage=2", "train.mini_batches=1", *over])


def _learner(kind: str, cfg, tiny_model, request):
    if kind == "deepspeed":
        request.getfixturevalue("ds_ext")
        from prorl_async.learners.deepspeed import DeepSpeedLearner
        return DeepSpeedLearner(cfg, tiny_model)
    from prorl_async.learners.torch_learner import TorchLearner
    return TorchLearner(cfg, tiny_model)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN compares equal to the same NaN."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def _adam_state(learner) -> list[torch.Tensor]:
    from prorl_async.learners.deepspeed import _base_optimizer

    opt = _base_optimizer(learner.opt)
    return [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def test_mini_batch_slices_are_exactly_the_requested_count():
    for n, k in ((63, 4), (64, 4), (3, 4), (1, 1), (17, 3)):
        s = mini_batch_slices(n, k)
        assert len(s) == k
        assert [x.stop - x.start for x in s] == sorted((x.stop - x.start for x in s), reverse=True)
        assert max(x.stop - x.start for x in s) - min(x.stop - x.start for x in s) <= 1
        assert s[0].start == 0 and s[-1].stop == n and all(a.stop == b.start for a, b in zip(s, s[1:]))
    assert [x.stop - x.start for x in mini_batch_slices(63, 4)] == [16, 16, 16, 15]


def test_shard_groups_partitions_whole_groups_and_refuses_too_few():
    t = graded_table(groups=5, n=4)
    shards = [shard_groups(t, r, 2) for r in range(2)]
    assert [s.num_rows for s in shards] == [12, 8]
    ids = [set(s.column("prompt_id").to_pylist()) for s in shards]
    assert ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == set(t.column("prompt_id").to_pylist())
    with pytest.raises(ValueError, match="train.num_learners=6"):
        shard_groups(t, 0, 6)


@pytest.mark.parametrize("kind", LEARNERS)
def test_63_rows_in_4_mini_batches_take_4_optimizer_steps(tiny_model, kind, request):
    cfg = _cfg(tiny_model, kind, "train.mini_batches=4", "train.micro_batch_size=4")
    learner = _learner(kind, cfg, tiny_model, request)
    table = graded_table(groups=21, n=3, seed=5)
    assert table.num_rows == 63
    m = learner.train_step(table, 0)
    assert m["actor/updates"] == 4 and m["actor/skipped_updates"] == 0
    from prorl_async.learners.deepspeed import _base_optimizer
    steps = {int(st["step"]) for st in _base_optimizer(learner.opt).state.values()}
    assert steps == {4}  # AdamW itself stepped four times


@pytest.mark.parametrize("kind", LEARNERS)
def test_non_finite_step_leaves_weights_and_optimizer_bitwise_unchanged(tiny_model, kind, request):
    cfg = _cfg(tiny_model, kind, "train.max_skipped_steps=2")
    learner = _learner(kind, cfg, tiny_model, request)
    m = learner.train_step(graded_table(groups=4, n=4, seed=1), 0)
    assert m["actor/updates"] == 1 and math.isfinite(m["actor/pg_loss"])
    with torch.no_grad():  # a NaN in the embedding of BOS (token 1, first in every prompt): every logit NaN
        emb = learner.model.get_input_embeddings().weight
        emb[1, 0] = float("nan")
    before = [_bits(p) for p in learner.model.parameters()]
    adam = _adam_state(learner)
    lr = learner.lr_sched.get_last_lr()[0]
    m = learner.train_step(graded_table(groups=4, n=4, seed=2), 1)
    assert m["actor/updates"] == 0 and m["actor/skipped_updates"] == 1
    after = [_bits(p) for p in learner.model.parameters()]
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    new_adam = _adam_state(learner)
    assert len(adam) == len(new_adam) > 0 and all(torch.equal(a, b) for a, b in zip(adam, new_adam))
    assert learner.lr_sched.get_last_lr()[0] == lr  # no update, no schedule step
    with pytest.raises(NonFiniteStepError, match="train.max_skipped_steps=2"):
        learner.train_step(graded_table(groups=4, n=4, seed=3), 2)


def _with(table: pa.Table, **cols) -> pa.Table:
    for name, values in cols.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
    return table


@pytest.mark.parametrize("kind", LEARNERS)
def test_mismatch_is_zero_on_the_learners_own_logprobs_and_counts_current_tokens(tiny_model, kind, request):
    """Behaviour logprobs = the learner's own (start-of-step) logprobs on the rows generated at
    its current version, shifted by 0.5 on older rows: mismatch/ (current rows) is ~0, the
    all-token figures see the shift, and the token counts are the rows' response tokens."""
    from prorl_async.learners.batch import prepare_batch

    cfg = _cfg(tiny_model, kind)
    learner = _learner(kind, cfg, tiny_model, request)
    learner.train_step(graded_table(groups=4, n=4, seed=1), 0)  # now at version 1
    table = graded_table(groups=4, n=4, seed=7)
    current = [i % 2 == 0 for i in range(table.num_rows)]
    b, _ = prepare_batch(table, learner.pad_id, cfg, 1, learner.length_schedule)
    own = learner.core.no_grad_logprobs(learner.policy, b).cpu()
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    beh = [[float(x) + (0.0 if cur else 0.5) for x in own[i, :L]] for i, (L, cur) in enumerate(zip(lengths, current))]
    table = _with(table, behavior_logprobs=beh, policy_version=[1 if c else 0 for c in current])
    m = learner.train_step(table, 1)
    assert m["mismatch/tokens"] == sum(L for L, c in zip(lengths, current) if c)
    assert m["mismatch/all_tokens"] == sum(lengths)
    assert m["mismatch/kl_k3"] < 1e-6 and m["mismatch/logprob_abs_diff_max"] < 1e-4
    assert m["mismatch/is_outside_frac"] == 0.0
    stale = sum(L for L, c in zip(lengths, current) if not c) / sum(lengths)
    assert m["mismatch/all_logprob_abs_diff_mean"] == pytest.approx(0.5 * stale, rel=1e-3)
    k3 = math.exp(-0.5) + 0.5 - 1  # log_r = -0.5 on the shifted rows
    assert m["mismatch/all_kl_k3"] == pytest.approx(k3 * stale, rel=1e-3)
    assert m["mismatch/all_logprob_abs_diff_max"] == pytest.approx(0.5, rel=1e-4)
