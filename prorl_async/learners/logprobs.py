"""The learner's forward passes: per-response-token logprobs (and entropies) of a batch's rows.

Two paths, chosen by ``train.micro_batch_tokens``:

* packed (``> 0``, the default): :func:`packed_token_logprobs` packs the rows into one
  padding-free micro-batch (:mod:`prorl_async.learners.packing`) and runs
  :func:`packed_logprobs` on it: the decoder body on the packed row with attention kept inside
  each sequence (:mod:`prorl_async.learners.attention`), then the LM head and log-softmax on the
  response positions only, in chunks (:func:`prorl_async.algo.token_logprobs.token_logprobs`).
  :func:`packed_logprobs` is the one packed path: training and
  ``benchmarks/bench_learner.py --mode packing`` both call it;
* padded (``0``): :func:`padded_token_logprobs`, right-padded rows with an attention mask and
  full logits at every position.

Both return ``[len(rows), T]`` tensors in the padded layout (zeros past each response) and give
the same values to float tolerance (tests/learners/test_packing.py, test_packed_learner.py).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from prorl_async.algo.losses import entropy_from_logits, logprobs_from_logits
from prorl_async.algo.token_logprobs import token_logprobs as chunked_token_logprobs
from prorl_async.learners.attention import attn_implementation, packed_attention_kwargs, register_varlen_sdpa
from prorl_async.learners.packing import PackedMicroBatch, pack_micro_batch, pack_shared_micro_batch


def autocast_ctx(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def padded_token_logprobs(model, b: dict, rows: slice, temperature: float, device, autocast: bool,
                          with_entropy: bool = False, entropy_grad: bool = True):
    """Per-response-token logprobs (and entropies) at the sampling temperature: the padded path
    (``train.micro_batch_tokens=0``), full logits of every padded position."""
    device = torch.device(device)
    ids = b["input_ids"][rows].to(device)
    att = b["attention_mask"][rows].to(device)
    with autocast_ctx(device, autocast):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits.float() / temperature
    idx = b["gather_idx"][rows].to(device)
    picked = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [n, T, V]
    logp = logprobs_from_logits(picked, b["response_ids"][rows].to(device))
    ent = entropy_from_logits(picked if entropy_grad else picked.detach()) if with_entropy else None
    return logp, ent


def _hf_module(model):
    """The HF causal LM inside a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def _zero3_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and getattr(p, "ds_status", None) is not None and p.numel() == 0


def packed_logprobs(model, mb: PackedMicroBatch, *, temperature: float = 1.0, chunk_tokens: int = 1024,
                    with_entropy: bool = False, autocast: bool = False, compiled: bool = False,
                    device=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs ``[M]`` (and entropies ``[M]``) of packed micro-batch ``mb``'s response tokens
    under an HF causal LM (or a DeepSpeed engine holding one), at ``temperature``; float32,
    differentiable. ``device``: where the model is (default: where ``mb`` is).

    ``position_ids`` restart at 0 per sequence, no ``attention_mask`` is passed, and the
    sequence boundaries go to the attention function as flash-attention's varlen kwargs
    (``cu_seq_lens_q`` ...): flash attention (GPU) uses its varlen kernels; any other
    implementation is swapped for :func:`~prorl_async.learners.attention.varlen_sdpa_attention`
    for the call (the sequences as one right-padded batch of causal attention: about
    ``sum L_i^2`` work, no ``N x N`` mask, the CPU choice), so attention never crosses sequences;
    a micro-batch with shared prefixes always goes through it (paths through the prefix tree).
    The decoder body runs on the packed row; the LM head and log-softmax run on the response
    positions only, ``chunk_tokens`` at a time (:func:`prorl_async.algo.token_logprobs.token_logprobs`),
    so no ``tokens x vocab`` fp32 tensor exists. Under ZeRO-3 (the head's weight is partitioned
    and only a module call gathers it) the head runs as a module call on the response positions."""
    device = mb.input_ids.device if device is None else torch.device(device)
    hf = _hf_module(model)
    body = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.model
    head = hf.get_output_embeddings()
    ids, pos = mb.input_ids.to(device), mb.position_ids.to(device)
    impl = hf.config._attn_implementation or "sdpa"
    # flash attention reads the boundaries itself (varlen kernels); anything else, and shared
    # prefixes (paths through the prefix tree): varlen_sdpa_attention
    varlen = impl if impl.startswith("flash_attention") and mb.path_index is None else register_varlen_sdpa()
    with autocast_ctx(device, autocast), attn_implementation(hf.config, varlen):
        hidden = body(input_ids=ids, position_ids=pos, use_cache=False,
                      **packed_attention_kwargs(mb, device)).last_hidden_state
    h = hidden[0].index_select(0, mb.loss_index.to(device))
    targets = mb.targets.to(device)
    if isinstance(head, torch.nn.Linear) and not _zero3_partitioned(head.weight):
        w, bias = head.weight, head.bias
        dtype = torch.bfloat16 if autocast else w.dtype  # what autocast would run the head in
        logp, ent = chunked_token_logprobs(h.to(dtype), w.to(dtype), targets,
                                           bias=None if bias is None else bias.to(dtype), temperature=temperature,
                                           chunk_tokens=chunk_tokens, with_entropy=with_entropy, compiled=compiled)
    else:
        with autocast_ctx(device, autocast):
            logits = head(h)
        logits = logits.float() / temperature
        logp = logprobs_from_logits(logits, targets)
        ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def packed_token_logprobs(model, b: dict, rows, temperature: float, device, autocast: bool,
                          with_entropy: bool = False, chunk_tokens: int = 1024, compiled: bool = False,
                          share_prefixes: bool = False):
    """Per-response-token logprobs (and entropies) of table rows ``rows`` (index array) of
    prepared batch ``b``, packed into one padding-free micro-batch
    (:func:`~prorl_async.learners.packing.pack_micro_batch`; with ``share_prefixes`` the rows'
    common prefixes -- a group's prompt, a system prompt -- computed once,
    :func:`~prorl_async.learners.packing.pack_shared_micro_batch`) and run through
    :func:`packed_logprobs`.

    Returns ``[len(rows), T]`` tensors in the padded path's layout (zeros past each response)."""
    device = torch.device(device)
    rows = np.asarray(rows, dtype=np.int64)
    mb = (pack_shared_micro_batch if share_prefixes else pack_micro_batch)(b["_prompt"], b["_response"], rows)
    logp, ent = packed_logprobs(model, mb, temperature=temperature, chunk_tokens=chunk_tokens,
                                with_entropy=with_entropy, autocast=autocast, compiled=compiled, device=device)
    rlen = torch.from_numpy(np.diff(b["_response"][1])[rows])
    T = b["mask"].shape[1]
    local = torch.repeat_interleave(torch.arange(rows.size), rlen).to(device)
    col = (torch.arange(int(rlen.sum())) - torch.repeat_interleave(torch.cumsum(rlen, 0) - rlen, rlen)).to(device)
    out_lp = logp.new_zeros((rows.size, T)).index_put((local, col), logp)
    out_ent = ent.new_zeros((rows.size, T)).index_put((local, col), ent) if with_entropy else None
    return out_lp, out_ent
