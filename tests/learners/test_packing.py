"""Sequence packing from Arrow offsets: packed logprobs, PPO loss and gradients equal the padded
full-logits path on the built-in tiny model and on random Llamas (sdpa and eager attention), with
and without shared prefixes (each common prefix of a micro-batch's sequences packed once)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from prorl_async.algo.losses import policy_loss
from prorl_async.learners.logprobs import packed_logprobs
from prorl_async.learners.packing import (_token_matrix, list_column, pack_micro_batch, pack_rollouts,
                                          pack_shared_micro_batch, plan_micro_batches, plan_shared_micro_batches,
                                          prefix_order)
from tests.learners._batches import graded_table


def test_list_column_reads_arrow_offsets_for_chunked_and_sliced_tables():
    t = graded_table(groups=3, n=4, seed=1)
    t2 = pa.concat_tables([t.slice(0, 5), t.slice(5)])  # two chunks
    for table in (t, t2, t.slice(3, 6)):
        values, offsets = list_column(table, "response_ids")
        want = table.column("response_ids").to_pylist()
        assert [values[offsets[i]:offsets[i + 1]].tolist() for i in range(table.num_rows)] == want
        assert len(offsets) == table.num_rows + 1 and values.dtype == np.int32
    values, _ = list_column(t, "prompt_ids")  # one chunk: a view of Arrow's buffer, not a copy
    buf = t.column("prompt_ids").chunk(0).values.buffers()[1]
    assert values.__array_interface__["data"][0] == buf.address
    with pytest.raises(KeyError, match="no column 'nope'"):
        list_column(t, "nope")
    with pytest.raises(TypeError, match="must be a list column"):
        list_column(t, "raw_reward")


def test_plan_fills_micro_batches_by_tokens_and_keeps_every_row_once():
    lens = np.array([5, 9, 3, 7, 2, 8, 4, 6])
    plan = plan_micro_batches(lens, 12)
    rows = np.concatenate(plan)
    assert sorted(rows.tolist()) == list(range(8))
    assert all(int(lens[p].sum()) <= 12 for p in plan)
    assert len(plan) == 4  # 52 tokens: first-fit decreasing fills 4 bins of 12 (9+3, 8+4, 7+5, 6+2)
    with pytest.raises(ValueError, match="train.micro_batch_tokens=8"):
        plan_micro_batches(lens, 8)


def test_packed_layout_positions_restart_and_targets_are_the_response_tokens():
    t = graded_table(groups=2, n=3, seed=2)
    rows = np.array([0, 2, 5])
    mb = pack_micro_batch(list_column(t, "prompt_ids"), list_column(t, "response_ids"), rows,
                          list_column(t, "behavior_logprobs"))
    prompts, responses = t.column("prompt_ids").to_pylist(), t.column("response_ids").to_pylist()
    seqs = [prompts[r] + responses[r] for r in rows]
    assert mb.input_ids[0].tolist() == sum(seqs, [])
    assert mb.position_ids[0].tolist() == sum([list(range(len(s))) for s in seqs], [])
    assert mb.cu_seqlens.tolist() == np.cumsum([0] + [len(s) for s in seqs]).tolist()
    assert mb.targets.tolist() == sum([responses[r] for r in rows], [])
    assert torch.equal(mb.input_ids[0, mb.loss_index + 1], mb.targets)
    assert mb.token_rows.tolist() == sum([[r] * len(responses[r]) for r in rows], [])
    beh = t.column("behavior_logprobs").to_pylist()
    assert mb.behavior_logprobs.tolist() == pytest.approx(sum([beh[r] for r in rows], []))


def _with_shared_openings(table):
    """``table`` plus, for every third row, a copy whose response is that row's opening (its first
    half) followed by other tokens, and one exact duplicate of row 1: prefixes shared past the prompt."""
    extra = []
    responses = table.column("response_ids").to_pylist()
    for i in range(0, table.num_rows, 3):
        row = table.slice(i, 1).to_pylist()[0]
        resp = responses[i]
        row["response_ids"] = resp[: max(1, len(resp) // 2)] + [7, 8, 2]
        row["behavior_logprobs"] = [-0.5] * len(row["response_ids"])
        row["sample_id"] += "-opening"
        extra.append(row)
    extra.append({**table.slice(1, 1).to_pylist()[0], "sample_id": "duplicate"})
    return pa.concat_tables([table, pa.Table.from_pylist(extra, schema=table.schema)]).combine_chunks()


def test_shared_prefix_layout_is_the_prefix_tree_of_the_sequences():
    t = _with_shared_openings(graded_table(groups=3, n=3, seed=2))
    prompt, response, beh = (list_column(t, c) for c in ("prompt_ids", "response_ids", "behavior_logprobs"))
    rows = np.arange(t.num_rows)
    mb = pack_shared_micro_batch(prompt, response, rows, beh)
    prompts, responses = t.column("prompt_ids").to_pylist(), t.column("response_ids").to_pylist()
    seqs = [prompts[r] + responses[r] for r in rows]
    # one packed token per distinct prefix: the nodes of the sequences' prefix tree
    prefixes = {tuple(s[:d + 1]) for s in seqs for d in range(len(s))}
    assert mb.num_tokens == len(prefixes) < sum(len(s) for s in seqs) - 2 * 3 * 4
    assert mb.sequence_tokens == sum(len(s) for s in seqs)
    ids, pos, path = mb.input_ids[0], mb.position_ids[0], mb.path_index
    cu = mb.cu_seqlens.tolist()
    for j, s in enumerate(seqs):  # each sequence's path spells it, at positions 0..L-1
        p = path[cu[j]:cu[j + 1]]
        assert ids[p].tolist() == s and pos[p].tolist() == list(range(len(s)))
    assert torch.equal(path[mb.owner], torch.arange(mb.num_tokens))  # every node output from a path through it
    assert mb.targets.tolist() == sum(responses, [])
    # response token k is predicted from the node of the token before it on the row's own path
    at = torch.cat([torch.arange(len(prompts[r]) - 1, len(seqs[r]) - 1) + cu[r] for r in rows])
    assert torch.equal(mb.loss_index, path[at])
    assert mb.token_rows.tolist() == sum([[r] * len(responses[r]) for r in rows], [])
    assert mb.behavior_logprobs.tolist() == pytest.approx(sum(t.column("behavior_logprobs").to_pylist(), []))
    # no shared token: exactly the plain packing
    prompt = (np.array([5, 6, 7, 8]), np.array([0, 2, 4]))
    response = (np.array([9, 10, 11]), np.array([0, 1, 3]))
    solo = pack_shared_micro_batch(prompt, response, np.array([0, 1]))
    plain = pack_micro_batch(prompt, response, np.array([0, 1]))
    assert solo.path_index is None and torch.equal(solo.input_ids, plain.input_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_order_is_a_trie_order_with_the_longest_common_prefixes(seed):
    """Checked against a brute force over every pair: rows that are prefixes of other rows,
    duplicates, token ids up to 2**31 - 1 and 0 (the byte-string sort must not confuse them with
    the end marker), sequences of different lengths."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 3, size=int(rng.integers(1, 6))).tolist() for _ in range(4)]
    seqs = []
    for _ in range(40):
        s = list(stems[int(rng.integers(0, 4))]) + rng.choice([0, 1, 2**31 - 1], size=int(rng.integers(0, 6))).tolist()
        seqs.append(s + [7] if not s else s)
    seqs += [seqs[3], seqs[3][:1] or [0]]  # a duplicate, and a prefix of another row
    cut = [int(rng.integers(1, len(s) + 1)) for s in seqs]  # split each into prompt and response
    off = lambda parts: np.concatenate([[0], np.cumsum([len(x) for x in parts])]).astype(np.int64)
    prompts, responses = [s[:c] for s, c in zip(seqs, cut)], [s[c:] for s, c in zip(seqs, cut)]
    prompt = (np.array(sum(prompts, []), dtype=np.int32), off(prompts))
    response = (np.array(sum(responses, []), dtype=np.int32), off(responses))
    mat, lens, _ = _token_matrix(prompt, response, np.arange(len(seqs)))
    order, lcp = prefix_order(mat, lens)
    assert sorted(order.tolist()) == list(range(len(seqs)))

    def common(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    for i in range(1, len(seqs)):
        here = seqs[order[i]]
        assert lcp[i] == common(here, seqs[order[i - 1]])
        assert lcp[i] == max(common(here, seqs[order[j]]) for j in range(i))  # no earlier row shares more
    assert lcp[0] == 0


def test_shared_plan_counts_a_shared_prefix_once_and_keeps_every_row_once():
    t = graded_table(groups=6, n=4, seed=7, prompt_len=12, max_resp=6)
    prompt, response = list_column(t, "prompt_ids"), list_column(t, "response_ids")
    rows = np.arange(t.num_rows)
    lens = np.diff(prompt[1]) + np.diff(response[1])
    plain = plan_micro_batches(lens, 40)
    shared = plan_shared_micro_batches(prompt, response, rows, 40)
    assert sorted(np.concatenate(shared).tolist()) == rows.tolist()
    sizes = [pack_shared_micro_batch(prompt, response, m).num_tokens for m in shared]
    assert max(sizes) <= 40 < max(int(lens[m].sum()) for m in shared)  # over budget unless shared once
    assert len(shared) < len(plain)
    with pytest.raises(ValueError, match="train.micro_batch_tokens=8"):
        plan_shared_micro_batches(prompt, response, rows, 8)


def _padded_logprobs(model, table, temperature=1.0):
    """The padded reference: right-padded rows, attention mask, full fp32 log-softmax."""
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    S = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    att = torch.zeros(len(prompts), S, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        att[i, :len(p) + len(r)] = 1
    logits = model(input_ids=ids, attention_mask=att).logits.float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        out.append(logp_all[i, pos].gather(-1, torch.tensor(r)[:, None]).squeeze(-1))
    return out  # one [len(response)] tensor per row


def _ppo_loss(logp, old, adv, num_tokens):
    logp, old, adv = logp[None], old[None], adv[None]  # [1, tokens]: packed tokens as one row
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(logp), behavior_logprobs=old - 0.05, num_tokens=num_tokens)
    return loss


def _compare(model, table, micro_batch_tokens, temperature=1.0, atol=2e-5, share=False):
    n_tokens = sum(len(r) for r in table.column("response_ids").to_pylist())
    g = torch.Generator().manual_seed(0)
    adv_rows = torch.randn(table.num_rows, generator=g)
    old = [-torch.rand(len(r), generator=g) for r in table.column("response_ids").to_pylist()]

    model.zero_grad()
    ref = _padded_logprobs(model, table, temperature)
    ref_loss = _ppo_loss(torch.cat(ref), torch.cat(old), torch.cat([adv_rows[i].expand(len(o)) for i, o in
                                                                   enumerate(old)]), n_tokens)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    mbs = pack_rollouts(table, micro_batch_tokens, share_prefixes=share)
    assert len(mbs) > 1 and all(mb.num_tokens <= micro_batch_tokens for mb in mbs)
    if share:  # the prompts (and some openings) were packed once per micro-batch
        assert all(mb.path_index is not None for mb in mbs)
        assert sum(mb.num_tokens for mb in mbs) < 0.8 * sum(mb.sequence_tokens for mb in mbs)
    total, got = 0.0, [None] * table.num_rows
    for mb in mbs:
        logp, _ = packed_logprobs(model, mb, temperature=temperature, chunk_tokens=7)
        old_mb = torch.cat([old[r] for r in mb.rows.tolist()])
        loss = _ppo_loss(logp, old_mb, adv_rows[mb.token_rows], n_tokens)  # micro-batches add up to the mean
        loss.backward()
        total += float(loss.detach())
        for r in mb.rows.tolist():
            got[r] = logp.detach()[mb.token_rows == r]
    err = max(float((a - b.detach()).abs().max()) for a, b in zip(got, ref))
    assert err < atol, f"packed vs padded logprobs differ by {err:.2e}"
    assert total == pytest.approx(float(ref_loss), abs=atol)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=atol, msg=n)
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-4  # a real gradient was compared
    return err


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prefixes"])
def test_packed_equals_padded_on_the_builtin_tiny_model(tiny_model, share):
    from prorl_async.models import load_model

    model = load_model(tiny_model, "float32")
    table = graded_table(groups=4, n=4, seed=3, vocab=20)
    if share:
        table = _with_shared_openings(table)
    _compare(model, table, micro_batch_tokens=40, temperature=0.8, share=share)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prefixes"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded_on_a_random_llama(attn, share):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    table = graded_table(groups=5, n=3, seed=4, vocab=300, prompt_len=9, max_resp=20)
    err = _compare(model, _with_shared_openings(table) if share else table, micro_batch_tokens=64, share=share)
    print(f"{attn}: max |packed - padded| logprob = {err:.1e}")


