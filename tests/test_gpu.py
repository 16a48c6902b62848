"""The GPU code paths (CUDA learner with bf16 autocast, CUDA generation engine). They need a
CUDA device and skip cleanly without one; NCCL weight sync is in tests/learners/test_weight_sync.py
and the vLLM engine on GPU in tests/engines/test_vllm.py."""

import math

import pytest
import torch

from prorl_async.config import load_config
from tests.learners._batches import graded_table

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_torch_learner_step_on_cuda_with_bf16_autocast(tiny_model):
    from prorl_async.learners.torch_learner import TorchLearner

    cfg = load_config(None, ["model.autocast_bf16=true", "train.mini_batches=1", "train.prompts_per_step=4",
                             "rollout.n=4", "train.micro_batch_size=16"])
    learner = TorchLearner(cfg, tiny_model, device="cuda")
    assert learner.autocast
    before = [p.detach().clone() for p in learner.model.parameters()]
    m = learner.train_step(graded_table(groups=4, n=4))
    assert math.isfinite(m["actor/pg_loss"]) and m["actor/updates"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))


def test_hf_engine_generates_on_cuda(tiny_model):
    from prorl_async.engines.base import SamplingSpec
    from prorl_async.engines.hf import HFEngine

    eng = HFEngine(tiny_model, device="cuda")
    out = eng.generate([eng.tokenizer("12+34=")["input_ids"]], SamplingSpec(n=3, max_new_tokens=4, seed=1))
    assert len(out[0]) == 3 and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in out[0])
    assert all(lp <= 0 for c in out[0] for lp in c.logprobs)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_packed_attention_on_cuda_uses_varlen_flash_and_matches_each_sequence_alone(monkeypatch, heads, kv_heads):
    """Packed bf16 rows on a GPU go through torch's varlen flash attention; outputs and
    gradients equal causal attention of each sequence alone (fp32 reference), as the
    bucketed sdpa path's do."""
    from types import SimpleNamespace

    from prorl_async.learners import attention

    calls = []
    real = attention._flash_varlen
    monkeypatch.setattr(attention, "_flash_varlen", lambda *a: calls.append(1) or real(*a))
    lens = [37, 5, 128, 64, 1, 90]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n, d = sum(lens), 64
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(1, h, n, d, device="cuda", generator=gen) for h in (heads, kv_heads, kv_heads)]
    g_out = torch.randn(1, n, heads, d, device="cuda", generator=gen)

    def run(varlen: bool):
        monkeypatch.setattr(attention, "TORCH_VARLEN", varlen)
        q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in base)
        out, _ = attention.varlen_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(lens))
        assert out.shape == (1, n, heads, d)  # as HF's sdpa function returns it (shared prefixes index dim 1)
        out.float().mul(g_out).sum().backward()
        return out.float(), [x.grad.float() for x in (q, k, v)]

    # fp32 reference: each sequence alone through causal sdpa
    q, k, v = (x.clone().requires_grad_() for x in base)
    refs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk, vv = (x[:, :, s:e].repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        refs.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, s:e], kk, vv, is_causal=True))
    ref = torch.cat(refs, dim=2).transpose(1, 2)
    ref.mul(g_out).sum().backward()
    ref_grads = [x.grad for x in (q, k, v)]

    out_v, grads_v = run(True)
    assert calls, "the varlen flash path was not taken"
    n_calls = len(calls)
    out_b, grads_b = run(False)
    assert len(calls) == n_calls  # the bucketed path does not call it
    for out, grads in ((out_v, grads_v), (out_b, grads_b)):
        assert (out - ref).norm() / ref.norm() < 2e-2
        for g, r in zip(grads, ref_grads):
            assert torch.isfinite(g).all() and (g - r).norm() / r.norm() < 3e-2


def test_compiled_learner_on_cuda_matches_the_eager_learner(tiny_model):
    """``train.compile`` (auto = on for a CUDA learner): every decoder layer of the policy and
    the reference is compiled and the chunked LM head runs compiled; two steps on the same
    batches give the eager learner's losses, gradients and KL."""
    from prorl_async.learners.compile import decoder_layers
    from prorl_async.learners.torch_learner import TorchLearner

    base = ["model.autocast_bf16=true", "train.mini_batches=1", "train.prompts_per_step=4", "rollout.n=4",
            "train.micro_batch_tokens=256", "algo.kl_coef=0.01", "train.lr=1e-4"]
    batches = [graded_table(groups=4, n=4, seed=s) for s in (0, 1)]
    runs = {}
    for mode in ("auto", "never"):
        learner = TorchLearner(load_config(None, [*base, f"train.compile={mode}"]), tiny_model, device="cuda")
        assert learner.compiled == (mode == "auto")
        compiled = [getattr(layer, "_compiled_call_impl", None) is not None
                    for m in (learner.model, learner.ref) for layer in decoder_layers(m)]
        assert all(compiled) if mode == "auto" else not any(compiled)
        runs[mode] = [learner.train_step(b) for b in batches]
        del learner
    for got, want in zip(runs["auto"], runs["never"]):  # all_: batch 2 is behind the learner (no current tokens)
        for k in ("actor/pg_loss", "actor/grad_norm", "kl/loss_term", "mismatch/all_logprob_abs_diff_mean"):
            assert math.isfinite(got[k]) and abs(got[k] - want[k]) <= 2e-2 * max(1.0, abs(want[k])), (k, got[k], want[k])
    assert runs["auto"][1]["kl/loss_term"] > 0  # the second step's policy has moved from the reference


def test_an_update_larger_than_the_free_gpu_memory_is_refused():
    from prorl_async.receive_memory import check_update_fits, free_bytes
    from prorl_async.weight_sync import WeightSyncError

    free = free_bytes("cuda:0")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(WeightSyncError, match="rollout.gpu_memory_utilization"):
        check_update_fits([("w", (free // 2 + 2**28,), torch.bfloat16)], "cuda:0", 1, "vLLM worker rank 1")
    assert check_update_fits([("w", (free // 8,), torch.bfloat16)], "cuda:0", 2, "x") == free // 8 * 4


def test_a_one_rank_nccl_group_sends_closes_and_aborts_50_times_without_a_leak():
    import os

    import psutil

    from prorl_async.weight_sync import WeightSyncGroup, free_port

    me = psutil.Process()
    named = [("w", torch.randn(1024, 1024, device="cuda:0"))]
    seen = []
    for k in range(50):
        g = WeightSyncGroup("127.0.0.1", free_port(), 0, 1, "nccl", timeout_s=60, device="cuda:0")
        assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") is None  # set only while the group was made
        g.send(named, k + 1)
        g.close()  # aborts the communicator, then shuts the group down
        assert g.pg is None
        if k in (4, 49):
            torch.cuda.synchronize()
            listening = sum(c.status == "LISTEN" for c in me.net_connections("tcp"))
            seen.append((me.num_fds(), listening, torch.cuda.memory_allocated()))
    (fds0, listen0, mem0), (fds1, listen1, mem1) = seen
    assert fds1 <= fds0 + 2 and listen1 <= listen0 and mem1 == mem0, seen
