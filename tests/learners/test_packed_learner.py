"""Sequence packing inside the learner core (``train.micro_batch_tokens > 0``): one learner step
of the packed path equals the padded path (``train.micro_batch_tokens=0``) in loss, metrics,
the gradient of every optimizer step and the weights after it, for the torch learner and the
DeepSpeed ZeRO learner on CPU, on the built-in tiny model and on SmolLM2-135M when it is
installed; and the learner reads only its columns of the rollout table, from Arrow offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from prorl_async.config import load_config
from prorl_async.learners.batch import LEARNER_COLUMNS, batch_to_tensors, learner_columns

from tests.learners._batches import graded_table

LEARNERS = ["torch", pytest.param("deepspeed", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed"))]


def _cfg(model, learner: str, tokens: int, *over: str):
    return load_config(None, [f"model.path={model}", "train.prompts_per_step=4", "rollout.n=4",
                              "train.micro_batch_size=4", "train.lr=1e-3", "model.autocast_bf16=false",
                              f"train.learner={learner}", "train.zero_stage=2", "train.mini_batches=2",
                              "algo.kl_coef=0.05", "algo.entropy_coef=0.01", "rollout.temperature=0.8",
                              f"train.micro_batch_tokens={tokens}", "train.logprob_chunk_tokens=7", *over])


def _learner(kind: str, cfg, model, request):
    if kind == "deepspeed":
        request.getfixturevalue("ds_ext")
        from prorl_async.learners.deepspeed import DeepSpeedLearner
        return DeepSpeedLearner(cfg, model)
    from prorl_async.learners.torch_learner import TorchLearner
    return TorchLearner(cfg, model)


def _capture_grads(learner, kind: str) -> list[list[torch.Tensor]]:
    """The full gradient of every parameter at each optimizer step (before clipping and the step)."""
    grads: list[list[torch.Tensor]] = []
    finish = learner.finish_update

    def finish_update(finite):
        if kind == "deepspeed":
            from deepspeed.utils import safe_get_full_grad
            grads.append([safe_get_full_grad(p).detach().clone() for p in learner.model.parameters()])
        else:
            grads.append([p.grad.detach().clone() for p in learner.model.parameters()])
        return finish(finite)

    learner.finish_update = finish_update
    return grads


def _record_packed_calls(learner) -> list:
    """What the packed path hands the decoder body: position ids, sequence boundaries, attention."""
    calls = []

    def pre(module, args, kwargs):
        path = kwargs.get("prorl_path_index")
        calls.append((kwargs["position_ids"].detach().cpu(), kwargs["cu_seq_lens_q"].detach().cpu(),
                      None if path is None else path.cpu(), module.config._attn_implementation))

    learner.model.get_decoder().register_forward_pre_hook(pre, with_kwargs=True)
    return calls


def _assert_packed_calls(calls, shared: bool):
    assert calls and any(len(cu) > 2 for _, cu, _, _ in calls)  # several sequences shared a packed row
    for pos, cu, path, impl in calls:
        lens = (cu[1:] - cu[:-1]).tolist()
        # positions restart per sequence: along the packed row, or along each path through the prefix tree
        along = pos[0] if path is None else pos[0][path]
        assert along.tolist() == sum([list(range(n)) for n in lens], [])
        assert impl == "prorl_varlen_sdpa"  # attention cut at the boundaries (CPU)
    # with shared prefixes every micro-batch holding a group's samples packs its prompt once
    assert all((path is not None) == shared for _, _, path, _ in calls if len(cu) > 2)
    if shared:
        assert sum(p.shape[1] for p, *_ in calls) < sum(int(cu[-1]) for _, cu, _, _ in calls)


def _step_both(kind, model, table, request, tokens, *over, shared=True):
    out = []
    for t in (0, tokens):
        learner = _learner(kind, _cfg(model, kind, t, f"train.share_prefixes={str(shared).lower()}", *over),
                           model, request)
        grads = _capture_grads(learner, kind)
        calls = _record_packed_calls(learner) if t else None
        metrics = learner.train_step(table, 0)
        if t:
            _assert_packed_calls(calls, shared)
        out.append((learner, metrics, grads))
    return out


def _assert_equal_steps(padded, packed, rtol=1e-4, atol=2e-5, weights_skip=()):
    (lp, mp, gp), (lk, mk, gk) = padded, packed
    assert mk["actor/updates"] == mp["actor/updates"] == 2.0
    for key in ("actor/pg_loss", "actor/entropy", "kl/loss_term", "actor/grad_norm", "mismatch/all_kl_k3"):
        assert key in mp, key
    for key, v in mp.items():
        # actor/ and is/ *_max / *_min are token-weighted means of per-micro-batch extremes: they depend on
        # which rows share a micro-batch, which is what packing changes
        if key.startswith(("actor/", "is/")) and key.endswith(("_max", "_min")):
            assert np.isfinite(mk[key]), key
        elif not key.startswith("perf/"):
            assert mk[key] == pytest.approx(v, rel=rtol, abs=atol), key
    assert mp["kl/loss_term"] > 0  # the reference forward ran and the policy moved away from it
    assert len(gp) == len(gk) == 2
    names = [n for n, _ in lp.model.named_parameters()]
    for step, (a, b) in enumerate(zip(gp, gk)):
        for n, x, y in zip(names, a, b):
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=lambda m: f"step {step} grad {n}: {m}")
        assert max(float(x.abs().max()) for x in a) > 1e-3  # real gradients were compared
    for (n, x), (_, y) in zip(lp.named_tensors(), lk.named_tensors()):
        if n not in weights_skip:
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-prefixes", "plain"])
@pytest.mark.parametrize("kind", LEARNERS)
def test_packed_step_equals_padded_step_on_the_tiny_model(tiny_model, kind, shared, request):
    table = graded_table(groups=4, n=4, seed=5, max_resp=9)
    seq = np.array([len(p) + len(r) for p, r in zip(table.column("prompt_ids").to_pylist(),
                                                   table.column("response_ids").to_pylist())])
    tokens = 30  # several sequences per micro-batch, several micro-batches per mini-batch
    padded, packed = _step_both(kind, tiny_model, table, request, tokens, shared=shared)
    core = packed[0].core
    b = batch_to_tensors(table, 0, padded=False)
    for s in (slice(0, 8), slice(8, 16)):
        mbs = core.micro_batches(b, s)
        assert 1 < len(mbs) < 8 and any(len(m) > 1 for m in mbs)  # packed: several sequences share a row
        # the budget counts packed tokens: a shared prompt once
        assert all(int(seq[m].sum()) <= tokens for m in mbs) != shared
    _assert_equal_steps(padded, packed)


def test_packed_step_equals_padded_step_on_smollm2(smollm2_model, request):
    table = graded_table(groups=2, n=4, seed=6, vocab=2000, prompt_len=12, max_resp=16)
    # lr 1e-5, the SmolLM2 configs' own: at 1e-3 AdamW turns float noise in the tied embedding's unused rows
    # into 1e-3 steps that shift the second mini-batch's softmax normalisation by more than the tolerance
    padded, packed = _step_both("torch", smollm2_model, table, request, 64, "train.prompts_per_step=2",
                                "train.mini_batches=2", "train.logprob_chunk_tokens=16", "train.lr=1e-5")
    # the tied embedding / LM head: rows of tokens the batch never makes likely get gradients at
    # float-noise level (compared above at every step); AdamW divides them by their own tiny
    # scale, so noise-level differences become lr-sized steps -- the weights are not comparable there
    _assert_equal_steps(padded, packed, rtol=1e-3, atol=1e-4, weights_skip=("model.embed_tokens.weight",))


def test_learner_reads_only_its_columns_from_arrow_offsets():
    t = graded_table(groups=3, n=4, seed=7)
    t = t.set_column(t.column_names.index("response_text"), "response_text",
                     pa.array(["a long display text"] * t.num_rows))
    sel = learner_columns(t)
    assert sel.column_names == list(LEARNER_COLUMNS) and "response_text" not in sel.column_names
    for table in (t, pa.concat_tables([t.slice(0, 5), t.slice(5)]), t.slice(2, 7)):  # chunked, sliced
        b = batch_to_tensors(table, pad_id=0)
        prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
        beh = table.column("behavior_logprobs").to_pylist()
        for i, (p, r) in enumerate(zip(prompts, responses)):
            assert b["response_ids"][i, :len(r)].tolist() == r and b["response_ids"][i, len(r):].eq(0).all()
            assert b["behavior_logprobs"][i, :len(r)].tolist() == pytest.approx(beh[i])
            assert b["input_ids"][i, :len(p) + len(r)].tolist() == p + r
            assert int(b["attention_mask"][i].sum()) == len(p) + len(r) == int(b["seq_lens"][i])
            assert b["gather_idx"][i, 0] == len(p) - 1
        assert b["raw_reward"].tolist() == table.column("raw_reward").to_pylist()
        assert b["policy_version"].tolist() == table.column("policy_version").to_pylist()
    with pytest.raises(KeyError, match="behavior_logprobs"):
        learner_columns(t.drop_columns(["behavior_logprobs"]))
    bad = t.set_column(t.column_names.index("behavior_logprobs"), "behavior_logprobs",
                       pa.array([[0.0]] * t.num_rows, type=t.schema.field("behavior_logprobs").type))
    with pytest.raises(ValueError, match="one entry per response token"):
        batch_to_tensors(bad, pad_id=0)


def test_micro_batch_tokens_is_validated(tiny_model):
    with pytest.raises(Exception, match="train.micro_batch_tokens"):
        _cfg(tiny_model, "torch", -1)


def test_compile_is_off_on_cpu_by_default_and_validated(tiny_model):
    """``train.compile: auto`` compiles a CUDA learner only (tests/test_gpu.py runs it there);
    on CPU the learner runs eager; a bad value is one config error naming the key."""
    from prorl_async.learners.compile import compile_applies
    from prorl_async.learners.torch_learner import TorchLearner

    learner = TorchLearner(load_config(None, ["train.mini_batches=1"]), tiny_model)
    assert learner.compiled is False
    assert not any(getattr(layer, "_compiled_call_impl", None) for layer in learner.model.model.layers)
    assert compile_applies("auto", "cuda") and compile_applies("always", "cpu") and not compile_applies("never", "cuda")
    with pytest.raises(Exception, match="train.compile"):
        load_config(None, ["train.compile=sometimes"])


def test_compile_always_on_cpu_matches_eager_and_new_packings_do_not_recompile(tiny_model):
    """``train.compile=always`` on CPU (bf16 where the CPU has it): three steps on batches of
    different lengths give the eager learner's losses, gradient norms and KL; after the first
    step no new graph is compiled, although every batch packs into other sequence boundaries
    (the packed attention's host-side index plan is kept out of the compiled graphs)."""
    import math

    import torch._dynamo.utils

    from prorl_async.learners.torch_learner import TorchLearner

    base = [f"model.path={tiny_model}", "train.mini_batches=1", "train.prompts_per_step=4", "rollout.n=4",
            "train.micro_batch_tokens=128", "algo.kl_coef=0.01", "train.lr=1e-3", "train.share_prefixes=false"]
    batches = [graded_table(groups=4, n=4, seed=s, prompt_len=4 + s, max_resp=5 + 3 * s) for s in (0, 1, 2)]
    torch._dynamo.reset()
    runs, graphs = {}, []
    for mode in ("always", "never"):
        learner = TorchLearner(load_config(None, [*base, f"train.compile={mode}"]), tiny_model)
        assert learner.compiled == (mode == "always")
        runs[mode] = []
        for b in batches:
            runs[mode].append(learner.train_step(b))
            if mode == "always":
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        del learner
    torch._dynamo.reset()
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs
    for got, want in zip(runs["always"], runs["never"]):
        for k in ("actor/pg_loss", "actor/grad_norm", "kl/loss_term"):
            assert math.isfinite(got[k]) and abs(got[k] - want[k]) <= 2e-2 * max(1.0, abs(want[k])), (k, got[k], want[k])
    assert runs["always"][2]["kl/loss_term"] > 0  # the policy has moved from the reference