def _varlen_kernel_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=None, enable_gqa=False):
    """torch's varlen flash attention's contract on CPU (it runs on CUDA only): packed
    ``[N, heads, d]`` q/k/v cut at ``cu_q``, causal, ``[N, heads, d]`` out."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    outs = [torch.nn.functional.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)),
                                                             is_causal=True, scale=scale, enable_gqa=enable_gqa)
            for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
    return torch.cat(outs, 1).transpose(0, 1)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prefixes"])
def test_packed_equals_padded_through_the_gpu_varlen_branch(monkeypatch, share):
    """The branch a bf16 GPU learner takes (torch's varlen flash attention, ``_flash_varlen``),
    here with a CPU stand-in for the kernel: its output has the shape the other branches give,
    so shared prefixes (each path's output taken back per packed position) and the layers after
    it see the same tensor; logprobs and gradients equal the padded model's. The real kernel
    runs in tests/test_gpu.py (a CUDA learner step with shared prefixes, the default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prorl_async.learners import attention

    calls = []
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (_varlen_kernel_stand_in, ({"window_size": (-1, 0)}, True)))
    monkeypatch.setattr(attention, "_flash_varlen_applies", lambda q, p: calls.append(1) or not p)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    table = graded_table(groups=5, n=3, seed=4, vocab=300, prompt_len=9, max_resp=20)
    _compare(model, _with_shared_openings(table) if share else table, micro_batch_tokens=64, share=share)
    assert calls, "the varlen branch was not reached"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lens", [[7, 1, 12, 5, 9], [40, 3, 2, 4, 1, 2]], ids=["one-bucket", "long-and-short"])
def test_varlen_sdpa_equals_one_causal_attention_per_sequence(lens, dtype):
    """The packed attention (right-padded batches of sequences, bucketed by length) gives each
    sequence's own causal attention, values and gradients, with grouped key/value heads; a long
    sequence among short ones is not padded to: the buckets stay within twice their tokens.
    bf16 (on CPU: the matmul + fp32 softmax path) against the float64 reference, to bf16 tolerance."""
    from types import SimpleNamespace

    from prorl_async.learners.attention import _length_buckets, varlen_sdpa_attention

    torch.manual_seed(0)
    n, heads, kv, d = sum(lens), 4, 2, 8
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    q0 = torch.randn(1, n, heads, d, dtype=torch.float64)
    k0, v0 = torch.randn(1, n, kv, d, dtype=torch.float64), torch.randn(1, n, kv, d, dtype=torch.float64)
    g = torch.randn(1, n, heads, d, dtype=torch.float64)
    module = SimpleNamespace(num_key_value_groups=heads // kv, training=False)

    def run(fn, dt=torch.float64):
        q, k, v = (x.to(dt).requires_grad_() for x in (q0, k0, v0))
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # HF hands [1, heads, N, d] views
        out.backward(g.to(dt))
        return [t.double() for t in (out, q.grad, k.grad, v.grad)]

    def reference(q, k, v):
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        outs = [torch.nn.functional.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                                 is_causal=True)
                for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(outs, 2).transpose(1, 2)

    got = run(lambda q, k, v: varlen_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu)[0], dtype)
    want = run(reference)
    assert got[0].shape == (1, n, heads, d)
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
        assert float(b.detach().abs().max()) > 0.1, name  # real values were compared
    buckets = _length_buckets(np.asarray(lens))
    assert sorted(np.concatenate(buckets).tolist()) == list(range(len(lens)))
    for bk in buckets:
        assert len(bk) * max(lens[i] for i in bk) <= 2 * sum(lens[i] for i in bk)
    assert len(buckets) == (1 if max(lens) < 20 else 2)
